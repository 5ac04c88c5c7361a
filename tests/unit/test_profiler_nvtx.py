"""Call sequence of the nvtx profiler with torch.cuda's NVTX/profiler functions replaced by recorders.

Not evidence that NVTX works on a GPU (see ``tests/gpu/test_profiling_cuda.py`` and the gpu test in
test_profiler.py): it checks that ranges, marks and cudaProfilerStart/Stop follow the configured steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from underlay.backends.cpu.device import CpuDevice
from underlay.interfaces import ConfigError, IncompatibleBackends, ProfilerConfig


class CudaNamedCpu(CpuDevice):
    """The cpu device under the name ``cuda``; counts ``synchronize`` calls into the shared log."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self._log = log

    @property
    def name(self) -> str:
        return "cuda"

    def synchronize(self, index: int | None = None) -> None:
        self._log.append(("sync",))


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    events: list[tuple[Any, ...]] = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: events.append(("push", msg)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: events.append(("pop",)))
    monkeypatch.setattr(torch.cuda.nvtx, "mark", lambda msg: events.append(("mark", msg)))
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: events.append(("capture.start",)))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: events.append(("capture.stop",)))
    monkeypatch.delenv("RANK", raising=False)
    return events


def test_nvtx_call_sequence(log: list[tuple[Any, ...]]) -> None:
    from underlay.backends.cuda.nvtx import NvtxProfiler

    prof = NvtxProfiler(ProfilerConfig(steps=(1, 2, 4)), CudaNamedCpu(log))

    @prof.annotate("fn")
    def fn() -> None:
        pass

    prof.start()
    for i in range(5):
        with prof.range(f"w{i}"):
            fn()
        prof.step()
    prof.stop()
    run = [("push", "fn"), ("pop",), ("pop",)]
    assert log == [
        ("capture.start",), ("mark", "step 1"), ("push", "w1"), *run,
        ("mark", "step 2"), ("push", "w2"), *run, ("sync",), ("capture.stop",),
        ("capture.start",), ("mark", "step 4"), ("push", "w4"), *run, ("sync",), ("capture.stop",),
    ]  # fmt: skip


def test_nvtx_options_and_device(log: list[tuple[Any, ...]]) -> None:
    from underlay.backends.cuda.nvtx import NvtxProfiler

    with pytest.raises(IncompatibleBackends, match="needs the cuda device, got device 'cpu'"):
        NvtxProfiler(ProfilerConfig(), CpuDevice())
    with pytest.raises(ConfigError, match="capture_rang"):
        NvtxProfiler(ProfilerConfig(options={"capture_rang": False}), CudaNamedCpu(log))
    cfg = ProfilerConfig(steps=(0,), options={"capture_range": False, "step_marks": False})
    prof = NvtxProfiler(cfg, CudaNamedCpu(log))
    prof.start()
    with prof.range("only"):
        pass
    prof.step()
    prof.stop()
    assert log == [("push", "only"), ("pop",)]
