"""Performance instruments: timers, memory logging, memory snapshots.

Built on the ``Device`` interface only, so every instrument works on cpu, cuda and npu (memory
snapshots, which need the CUDA caching allocator, raise ``UnsupportedOperation`` elsewhere). Profiler
backends (ranges, traces) come from ``underlay.get_profiler()``.
"""

from __future__ import annotations

from underlay.profiling.memory import (
    aggressive_empty_cache,
    log_memory,
    log_memory_usage,
    memory_snapshot,
    record_memory_history,
)
from underlay.profiling.timing import reduce_timings, timer

__all__ = [
    "aggressive_empty_cache",
    "log_memory",
    "log_memory_usage",
    "memory_snapshot",
    "record_memory_history",
    "reduce_timings",
    "timer",
]
