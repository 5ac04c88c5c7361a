"""``underlay.profiling.trace_gaps`` (the idle-gap attribution behind the fsdp2 profiles) on synthetic
chrome traces in torch.profiler's format, where the right answer is known."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from underlay.profiling import trace_gaps


@pytest.fixture(scope="module")
def tg() -> ModuleType:
    return trace_gaps


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, corr: int | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


def test_a_gap_is_charged_to_the_launch_that_ended_it_and_to_the_sync_that_began_it(tg: Any) -> None:
    events = [
        _x("user_annotation", "step", 0, 1000),
        _x("cpu_op", "aten::mm", 10, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 15, 5, corr=1),
        _x("kernel", "gemm", 20, 100, tid=7, corr=1),
        _x("cpu_op", "aten::item", 40, 100),
        _x("cuda_runtime", "cudaStreamSynchronize", 45, 80),  # returns at 125, the gemm ended at 120
        _x("cpu_op", "aten::add", 300, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 305, 5, corr=2),
        _x("kernel", "add", 310, 10, tid=7, corr=2),
        _x("kernel", "other_stream", 315, 50, tid=8, corr=3),  # overlaps: no gap
    ]
    report = tg.analyse({"traceEvents": events})
    lines = report.splitlines()
    assert lines[0].startswith("span 0.3 ms, device busy 0.2 ms") and "idle 0.2 ms in 1 gaps" in lines[0]
    assert "0.19 ms      1  step > aten::add" in report  # 310 - 120 us, ended by the add's launch
    assert "0.19 ms      1  step > aten::item > cudaStreamSynchronize" in report


def test_nested_host_spans_are_found_however_long_ago_the_outer_one_began(tg: Any) -> None:
    events = [_x("user_annotation", "outer", 0, 10_000)]
    for i in range(3000):  # many closed spans between the outer start and the launch
        events.append(_x("cpu_op", f"op{i}", 1 + i * 2, 1))
    events += [
        _x("kernel", "k0", 0, 5, tid=7, corr=9),
        _x("cpu_op", "aten::copy_", 9000, 50),
        _x("cuda_runtime", "cudaLaunchKernel", 9010, 5, corr=10),
        _x("kernel", "k1", 9100, 5, tid=7, corr=10),
    ]
    report = tg.analyse({"traceEvents": events})
    assert "outer > aten::copy_" in report


def test_a_trace_without_device_events_says_so(tg: Any) -> None:
    report = tg.analyse({"traceEvents": [_x("cpu_op", "aten::mm", 0, 5)]})
    assert "no device events" in report


def test_command_line_prints_the_report_of_a_trace_file(
    tg: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = [_x("kernel", "k1", 0, 10, corr=1), _x("kernel", "k2", 110, 10, corr=2)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert tg.main([str(trace), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == tg.analyse({"traceEvents": events}, top=3).strip()
    assert "idle 0.1 ms in 1 gaps" in out
