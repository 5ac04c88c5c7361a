"""The ``Device`` protocol: one accelerator family (or the cpu) as the rest of underlay sees it."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from underlay.interfaces.types import MemoryStats

__all__ = ["Device", "Event", "Stream"]


@runtime_checkable
class Event(Protocol):
    """A point in a device's work queue that the host can wait on and time."""

    def record(self, stream: Stream | None = None) -> None:
        """Mark this event when all work queued so far (on ``stream`` or the current one) is done."""

    def synchronize(self) -> None:
        """Block the host until the recorded work has finished."""

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded; ``end`` synchronized first)."""


@runtime_checkable
class Stream(Protocol):
    """A device work queue. On cpu every stream is the host thread."""

    def synchronize(self) -> None:
        """Block until the work queued on this stream has finished."""

    def wait_stream(self, other: Stream) -> None:
        """Make future work on this stream wait for the work queued so far on ``other``."""


@runtime_checkable
class Device(Protocol):
    """A device family: ``cpu``, ``cuda`` or ``npu`` (or a plugin's).

    Every method is safe to call on a host with zero devices of the family only if the probe passed;
    the factory never returns a device whose probe failed.
    """

    @property
    def name(self) -> str:
        """Registry name, e.g. ``"cuda"``."""

    @property
    def device_type(self) -> str:
        """``torch.device(...).type`` of this family: ``"cpu"``, ``"cuda"``, ``"npu"``."""

    @property
    def is_accelerator(self) -> bool:
        """``False`` only for the cpu."""

    @property
    def dist_backend(self) -> str:
        """``torch.distributed`` backend for this device: ``"gloo"``, ``"nccl"`` or ``"hccl"``."""

    @property
    def visible_devices_env(self) -> str | None:
        """Environment variable that restricts visible devices (``CUDA_VISIBLE_DEVICES``,
        ``ASCEND_RT_VISIBLE_DEVICES``) or ``None`` on cpu."""

    @property
    def ray_resource(self) -> str | None:
        """Ray resource name that schedules one such device (``"GPU"``, ``"NPU"``), ``None`` on cpu."""

    def model_name(self, index: int | None = None) -> str:
        """Marketing name of device ``index`` (current when ``None``), e.g. ``"NVIDIA H200"``."""

    def torch_device(self, index: int | None = None) -> torch.device:
        """``torch.device`` for device ``index``; ``None`` gives the current one. Raises
        ``InvalidInput`` when ``index`` is out of ``range(device_count())``."""

    def device_count(self) -> int:
        """Number of visible devices (1 for cpu)."""

    def set_device(self, index: int) -> None:
        """Make ``index`` the current device of this process. Raises ``InvalidInput`` if out of range."""

    def current_index(self) -> int:
        """Index of the current device (0 on cpu)."""

    def synchronize(self, index: int | None = None) -> None:
        """Block the host until all queued work on the device has finished (no-op on cpu)."""

    def memory_stats(self, index: int | None = None) -> MemoryStats:
        """Memory of the device in bytes; see ``MemoryStats`` for what each field means per device."""

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """Restart ``peak_allocated`` from the current allocation."""

    def empty_cache(self) -> None:
        """Return cached, unused blocks to the driver (cpu: run the garbage collector)."""

    def record_memory_history(
        self, enabled: bool = True, *, max_entries: int = 100_000, stacks: str = "python"
    ) -> None:
        """Start (or, with ``enabled=False``, stop) recording the caching allocator's alloc/free events
        with Python (``stacks="python"``) or also C++ (``"all"``) frames, keeping the last
        ``max_entries``. Raises ``UnsupportedOperation`` where the device has no such allocator history
        (cpu) and ``InvalidInput`` for bad arguments."""

    def dump_memory_snapshot(self, path: str) -> None:
        """Write the allocator snapshot (segments, blocks and the recorded events) as a pickle to ``path``
        (for https://pytorch.org/memory_viz). Raises ``UnsupportedOperation`` where unsupported (cpu)."""

    def manual_seed(self, seed: int) -> None:
        """Seed the host RNG and every device RNG of this family."""

    def get_rng_state(self) -> dict[str, torch.Tensor]:
        """Host and current-device RNG states, as tensors (loadable with ``weights_only=True``)."""

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore states returned by ``get_rng_state``. Raises ``InvalidInput`` on a missing key."""

    def peak_flops(self, dtype: torch.dtype = torch.bfloat16) -> float | None:
        """Dense peak FLOP/s of one device for matmuls in ``dtype`` from a table of known models, or
        the value of ``UNDERLAY_PEAK_TFLOPS`` (TFLOP/s) when set. ``None`` when the model is unknown:
        callers report MFU as unavailable instead of guessing."""

    def capability(self, index: int | None = None) -> tuple[int, int] | None:
        """Compute capability (cuda ``(9, 0)`` for Hopper); ``None`` where the notion does not exist."""

    def new_stream(self) -> Stream:
        """A new work queue (cpu: a host-synchronous stand-in)."""

    def stream(self, stream: Stream) -> AbstractContextManager[Any]:
        """Context in which work is queued on ``stream``."""

    def new_event(self, enable_timing: bool = True) -> Event:
        """A new event (cpu: host timestamps)."""
