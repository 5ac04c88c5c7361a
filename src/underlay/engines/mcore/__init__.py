"""Megatron-Core engine (future issue)."""
