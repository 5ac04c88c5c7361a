"""The ``torch.<device>``-style module verl's CPU platform hands out (``get_torch_device()``).

verl calls its accelerator's module (``torch.cuda`` on nvidia) for device bookkeeping. On the CPU
there is one device, no caching allocator and no asynchronous queue, so each function here is the
exact CPU meaning of its ``torch.cuda`` namesake: ``synchronize`` and ``empty_cache`` have nothing to
wait for or release, the RNG is torch's global generator, and the memory figures are the process's
resident memory (the CPU has no separate allocator statistics; verl reports them as metrics only).
Functions verl uses only for CUDA IPC and colocated rollout servers (``ipc_collect``,
``set_per_process_memory_fraction``) are deliberately absent: calling them raises ``AttributeError``
naming them.
"""

from __future__ import annotations

import resource
from typing import Any

import psutil
import torch
from torch.cpu import Event, Stream, current_stream, stream

from underlay.interfaces import InvalidInput

__all__ = [
    "Event",
    "Stream",
    "current_device",
    "current_stream",
    "device_count",
    "empty_cache",
    "get_device_name",
    "get_rng_state",
    "is_available",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "set_device",
    "set_rng_state",
    "stream",
    "synchronize",
]


def is_available() -> bool:
    """Always True: the CPU is there."""
    return True


def device_count() -> int:
    """1: torch addresses the host as one ``cpu`` device."""
    return 1


def current_device() -> int:
    """0, the only CPU device index."""
    return 0


def set_device(device: Any) -> None:
    """Accept index 0, ``"cpu"`` or ``torch.device("cpu")``; ``InvalidInput`` for any other device."""
    if isinstance(device, (str, torch.device)):
        d = torch.device(device)
        ok = d.type == "cpu" and d.index in (None, 0)
    else:
        ok = device == 0
    if not ok:
        raise InvalidInput(f"set_device({device!r}) on verl's CPU platform: the only device is cpu (index 0)")


def synchronize(device: Any = None) -> None:
    """No-op: CPU kernels complete before they return."""


def empty_cache() -> None:
    """No-op: the CPU allocator keeps no cache of its own to release."""


def manual_seed(seed: int) -> None:
    """Seed torch's global (CPU) generator."""
    torch.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    """Seed torch's global (CPU) generator (the only device)."""
    torch.manual_seed(seed)


def get_rng_state(device: Any = "cpu") -> torch.Tensor:
    """torch's global CPU generator state (uint8 tensor)."""
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "cpu") -> None:
    """Restore torch's global CPU generator state from :func:`get_rng_state`'s tensor."""
    torch.set_rng_state(new_state)


def get_device_name(device: Any = None) -> str:
    """``"CPU"`` (the key verl's FLOPs table uses for the host)."""
    return "CPU"


def memory_allocated(device: Any = None) -> int:
    """The process's current resident memory in bytes."""
    return int(psutil.Process().memory_info().rss)


def memory_reserved(device: Any = None) -> int:
    """Same as :func:`memory_allocated`: the CPU has no reserved-but-unallocated pool."""
    return memory_allocated(device)


def max_memory_allocated(device: Any = None) -> int:
    """The process's peak resident memory in bytes since it started (``getrusage``)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def max_memory_reserved(device: Any = None) -> int:
    """Same as :func:`max_memory_allocated`."""
    return max_memory_allocated(device)


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(available, total)`` host memory in bytes."""
    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)
