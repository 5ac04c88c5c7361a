"""Timers, timing reduction (single process), memory logging and snapshots through the Device interface."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from underlay import profiling, registry
from underlay.backends.cpu.device import CpuDevice
from underlay.interfaces import InvalidInput, MemoryStats, UnsupportedOperation


class CountingDevice:
    """A real cpu device that counts ``synchronize`` calls (every other call goes to the device)."""

    def __init__(self) -> None:
        self._dev = CpuDevice()
        self.syncs = 0

    def synchronize(self, index: int | None = None) -> None:
        self.syncs += 1
        self._dev.synchronize(index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dev, name)


def test_timer_synchronises_and_accumulates() -> None:
    dev = CountingDevice()
    metrics: dict[str, float] = {"other": 1.5}
    t0 = time.perf_counter()
    with profiling.timer("step", metrics, device=dev):
        time.sleep(0.01)
    with profiling.timer("step", metrics, device=dev):
        torch.randn(64, 64, dtype=torch.float64).matmul(torch.randn(64, 64, dtype=torch.float64))
    outer = time.perf_counter() - t0
    assert dev.syncs == 4
    assert 0.01 <= metrics["step"] <= outer
    assert metrics["other"] == 1.5


def test_timer_counts_time_when_body_raises_and_validates() -> None:
    metrics: dict[str, float] = {}

    def failing() -> None:
        with profiling.timer("t", metrics):
            time.sleep(0.002)
            raise RuntimeError("x")

    with pytest.raises(RuntimeError, match="x"):
        failing()
    assert metrics["t"] >= 0.002
    with pytest.raises(InvalidInput, match="non-empty"), profiling.timer("", metrics):
        pass
    with pytest.raises(InvalidInput, match="mutable mapping"), profiling.timer("t", ()):  # type: ignore[arg-type]
        pass


def test_reduce_timings_single_process() -> None:
    vals = torch.rand(3, dtype=torch.float64).add(0.1).tolist()
    metrics = {"gen": vals[0], "train": torch.tensor(vals[1]), "sync": vals[2]}
    out = profiling.reduce_timings(metrics)
    assert set(out) == {f"{k}/{s}" for k in metrics for s in ("max", "mean", "min")}
    for k, v in zip(("gen", "train", "sync"), vals):
        assert out[f"{k}/max"] == out[f"{k}/mean"] == out[f"{k}/min"] == pytest.approx(v, abs=1e-6)
    with pytest.raises(InvalidInput, match="finite"):
        profiling.reduce_timings({"a": float("nan")})
    with pytest.raises(InvalidInput, match="finite"):
        profiling.reduce_timings({"a": "1.0"})


def test_log_memory_returns_stats_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="underlay.profiling"):
        stats = profiling.log_memory("after_load")
    assert isinstance(stats, MemoryStats)
    assert stats.allocated > 0 and stats.total > 0 and stats.peak_allocated >= stats.allocated // 2
    (rec,) = [r for r in caplog.records if "after_load" in r.getMessage()]
    assert "[rank 0, cpu]" in rec.getMessage() and "allocated=" in rec.getMessage()
    with pytest.raises(InvalidInput):
        profiling.log_memory("")


def test_log_memory_usage_decorator_sync_and_async(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.memory")

    @profiling.log_memory_usage("grow", logger=logger)
    def grow(n: int) -> torch.Tensor:
        return torch.randn(n, dtype=torch.float64)

    @profiling.log_memory_usage(logger=logger)
    async def agrow(n: int) -> torch.Tensor:
        await asyncio.sleep(0)
        return torch.randn(n, dtype=torch.float64)

    with caplog.at_level(logging.INFO, logger="test.memory"):
        assert grow(1000).numel() == 1000
        assert asyncio.run(agrow(10)).numel() == 10
    msgs = [r.getMessage() for r in caplog.records if r.name == "test.memory"]
    assert len(msgs) == 2
    assert msgs[0].startswith("grow [rank 0, cpu]") and "during the call" in msgs[0]
    assert "agrow" in msgs[1]


def test_memory_snapshot_unsupported_off_cuda(tmp_path: Path) -> None:
    dev = registry.get_device("cpu")
    with pytest.raises(UnsupportedOperation, match="memory snapshots are unsupported on 'cpu'"):
        profiling.memory_snapshot(tmp_path / "snap.pickle", device=dev)
    with pytest.raises(UnsupportedOperation, match="unsupported on 'cpu'"):
        profiling.record_memory_history(device=dev)
    assert list(tmp_path.iterdir()) == []


def test_aggressive_empty_cache_returns_bytes() -> None:
    freed = profiling.aggressive_empty_cache(force_sync=False)
    assert isinstance(freed, int) and freed >= 0


@pytest.mark.gpu
def test_memory_snapshot_on_cuda(tmp_path: Path) -> None:
    import pickle

    dev = registry.get_device("cuda")
    profiling.record_memory_history(max_entries=1000, device=dev)
    x = torch.randn(1024, 1024, device="cuda")
    path = profiling.memory_snapshot(tmp_path / "sub" / "snap.pickle", device=dev)
    profiling.record_memory_history(False, device=dev)
    del x
    with path.open("rb") as fh:
        snap = pickle.load(fh)
    assert snap["segments"] and any(t for t in snap["device_traces"])
    assert profiling.aggressive_empty_cache(dev) >= 0
