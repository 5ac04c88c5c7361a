"""The ``cpu`` device: always available; reports real process memory."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from underlay.interfaces import Event, InvalidInput, MemoryStats, Stream, UnsupportedOperation
from underlay.utils.hardware import peak_flops_from_env

__all__ = ["CpuDevice", "CpuEvent", "CpuStream"]

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


class CpuStream:
    """The host thread as a stream: work is synchronous, so both methods return at once."""

    def synchronize(self) -> None:
        """Nothing is queued on the host."""

    def wait_stream(self, other: Stream) -> None:
        """Host work is already ordered."""


class CpuEvent:
    """Host timestamp taken at ``record``."""

    def __init__(self) -> None:
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        """Take the timestamp."""
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        """Host work is complete when ``record`` returns."""

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds between the two recordings."""
        if not isinstance(end, CpuEvent) or self._t is None or end._t is None:
            raise InvalidInput("elapsed_ms: both events must be recorded CpuEvents")
        return (end._t - self._t) * 1e3


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class CpuDevice:
    """``Device`` for the host CPU. ``memory_stats`` reports the process's resident memory (peak from
    ``VmHWM``, resettable on Linux through ``/proc/self/clear_refs``). ``peak_flops`` is measured once per
    dtype with a short matmul (there is no datasheet for an arbitrary CPU) unless
    ``UNDERLAY_PEAK_TFLOPS`` is set."""

    def __init__(self) -> None:
        self._peak: dict[torch.dtype, float] = {}
        self._peak_floor = 0

    @property
    def name(self) -> str:
        """``"cpu"``."""
        return "cpu"

    @property
    def device_type(self) -> str:
        """``"cpu"``."""
        return "cpu"

    @property
    def is_accelerator(self) -> bool:
        """``False``."""
        return False

    @property
    def dist_backend(self) -> str:
        """``"gloo"``."""
        return "gloo"

    @property
    def visible_devices_env(self) -> str | None:
        """``None``."""
        return None

    @property
    def ray_resource(self) -> str | None:
        """``None``: CPU actors use Ray's ``num_cpus``."""
        return None

    def model_name(self, index: int | None = None) -> str:
        """The processor model from ``/proc/cpuinfo`` (or the platform's name)."""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
        import platform

        return platform.processor() or "cpu"

    def _check(self, index: int | None) -> None:
        if index not in (None, 0):
            raise InvalidInput(f"cpu device index {index!r}: the cpu has exactly one device, index 0")

    def torch_device(self, index: int | None = None) -> torch.device:
        """``torch.device("cpu")``."""
        self._check(index)
        return torch.device("cpu")

    def device_count(self) -> int:
        """1."""
        return 1

    def set_device(self, index: int) -> None:
        """Accepts only 0."""
        self._check(index)

    def current_index(self) -> int:
        """0."""
        return 0

    def synchronize(self, index: int | None = None) -> None:
        """Host work is synchronous."""
        self._check(index)

    def memory_stats(self, index: int | None = None) -> MemoryStats:
        """Resident/virtual size and peak resident size of this process; system total and available."""
        self._check(index)
        import psutil

        mem = psutil.Process().memory_info()
        vm = psutil.virtual_memory()
        hwm = _status_kib("VmHWM")
        peak = hwm * 1024 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return MemoryStats(
            allocated=int(mem.rss),
            reserved=int(mem.vms),
            peak_allocated=int(max(peak, mem.rss)),
            total=int(vm.total),
            free=int(vm.available),
        )

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """Reset ``VmHWM`` to the current resident size (Linux); elsewhere a no-op."""
        self._check(index)
        with contextlib.suppress(OSError):
            _CLEAR_REFS.write_text("5")

    def empty_cache(self) -> None:
        """Run the garbage collector (there is no caching allocator to trim)."""
        gc.collect()

    def record_memory_history(
        self, enabled: bool = True, *, max_entries: int = 100_000, stacks: str = "python"
    ) -> None:
        """Unsupported: the cpu has no caching allocator with history."""
        raise UnsupportedOperation(self._no_history("record_memory_history"))

    def dump_memory_snapshot(self, path: str) -> None:
        """Unsupported: the cpu has no caching allocator with history."""
        raise UnsupportedOperation(self._no_history("memory_snapshot"))

    def _no_history(self, what: str) -> str:
        return (
            f"memory snapshots are unsupported on {self.name!r}: {what} needs an accelerator's caching "
            "allocator history (cuda, npu); use underlay.profiling.log_memory() here, or run on a GPU "
            "with UNDERLAY_DEVICE=cuda"
        )

    def manual_seed(self, seed: int) -> None:
        """``torch.manual_seed``."""
        torch.manual_seed(seed)

    def get_rng_state(self) -> dict[str, torch.Tensor]:
        """``{"cpu": torch.get_rng_state()}``."""
        return {"cpu": torch.get_rng_state()}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``{"cpu": ...}``."""
        if "cpu" not in state:
            raise InvalidInput(f"set_rng_state: state has keys {sorted(state)}, needs 'cpu'")
        torch.set_rng_state(state["cpu"])

    def peak_flops(self, dtype: torch.dtype = torch.bfloat16) -> float | None:
        """``UNDERLAY_PEAK_TFLOPS`` or a measured matmul rate of this process (cached per dtype)."""
        env = peak_flops_from_env()
        if env is not None:
            return env
        if dtype not in self._peak:
            n = 512
            a = torch.randn(n, n, dtype=dtype)
            b = torch.randn(n, n, dtype=dtype)
            torch.mm(a, b)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                torch.mm(a, b)
                best = min(best, time.perf_counter() - t0)
            self._peak[dtype] = 2 * n**3 / max(best, 1e-9)
        return self._peak[dtype]

    def capability(self, index: int | None = None) -> tuple[int, int] | None:
        """``None``."""
        return None

    def new_stream(self) -> Stream:
        """A host stand-in stream."""
        return CpuStream()

    def stream(self, stream: Stream) -> AbstractContextManager[Any]:
        """A null context."""
        return contextlib.nullcontext()

    def new_event(self, enable_timing: bool = True) -> Event:
        """A host-timestamp event."""
        return CpuEvent()

    def __repr__(self) -> str:
        return f"CpuDevice(threads={torch.get_num_threads()}, pid={os.getpid()})"
