"""Rank/step filter and annotate of the shared profiler base, through a backend that logs its hooks."""

from __future__ import annotations

import asyncio
from contextlib import AbstractContextManager
from typing import Any

import pytest

from underlay.backends._profiling import NULL_RANGE, HookRange, ProfilerBase, check_options
from underlay.backends.cpu.device import CpuDevice
from underlay.interfaces import ConfigError, InvalidInput, ProfilerConfig
from underlay.parallel.rank import current_rank


class LoggingProfiler(ProfilerBase):
    """A real ProfilerBase backend whose 'trace' is a list of (event, step[, name]) tuples."""

    _NAME = "log"

    def __init__(self, config: ProfilerConfig) -> None:
        super().__init__(config, CpuDevice())
        self.events: list[tuple[Any, ...]] = []

    def _on_start(self) -> None:
        self.events.append(("start", self._step))

    def _on_stop(self) -> None:
        self.events.append(("stop", self._step))

    def _enter_block(self) -> None:
        self.events.append(("enter", self._step))

    def _leave_block(self) -> None:
        self.events.append(("leave", self._step))

    def _on_record_step(self) -> None:
        self.events.append(("rec", self._step))

    def _open(self, name: str) -> AbstractContextManager[None]:
        return HookRange(lambda n: self.events.append(("open", self._step, n)), lambda _: None, name)


def _run(prof: LoggingProfiler, n_steps: int, *, start_at: int = 0) -> list[str]:
    for _ in range(start_at):
        prof.step()
    prof.start()
    for i in range(start_at, n_steps):
        with prof.range(f"r{i}"):
            pass
        prof.step()
    prof.stop()
    return [e[2] for e in prof.events if e[0] == "open"]


def test_only_configured_steps_open_ranges_and_blocks_follow_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    prof = LoggingProfiler(ProfilerConfig(steps=(1, 2, 4)))
    assert _run(prof, 6) == ["r1", "r2", "r4"]
    blocks = [e for e in prof.events if e[0] in ("enter", "leave")]
    assert blocks == [("enter", 1), ("leave", 3), ("enter", 4), ("leave", 5)]
    assert [e[1] for e in prof.events if e[0] == "rec"] == [1, 2, 4]
    assert prof.events[0] == ("start", 0) and prof.events[-1] == ("stop", 6)


def test_steps_count_from_construction_and_empty_steps_record_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    prof = LoggingProfiler(ProfilerConfig(steps=(3,)))
    assert _run(prof, 5, start_at=2) == ["r3"]
    prof = LoggingProfiler(ProfilerConfig(steps=()))
    assert _run(prof, 3, start_at=1) == ["r1", "r2"]
    assert [e for e in prof.events if e[0] in ("enter", "leave")] == [("enter", 1), ("leave", 3)]


def test_stop_mid_block_leaves_it_and_start_stop_are_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    prof = LoggingProfiler(ProfilerConfig(steps=(0, 1, 2)))
    prof.start()
    prof.start()
    prof.step()
    prof.stop()
    prof.stop()
    assert prof.events == [("start", 0), ("enter", 0), ("rec", 0), ("rec", 1), ("leave", 1), ("stop", 1)]
    assert prof.range("after") is NULL_RANGE


def test_rank_filter_and_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    assert current_rank() == 3
    off_rank = LoggingProfiler(ProfilerConfig(ranks=(0, 1)))
    assert not off_rank.enabled and off_rank.rank == 3
    assert _run(off_rank, 3) == [] and off_rank.events == []

    def f(x: int) -> int:
        return x + 1

    assert off_rank.annotate("f")(f) is f
    assert LoggingProfiler(ProfilerConfig(ranks=(3,))).enabled
    assert LoggingProfiler(ProfilerConfig(ranks=())).enabled
    assert not LoggingProfiler(ProfilerConfig(ranks=(), enabled=False)).enabled
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match="RANK='x'"):
        current_rank()


def test_annotate_sync_and_async(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    prof = LoggingProfiler(ProfilerConfig(steps=(0,)))

    @prof.annotate()
    def add(a: float, b: float) -> float:
        """Adds."""
        return a + b

    @prof.annotate("fetch")
    async def fetch(x: float) -> float:
        await asyncio.sleep(0)
        return x * 2

    prof.start()
    assert add(1.5, 2.0) == 3.5
    assert asyncio.run(fetch(1.25)) == 2.5
    assert asyncio.iscoroutinefunction(fetch)
    prof.step()
    add(0.0, 0.0)  # step 1 does not record
    prof.stop()
    assert [e[2] for e in prof.events if e[0] == "open"] == [
        "test_annotate_sync_and_async.<locals>.add",
        "fetch",
    ]
    assert add.__doc__ == "Adds." and add.__name__ == "add"
    with pytest.raises(InvalidInput):
        prof.annotate("")


def test_check_options() -> None:
    allowed = {"a": True, "b": "x"}
    assert check_options("t", {"a": False}, allowed) == {"a": False, "b": "x"}
    with pytest.raises(ConfigError, match=r"\['zz'\].*valid options: \['a', 'b'\]"):
        check_options("t", {"zz": 1}, allowed)
    with pytest.raises(ConfigError, match="expected bool"):
        check_options("t", {"a": "yes"}, allowed)


def test_invalid_config_type() -> None:
    with pytest.raises(InvalidInput, match="ProfilerConfig.load"):
        LoggingProfiler({"steps": [1]})  # type: ignore[arg-type]
