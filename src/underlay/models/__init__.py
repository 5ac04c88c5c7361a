"""Hugging Face model integration: attention routing, remove-padding, Ulysses SP, fused head, TiledMLP."""
