"""A ``Device`` over a torch accelerator module (``torch.cuda``, ``torch.npu``), shared by the cuda and npu
backends through ``torch.get_device_module`` so that neither imports the other."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch

from underlay.interfaces import Event, InvalidInput, MemoryStats, Stream, UnsupportedOperation
from underlay.utils import env as _env
from underlay.utils.hardware import lookup_peak_flops, peak_flops_from_env

__all__ = ["AcceleratorDevice", "AcceleratorEvent"]


class AcceleratorEvent:
    """``Event`` over a torch device event."""

    def __init__(self, module: Any, enable_timing: bool) -> None:
        self._event = module.Event(enable_timing=enable_timing)

    def record(self, stream: Stream | None = None) -> None:
        """Record on ``stream`` (default: the current stream)."""
        self._event.record(stream)

    def synchronize(self) -> None:
        """Wait for the recorded work."""
        self._event.synchronize()

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds to ``end`` (an ``AcceleratorEvent`` of the same device)."""
        if not isinstance(end, AcceleratorEvent):
            raise InvalidInput(
                f"elapsed_ms: end must be an event of the same device, got {type(end).__name__}"
            )
        end.synchronize()
        return float(self._event.elapsed_time(end._event))


class AcceleratorDevice:
    """Common implementation; subclasses set the class attributes and may import their extension."""

    _name: str = ""
    _dist_backend: str = ""
    _visible_env: str = ""
    _ray_resource: str = ""

    def __init__(self) -> None:
        self._mod: Any = torch.get_device_module(self._name)

    # -- identity
    @property
    def name(self) -> str:
        """Registry name."""
        return self._name

    @property
    def device_type(self) -> str:
        """``torch.device`` type."""
        return self._name

    @property
    def is_accelerator(self) -> bool:
        """Always ``True``."""
        return True

    @property
    def dist_backend(self) -> str:
        """Collective backend."""
        return self._dist_backend

    @property
    def visible_devices_env(self) -> str | None:
        """Visibility environment variable."""
        return self._visible_env

    @property
    def ray_resource(self) -> str | None:
        """Ray resource name."""
        return self._ray_resource

    def _visible_value(self) -> str:
        """The current value of the visible-devices variable (for error messages), ``<unset>`` when it is
        unset or empty or not a variable underlay declares."""
        declared = self._visible_env in _env.ENV_VARS
        return (_env.get_optional(self._visible_env) if declared else None) or "<unset>"

    def _index(self, index: int | None) -> int:
        if index is None:
            return int(self._mod.current_device())
        count = self.device_count()
        if not isinstance(index, int) or not 0 <= index < count:
            raise InvalidInput(
                f"{self._name} device index {index!r} is out of range: {count} visible device(s) "
                f"(see {self._visible_env}={self._visible_value()!r})"
            )
        return index

    def model_name(self, index: int | None = None) -> str:
        """Device model name from the driver."""
        return str(self._mod.get_device_name(self._index(index)))

    def torch_device(self, index: int | None = None) -> torch.device:
        """``torch.device(name, index)``."""
        return torch.device(self._name, self._index(index))

    def device_count(self) -> int:
        """Visible devices."""
        return int(self._mod.device_count())

    def set_device(self, index: int) -> None:
        """Bind this process to ``index``."""
        self._mod.set_device(self._index(index))

    def current_index(self) -> int:
        """Current device index."""
        return int(self._mod.current_device())

    def synchronize(self, index: int | None = None) -> None:
        """Wait for all queued work."""
        self._mod.synchronize(self._index(index))

    # -- memory
    def memory_stats(self, index: int | None = None) -> MemoryStats:
        """Caching-allocator and driver figures."""
        i = self._index(index)
        free, total = self._mod.mem_get_info(i)
        return MemoryStats(
            allocated=int(self._mod.memory_allocated(i)),
            reserved=int(self._mod.memory_reserved(i)),
            peak_allocated=int(self._mod.max_memory_allocated(i)),
            total=int(total),
            free=int(free),
        )

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """Restart the peak counter."""
        self._mod.reset_peak_memory_stats(self._index(index))

    def empty_cache(self) -> None:
        """Release cached blocks."""
        self._mod.empty_cache()

    def record_memory_history(
        self, enabled: bool = True, *, max_entries: int = 100_000, stacks: str = "python"
    ) -> None:
        """``<module>.memory._record_memory_history`` (torch.cuda; torch_npu's npu module mirrors it)."""
        if not isinstance(max_entries, int) or max_entries < 1:
            raise InvalidInput(f"record_memory_history: max_entries={max_entries!r} must be an int >= 1")
        if stacks not in ("python", "all"):
            raise InvalidInput(f"record_memory_history: stacks={stacks!r}; use 'python' or 'all'")
        record = self._memory_fn("_record_memory_history")
        if enabled:
            record(enabled="all", context="all", stacks=stacks, max_entries=max_entries)
        else:
            record(enabled=None)

    def dump_memory_snapshot(self, path: str) -> None:
        """``<module>.memory._dump_snapshot(path)``."""
        self._memory_fn("_dump_snapshot")(path)

    def _memory_fn(self, name: str) -> Any:
        fn = getattr(getattr(self._mod, "memory", None), name, None)
        if fn is None:
            raise UnsupportedOperation(
                f"memory history is unsupported on {self._name!r}: {self._mod.__name__}.memory has no {name}; "
                "upgrade the device extension or use underlay.profiling.log_memory()"
            )
        return fn

    # -- rng
    def manual_seed(self, seed: int) -> None:
        """Seed host and all devices."""
        torch.manual_seed(seed)
        self._mod.manual_seed_all(seed)

    def get_rng_state(self) -> dict[str, torch.Tensor]:
        """``{"cpu": ..., "<name>": ...}`` for the current device."""
        return {"cpu": torch.get_rng_state(), self._name: self._mod.get_rng_state()}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``get_rng_state`` output."""
        missing = {"cpu", self._name} - set(state)
        if missing:
            raise InvalidInput(
                f"set_rng_state: state lacks keys {sorted(missing)}; pass get_rng_state() output"
            )
        torch.set_rng_state(state["cpu"])
        self._mod.set_rng_state(state[self._name])

    # -- capability
    def peak_flops(self, dtype: torch.dtype = torch.bfloat16) -> float | None:
        """From ``UNDERLAY_PEAK_TFLOPS`` or the table in ``underlay.utils.hardware``."""
        return peak_flops_from_env() or lookup_peak_flops(self.model_name(), dtype)

    def capability(self, index: int | None = None) -> tuple[int, int] | None:
        """Compute capability when the module has the notion."""
        fn = getattr(self._mod, "get_device_capability", None)
        if fn is None:
            return None
        try:
            major, minor = fn(self._index(index))
        except (RuntimeError, AttributeError, TypeError):
            return None
        return int(major), int(minor)

    # -- streams and events
    def new_stream(self) -> Stream:
        """A new device stream."""
        return self._mod.Stream()  # type: ignore[no-any-return]

    def stream(self, stream: Stream) -> AbstractContextManager[Any]:
        """Queue work on ``stream`` inside the block."""
        ctx = self._mod.stream(stream)
        return ctx if ctx is not None else contextlib.nullcontext()

    def new_event(self, enable_timing: bool = True) -> Event:
        """A new device event."""
        return AcceleratorEvent(self._mod, enable_timing)
