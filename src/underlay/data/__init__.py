"""Datasets and collation for RL training."""
