"""underlay.tracking: console, jsonl and TensorBoard output, validation, rank filtering, optional backends."""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from underlay.interfaces import BackendUnavailable, ConfigError, InvalidInput
from underlay.tracking import Tracking, read_jsonl


def _random_metrics(gen: torch.Generator) -> dict[str, float]:
    v = torch.rand(3, generator=gen, dtype=torch.float64) * 10 - 5
    return {"loss": float(v[0]), "reward/mean": float(v[1]), "grad_norm": float(v[2])}


def test_jsonl_console_tensorboard_roundtrip(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1234)
    steps = [_random_metrics(gen) for _ in range(3)]
    out = io.StringIO()
    with Tracking(("console", "jsonl", "tensorboard"), tmp_path, "r1", stream=out) as tr:
        for i, m in enumerate(steps):
            tr.log({**m, "tokens": torch.tensor(17 + i)}, step=i)
    rows = read_jsonl(tmp_path / "r1" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r, m in zip(rows, steps):
        for k, v in m.items():
            assert r[k] == v  # json round-trips doubles exactly
    assert [r["tokens"] for r in rows] == [17, 18, 19]
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 3 and lines[1].startswith("step 1 | loss ")
    assert f"{steps[2]['loss']:.4g}" in lines[2]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "r1" / "tensorboard"))
    acc.Reload()
    scal = acc.Scalars("reward/mean")
    assert [s.step for s in scal] == [0, 1, 2]
    for s, m in zip(scal, steps):
        assert math.isclose(s.value, m["reward/mean"], rel_tol=1e-6, abs_tol=1e-6)  # TB stores fp32


def test_non_finite_written_as_null_and_console_keys(tmp_path: Path) -> None:
    out = io.StringIO()
    with Tracking(("console", "jsonl"), tmp_path, "r", stream=out, console_keys=("b", "missing")) as tr:
        tr.log({"a": float("nan"), "b": float("inf"), "c": 2.5}, step=4)
    (row,) = read_jsonl(tr.jsonl_path)
    assert row["a"] is None and row["b"] is None and row["c"] == 2.5
    assert out.getvalue().strip() == "step 4 | b inf"


def test_validation_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown backend"):
        Tracking(("console", "csv"), tmp_path)
    with pytest.raises(ConfigError, match="twice"):
        Tracking(("jsonl", "jsonl"), tmp_path)
    with pytest.raises(ConfigError, match="sequence of names"):
        Tracking("jsonl", tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="run_name"):
        Tracking(("jsonl",), tmp_path, "a/b")
    tr = Tracking(("jsonl",), tmp_path, "v")
    with pytest.raises(InvalidInput, match="step="):
        tr.log({"x": 1.0}, step=-1)
    with pytest.raises(InvalidInput, match="shape"):
        tr.log({"x": torch.randn(3)}, step=0)
    with pytest.raises(InvalidInput, match="type str"):
        tr.log({"x": "high"}, step=0)
    tr.close()
    tr.close()  # idempotent
    with pytest.raises(InvalidInput, match="after close"):
        tr.log({"x": 1.0}, step=1)
    assert read_jsonl(tr.jsonl_path) == []  # nothing written by the rejected calls


def test_non_writer_rank_writes_nothing(tmp_path: Path) -> None:
    out = io.StringIO()
    with Tracking(("console", "jsonl"), tmp_path, "r", rank=1, stream=out) as tr:
        assert not tr.is_writer and tr.backends == ()
        tr.log({"x": 0.3}, step=0)
        with pytest.raises(InvalidInput):
            tr.log({"x": [1]}, step=0)
    assert out.getvalue() == "" and not (tmp_path / "r").exists()


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, float], int]] = []
        self.closed = 0

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.seen.append((dict(metrics), step))

    def close(self) -> None:
        self.closed += 1


def test_custom_backend_object(tmp_path: Path) -> None:
    rec = _Recorder()
    val = float(torch.rand(1, dtype=torch.float64))
    with Tracking((rec,), tmp_path, "c") as tr:
        assert tr.log({"v": val, "flag": True}, step=7) == {"v": val, "flag": 1.0}
    assert rec.seen == [({"v": val, "flag": 1.0}, 7)] and rec.closed == 1


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_optional_backend_missing_is_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # import now raises ImportError
    with pytest.raises(BackendUnavailable, match=rf"{name}.*not installed.*pip install"):
        Tracking(("jsonl", name), tmp_path, "o")
    # the jsonl backend opened first was closed again; the file exists but is empty
    assert read_jsonl(tmp_path / "o" / "metrics.jsonl") == []


def test_read_jsonl_skips_truncated_last_line(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0, "x": 1.5}\n{"step": 1, "x"', encoding="utf-8")
    assert read_jsonl(p) == [{"step": 0, "x": 1.5}]
    p.write_text('{"step": 0\n{"step": 1}\n', encoding="utf-8")
    with pytest.raises(InvalidInput, match="line 1"):
        read_jsonl(p)
