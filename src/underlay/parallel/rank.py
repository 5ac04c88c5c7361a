"""Which rank am I: the one answer every layer uses."""

from __future__ import annotations

import torch.distributed as dist

from underlay.utils import env

__all__ = ["current_rank", "current_world_size"]


def current_rank() -> int:
    """Global rank of this process: ``torch.distributed.get_rank()`` when a default group exists, else
    ``$RANK`` (0 when unset), so a rank known from the launcher is right before the group starts.
    Raises ``ConfigError`` when ``$RANK`` is not a non-negative integer."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    rank = env.get_int("RANK", minimum=0)
    return 0 if rank is None else rank


def current_world_size() -> int:
    """Processes in the default group, or 1 when none has been started."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1
