"""The ``Profiler`` contract, run against every registered profiler whose probe passes on this host.

Lifecycle (``start``/``step``/``stop`` idempotent, a second session after the first), ranges and
``annotate`` transparent to values, exceptions and coroutines, near-zero cost where nothing records
(``annotate`` returns the function itself, ``range`` well under a microsecond), the rank filter (``RANK``
and ``ProfilerConfig.ranks``/``enabled``) and the step filter with the output files each backend promises.
Profilers whose probe fails here are skips with the probe's reason. On a GPU host:
``UNDERLAY_DEVICE=cuda pytest tests/conformance`` covers ``nvtx``.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from underlay import registry
from underlay.interfaces import Profiler, ProfilerConfig

WRITES_TRACES = {"torch": "rank{rank}_step{step}"}
"""Backends that promise trace files in ``ProfilerConfig.output_dir`` and the stem of each file (one per
run of consecutive recorded steps, ``step`` = its first step). The others (``off``; ``nvtx`` and ``mstx``,
whose traces belong to the vendor tool) must write nothing there. A new backend that writes files adds
itself here."""

NEVER_RECORDS = {"off"}
"""Backends that record on no rank whatever the config says."""

OFF_RANGE_NS = 1000
"""Cost bound of ``range`` where nothing records (the protocol says under 1 microsecond)."""


def _params() -> list[Any]:
    device = registry.resolve("device").name
    out: list[Any] = []
    for spec in registry.backends("profiler"):
        probe = registry.probe("profiler", spec.name)
        if probe.available and spec.works_with(device):
            out.append(pytest.param(spec.name, id=spec.name))
        else:
            why = probe.reason or f"needs device {list(spec.devices)}, this host runs {device!r}"
            out.append(pytest.param(spec.name, id=spec.name, marks=pytest.mark.skip(reason=why)))
    registry.reset()
    return out


NAMES = _params()


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UNDERLAY_PROFILER", raising=False)
    monkeypatch.setenv("RANK", "0")


def _profiler(name: str, tmp_path: Path, **cfg: Any) -> Profiler:
    base: dict[str, Any] = {"output_dir": str(tmp_path / "out"), "ranks": (0,), "warmup": 0}
    base.update(cfg)
    return registry.get_profiler(ProfilerConfig(**base), name=name)


def _work(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ x.T / x.shape[0])


def _event_names(path: Path) -> set[str]:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return {str(e["name"]) for e in json.loads(raw)["traceEvents"] if "name" in e}


@pytest.mark.parametrize("name", NAMES)
def test_satisfies_protocol(name: str, tmp_path: Path) -> None:
    prof = _profiler(name, tmp_path)
    assert isinstance(prof, Profiler)
    assert prof.name == name
    assert prof.enabled == (name not in NEVER_RECORDS)


@pytest.mark.parametrize("name", NAMES)
def test_lifecycle_is_idempotent_and_restartable(name: str, tmp_path: Path) -> None:
    """``stop`` before ``start`` and repeated ``start``/``stop`` are no-ops; a second session works."""
    prof = _profiler(name, tmp_path, steps=(0, 1, 2, 3))
    x = torch.randn(16, 16, dtype=torch.float64)
    prof.stop()
    for _session in range(2):
        prof.start()
        prof.start()
        for i in range(2):
            with prof.range(f"outer{i}"), prof.range("inner"):
                x = _work(x)
            prof.step()
        prof.stop()
        prof.stop()
    assert torch.isfinite(x).all()


@pytest.mark.parametrize("name", NAMES)
def test_range_and_annotate_are_transparent(name: str, tmp_path: Path) -> None:
    """Values and exceptions pass through ranges and annotated functions (sync and async), names and
    docstrings are kept, and a range left by an exception does not break the next one."""
    prof = _profiler(name, tmp_path, steps=())

    @prof.annotate()
    def double(x: int) -> int:
        """Doubles."""
        return 2 * x

    @prof.annotate("named_fail")
    def fail() -> None:
        raise KeyError("boom")

    @prof.annotate("async_square")
    async def square(x: int) -> int:
        await asyncio.sleep(0)
        return x * x

    prof.start()
    assert double(21) == 42 and double.__name__ == "double" and double.__doc__ == "Doubles."
    with pytest.raises(KeyError, match="boom"):
        fail()
    with pytest.raises(ValueError, match="inside"), prof.range("raising"):
        raise ValueError("inside")
    with prof.range("after"):
        pass
    assert asyncio.iscoroutinefunction(square)
    assert asyncio.run(square(7)) == 49
    prof.step()
    prof.stop()


def _range_cost_ns(prof: Profiler, n: int = 20_000, batches: int = 5) -> float:
    """Least CPU time per ``with prof.range(...)`` over ``batches`` batches (thread CPU time, so a loaded
    machine does not count other processes' time)."""
    best = float("inf")
    for _ in range(batches):
        t0 = time.thread_time_ns()
        for _ in range(n):
            with prof.range("idle"):
                pass
        best = min(best, (time.thread_time_ns() - t0) / n)
    return best


@pytest.mark.parametrize("name", NAMES)
def test_near_zero_cost_where_nothing_records(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Disabled, on a filtered-out rank, or started but outside the configured steps: ``annotate``
    returns the function itself where the rank never records, and ``range`` costs under a microsecond."""

    def f(x: int) -> int:
        return x

    disabled = _profiler(name, tmp_path, enabled=False)
    assert not disabled.enabled and disabled.annotate()(f) is f and disabled.annotate("n")(f) is f
    assert _range_cost_ns(disabled) < OFF_RANGE_NS
    monkeypatch.setenv("RANK", "3")
    other_rank = _profiler(name, tmp_path, ranks=(0, 1))
    assert not other_rank.enabled and other_rank.annotate()(f) is f
    assert _range_cost_ns(other_rank) < OFF_RANGE_NS
    monkeypatch.setenv("RANK", "0")
    idle_step = _profiler(name, tmp_path, steps=(10,))
    idle_step.start()
    try:
        assert _range_cost_ns(idle_step) < OFF_RANGE_NS  # step 0 is not configured
    finally:
        idle_step.stop()


@pytest.mark.parametrize("name", NAMES)
def test_rank_filter(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank records when ``enabled`` and ``ranks`` is empty or holds it (``RANK`` before a process group
    exists); a filtered-out rank writes nothing."""
    records = name not in NEVER_RECORDS
    for rank, ranks, expect in ((0, (0,), True), (2, (0, 2), True), (1, (0,), False), (5, (), True)):
        monkeypatch.setenv("RANK", str(rank))
        prof = _profiler(name, tmp_path / f"r{rank}", ranks=ranks)
        assert prof.enabled == (expect and records), (rank, ranks)
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "filtered"
    prof = registry.get_profiler(ProfilerConfig(ranks=(0,), output_dir=str(out)), name=name)
    prof.start()
    with prof.range("nothing"):
        _work(torch.randn(8, 8))
    prof.step()
    prof.stop()
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("name", NAMES)
def test_step_filter_and_output_files(name: str, tmp_path: Path) -> None:
    """Only configured steps record. Backends that promise files write one per run of recorded steps,
    named after this rank and the run's first step, holding exactly those steps' ranges; the others write
    nothing into ``output_dir``."""
    out = tmp_path / "out"
    prof = _profiler(name, tmp_path, steps=(1, 2, 5))
    x = torch.randn(32, 32, dtype=torch.float64)
    prof.start()
    for i in range(7):
        with prof.range(f"conf_step{i}"):
            x = _work(x)
        prof.step()
    prof.stop()
    stem = WRITES_TRACES.get(name)
    if stem is None:
        assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
        return
    files = sorted(out.iterdir())
    stems = [stem.format(rank=0, step=s) for s in (1, 5)]
    assert [p.name.split(".")[0] for p in files] == stems, [p.name for p in files]
    recorded: list[set[str]] = [{n for n in _event_names(p) if n.startswith("conf_step")} for p in files]
    assert recorded == [{"conf_step1", "conf_step2"}, {"conf_step5"}]
