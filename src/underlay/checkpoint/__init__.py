"""Checkpoint management built on the ParallelEngine interface."""
