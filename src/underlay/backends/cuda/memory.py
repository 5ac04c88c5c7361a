"""CUDA caching-allocator history recording and snapshots (``underlay.profiling.memory_snapshot``).

The snapshot is the pickle that https://pytorch.org/memory_viz reads: every segment and block of the
allocator and, while history recording is on, the last ``max_entries`` alloc/free events with stacks.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from underlay.interfaces import InvalidInput

__all__ = ["dump_snapshot", "is_recording", "start_history", "stop_history"]

_state = {"recording": False}


def start_history(max_entries: int = 100_000, stacks: str = "python") -> None:
    """Start recording alloc/free events (``torch.cuda.memory._record_memory_history``) with
    ``stacks`` (``"python"`` or ``"all"``: also C++ frames) for the last ``max_entries`` events.
    Raises ``InvalidInput`` for ``max_entries < 1`` or an unknown ``stacks``."""
    if not isinstance(max_entries, int) or max_entries < 1:
        raise InvalidInput(f"start_history: max_entries={max_entries!r} must be an int >= 1")
    if stacks not in ("python", "all"):
        raise InvalidInput(f"start_history: stacks={stacks!r}; use 'python' or 'all'")
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all", stacks=stacks, max_entries=max_entries
    )
    _state["recording"] = True


def stop_history() -> None:
    """Stop recording alloc/free events (the recorded ones stay until the next ``start_history``)."""
    torch.cuda.memory._record_memory_history(enabled=None)
    _state["recording"] = False


def is_recording() -> bool:
    """Whether ``start_history`` was called in this process without a later ``stop_history``."""
    return _state["recording"]


def dump_snapshot(path: Path) -> Path:
    """Write the allocator snapshot to ``path`` atomically (temporary file, then rename); parent
    directories are created. Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.cuda.memory._dump_snapshot(os.fspath(tmp))  # type: ignore[no-untyped-call]
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
