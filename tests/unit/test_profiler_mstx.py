"""Call sequence of the mstx profiler against a stand-in ``torch_npu`` module.

This is NOT evidence that mstx works on an Ascend NPU (no NPU here): it checks that underlay calls
torch_npu's documented API (mstx range_start/range_end/mark, torch_npu.profiler.profile start/stop per
run of configured steps) in the right order with the right arguments, and validates options.
"""

from __future__ import annotations

import enum
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from underlay.backends.cpu.device import CpuDevice
from underlay.interfaces import ConfigError, IncompatibleBackends, ProfilerConfig


class NpuNamedCpu(CpuDevice):
    """The cpu device under the name ``npu`` (so that the profiler's device check passes)."""

    @property
    def name(self) -> str:
        return "npu"


def _stand_in(log: list[tuple[Any, ...]]) -> types.ModuleType:
    mod = types.ModuleType("torch_npu")
    ids = iter(range(1, 1000))

    def range_start(msg: str, stream: Any = None, **kw: Any) -> int:
        log.append(("start", msg, stream, kw))
        return next(ids)

    def experimental(**kw: Any) -> dict[str, Any]:
        log.append(("experimental", kw))
        return kw

    mstx = types.SimpleNamespace(
        mark=lambda msg, **kw: log.append(("mark", msg, kw)),
        range_start=range_start,
        range_end=lambda rid, **kw: log.append(("end", rid, kw)),
    )
    mod.npu = types.SimpleNamespace(mstx=mstx)  # type: ignore[attr-defined]

    class Profile:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs
            log.append(("profile", sorted(kwargs)))

        def start(self) -> None:
            log.append(("prof.start",))

        def stop(self) -> None:
            log.append(("prof.stop",))
            self.kwargs["on_trace_ready"](self)

    def handler(dir_name: str, worker_name: str | None = None, **kw: Any) -> Any:
        return lambda prof: log.append(("trace", Path(dir_name).name, worker_name, kw))

    mod.profiler = types.SimpleNamespace(  # type: ignore[attr-defined]
        ProfilerLevel=enum.Enum("ProfilerLevel", "Level0 Level1 Level2"),
        AiCMetrics=enum.Enum("AiCMetrics", "PipeUtilization Memory"),
        ProfilerActivity=enum.Enum("ProfilerActivity", "CPU NPU"),
        _ExperimentalConfig=experimental,
        tensorboard_trace_handler=handler,
        profile=Profile,
    )
    return mod


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    events: list[tuple[Any, ...]] = []
    monkeypatch.setitem(sys.modules, "torch_npu", _stand_in(events))
    monkeypatch.delenv("RANK", raising=False)
    return events


def test_mstx_call_sequence(log: list[tuple[Any, ...]], tmp_path: Path) -> None:
    from underlay.backends.npu.mstx import MstxProfiler

    cfg = ProfilerConfig(steps=(1, 2), output_dir=str(tmp_path), options={"level": "Level1"})
    prof = MstxProfiler(cfg, NpuNamedCpu())
    assert prof.name == "mstx" and prof.enabled
    prof.start()
    for i in range(4):
        with prof.range(f"w{i}"):
            pass
        prof.step()
    prof.stop()
    kinds = [e[0] for e in log]
    assert kinds == [
        "experimental", "profile", "prof.start", "mark", "start", "end",
        "mark", "start", "end", "prof.stop", "trace",
    ]  # fmt: skip
    assert ("experimental", {"msprof_tx": True, "profiler_level": log[0][1]["profiler_level"]}) == log[0]
    assert log[0][1]["profiler_level"].name == "Level1"
    assert [e[1] for e in log if e[0] == "start"] == ["w1", "w2"]
    assert [e[1] for e in log if e[0] == "end"] == [1, 2]
    assert [e[1] for e in log if e[0] == "mark"] == ["step 1", "step 2"]
    assert log[-1] == ("trace", "rank0_step1", "rank0", {})
    assert prof.traces == [tmp_path / "rank0_step1"]


def test_mstx_options_and_device(log: list[tuple[Any, ...]]) -> None:
    from underlay.backends.npu.mstx import MstxProfiler

    with pytest.raises(IncompatibleBackends, match="needs the npu device, got device 'cpu'"):
        MstxProfiler(ProfilerConfig(), CpuDevice())
    with pytest.raises(ConfigError, match="torch_npu.profiler.AiCMetrics"):
        MstxProfiler(ProfilerConfig(options={"aic_metrics": "Nope"}), NpuNamedCpu())
    prof = MstxProfiler(
        ProfilerConfig(steps=(0,), options={"profiler": False, "domain": "rl", "step_marks": False}),
        NpuNamedCpu(),
    )
    prof.start()
    with prof.range("only"):
        pass
    prof.stop()
    assert log == [("start", "only", None, {"domain": "rl"}), ("end", 1, {"domain": "rl"})]
