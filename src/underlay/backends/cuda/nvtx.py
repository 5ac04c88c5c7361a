"""The ``nvtx`` profiler: NVTX ranges and a cudaProfilerStart/Stop capture range for Nsight Systems."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from underlay.backends._profiling import HookRange, ProfilerBase, check_options, require_device
from underlay.interfaces import Device, ProfilerConfig

__all__ = ["NvtxProfiler"]

_NVTX_OPTIONS: dict[str, Any] = {"capture_range": True, "synchronize": True, "step_marks": True}


def _pop(_: Any) -> None:
    torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]


class NvtxProfiler(ProfilerBase):
    """NVTX annotations for ``nsys profile --capture-range=cudaProfilerApi``.

    On enabled ranks, while a configured step runs, ``range(name)`` is ``torch.cuda.nvtx.range_push(name)``
    / ``range_pop()``. Each run of consecutive configured steps is wrapped in
    ``torch.cuda.profiler.start()  # type: ignore[no-untyped-call]`` / ``stop()`` (cudaProfilerStart/Stop), so Nsight Systems launched
    with ``--capture-range=cudaProfilerApi`` captures exactly those steps; the device is synchronised
    before ``stop()`` so that the steps' kernels finish inside the capture. Nothing is written by
    underlay itself: the trace file is Nsight's (``config.output_dir`` is unused).

    ``config.options``: ``capture_range`` (bool, default ``True``: call cudaProfilerStart/Stop),
    ``synchronize`` (bool, default ``True``: synchronise before cudaProfilerStop), ``step_marks``
    (bool, default ``True``: an NVTX mark ``"step {n}"`` at the start of each recorded step).
    ``with_memory``/``with_stack``/``record_shapes`` are Nsight command-line options and are ignored
    here. Raises ``IncompatibleBackends`` when ``device`` is not the cuda device.
    """

    _NAME = "nvtx"

    def __init__(self, config: ProfilerConfig, device: Device) -> None:
        require_device("nvtx", device, "cuda", "UNDERLAY_PROFILER=torch (any device) or mstx (npu)")
        super().__init__(config, device)
        self._opts = check_options("nvtx", config.options, _NVTX_OPTIONS)

    def _enter_block(self) -> None:
        if self._opts["capture_range"]:
            torch.cuda.profiler.start()  # type: ignore[no-untyped-call]

    def _on_record_step(self) -> None:
        if self._opts["step_marks"]:
            torch.cuda.nvtx.mark(f"step {self._step}")  # type: ignore[no-untyped-call]

    def _leave_block(self) -> None:
        if self._opts["capture_range"]:
            if self._opts["synchronize"]:
                self._device.synchronize()
            torch.cuda.profiler.stop()  # type: ignore[no-untyped-call]

    def _open(self, name: str) -> AbstractContextManager[None]:
        return HookRange(torch.cuda.nvtx.range_push, _pop, name)
