"""Checkpoint management built on the ParallelEngine interface: atomic saves, rotation, resume."""

from __future__ import annotations

from underlay.checkpoint.manager import COMPLETE_MARKER, CheckpointManager, complete_checkpoints, latest

__all__ = ["COMPLETE_MARKER", "CheckpointManager", "complete_checkpoints", "latest"]
