"""Device memory instruments: logging, allocator snapshots and cache release, on every device."""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from underlay.interfaces import Device, InvalidInput, MemoryStats
from underlay.parallel.rank import current_rank
from underlay.registry import get_device

__all__ = [
    "aggressive_empty_cache",
    "log_memory",
    "log_memory_usage",
    "memory_snapshot",
    "record_memory_history",
]

F = TypeVar("F", bound=Callable[..., Any])

_log = logging.getLogger("underlay.profiling")
_GIB = float(2**30)


def _resolve(device: Device | None) -> Device:
    return get_device() if device is None else device


def _check_tag(tag: str) -> None:
    if not isinstance(tag, str) or not tag:
        raise InvalidInput(f"memory tag {tag!r}: must be a non-empty str")


def _emit(
    tag: str, stats: MemoryStats, device: Device, logger: logging.Logger | None, before: MemoryStats | None
) -> None:
    log = logger or _log
    if not log.isEnabledFor(logging.INFO):
        return
    delta = ""
    if before is not None:
        delta = f" ({(stats.allocated - before.allocated) / _GIB:+.3f} during the call)"
    log.info(
        "%s [rank %d, %s] memory GiB: allocated=%.3f%s reserved=%.3f peak=%.3f free=%.3f total=%.3f",
        tag,
        current_rank(),
        device.name,
        stats.allocated / _GIB,
        delta,
        stats.reserved / _GIB,
        stats.peak_allocated / _GIB,
        stats.free / _GIB,
        stats.total / _GIB,
    )


def log_memory(tag: str, logger: logging.Logger | None = None, device: Device | None = None) -> MemoryStats:
    """Read ``device.memory_stats()`` (default device: the registry's), log it at INFO on ``logger``
    (default ``underlay.profiling``) as GiB with ``tag``, the rank and the device name, and return it.
    Works on every device (see ``MemoryStats`` for what each figure means on the cpu). Raises
    ``InvalidInput`` for an empty ``tag``."""
    _check_tag(tag)
    dev = _resolve(device)
    stats = dev.memory_stats()
    _emit(tag, stats, dev, logger, None)
    return stats


def log_memory_usage(
    tag: str | None = None, logger: logging.Logger | None = None, device: Device | None = None
) -> Callable[[F], F]:
    """Decorator: after every call of the (sync or async) function, log its device memory as
    ``log_memory`` does, with the change of ``allocated`` during the call. ``tag`` defaults to the
    function's ``__qualname__``. The function's result and exceptions pass through unchanged (nothing
    is logged when it raises)."""
    if tag is not None:
        _check_tag(tag)

    def decorate(fn: F) -> F:
        label: str = tag or str(getattr(fn, "__qualname__", repr(fn)))

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                dev = _resolve(device)
                before = dev.memory_stats()
                result = await fn(*args, **kwargs)
                _emit(label, dev.memory_stats(), dev, logger, before)
                return result

            return cast(F, awrapper)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            dev = _resolve(device)
            before = dev.memory_stats()
            result = fn(*args, **kwargs)
            _emit(label, dev.memory_stats(), dev, logger, before)
            return result

        return cast(F, wrapper)

    return decorate


def record_memory_history(
    enabled: bool = True, *, max_entries: int = 100_000, stacks: str = "python", device: Device | None = None
) -> None:
    """Start (``enabled=True``) or stop recording allocator events with their stacks for
    ``memory_snapshot``: the last ``max_entries`` allocations and frees, with Python (``stacks="python"``)
    or also C++ (``"all"``) frames. Recording slows allocation; enable it around the steps you study.
    Raises ``UnsupportedOperation`` on devices without allocator history (cpu), ``InvalidInput`` for bad
    arguments."""
    _resolve(device).record_memory_history(enabled, max_entries=max_entries, stacks=stacks)


def memory_snapshot(path: str | os.PathLike[str], device: Device | None = None) -> Path:
    """Write the CUDA caching allocator's snapshot (segments, blocks and, after
    ``record_memory_history()``, the recorded alloc/free events with stacks) as a pickle to ``path``,
    for https://pytorch.org/memory_viz. The file is written atomically; parent directories are created.
    Returns the path. Raises ``UnsupportedOperation("memory snapshots are unsupported on <device>...")``
    on devices without allocator history (cpu)."""
    dev = _resolve(device)
    target = Path(path)
    if target.is_dir():
        raise InvalidInput(f"memory_snapshot: path {os.fspath(target)!r} is a directory; give a file name")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        dev.dump_memory_snapshot(os.fspath(tmp))
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def aggressive_empty_cache(device: Device | None = None, force_sync: bool = True) -> int:
    """Free what can be freed: run the garbage collector, return cached blocks to the driver
    (``device.empty_cache()``) and, with ``force_sync``, synchronise first so that pending frees land.
    Returns the bytes by which ``memory_stats().reserved`` dropped (0 when it did not; on the cpu
    ``reserved`` is the process's virtual size)."""
    dev = _resolve(device)
    before = dev.memory_stats().reserved
    if force_sync:
        dev.synchronize()
    gc.collect()
    dev.empty_cache()
    if force_sync:
        dev.synchronize()
    return max(0, before - dev.memory_stats().reserved)
