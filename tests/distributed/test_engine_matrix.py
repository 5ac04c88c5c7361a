"""The architecture matrix through the fsdp2 engine (public API, world size 1, one spawned process):
every row of ``coverage.EXACT["fsdp2"]`` but ``coverage.ENGINE_MATRIX_PENDING`` passes each check of
``_engine_matrix.CHECKS`` or is refused by name as reviewed in ``coverage.ENGINE_GAPS`` / ``coverage.value_refused``.

CI runs a deterministic rotating sample: the rows are sorted and dealt into ``SHARDS`` shards; the
shard of the day is ``date.today().toordinal() % SHARDS`` (``UNDERLAY_TEST_MATRIX_SHARD=<k>`` picks shard
``k``), so every row runs within ``SHARDS`` days. The whole matrix runs under the ``full_matrix`` marker,
which only an explicit ``-m full_matrix`` selects (docs/model-matrix.md)."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from tests._dist import run_distributed
from tests.distributed._engine_matrix import CHECKS, check_rows
from underlay.models import coverage

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ROWS = sorted(coverage.EXACT["fsdp2"] - coverage.ENGINE_MATRIX_PENDING)
SHARDS = 24
"""4 rows per CI run (97 rows; about 8 s of checks on an idle 2-core machine)."""


def shard_of_the_day() -> list[str]:
    """The rows CI checks today (see the module docstring)."""
    k = int(os.environ.get("UNDERLAY_TEST_MATRIX_SHARD", datetime.date.today().toordinal())) % SHARDS
    return ROWS[k::SHARDS]


def expected(model_type: str) -> dict[str, str]:
    """Per check: ``""`` (must pass) or the message fragment of its reviewed refusal."""
    gaps = dict(coverage.ENGINE_GAPS.get(model_type, {}))
    if "load" in gaps:
        return {c: gaps["load"] if c == "load" else "not run: load failed" for c in CHECKS}
    if coverage.value_refused(model_type):
        gaps.setdefault("value", "has no token-classification (value head) class")
    return {c: gaps.get(c, "") for c in CHECKS}


def _compare(res: dict[str, dict[str, str]]) -> dict[str, Any]:
    bad: dict[str, Any] = {}
    for mt, got in res.items():
        for check, want in expected(mt).items():
            outcome = got[check]
            ok = (
                outcome == ""
                if not want
                else (want in outcome and outcome.split(":")[0].endswith(("Error", "run")))
            )
            if not ok:
                bad[f"{mt}/{check}"] = {"want": want or "pass", "got": outcome[:300]}
    return bad


def test_gaps_are_exact_rows_and_documented() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "model-matrix.md").read_text()
    for mt, gaps in coverage.ENGINE_GAPS.items():
        assert mt in coverage.EXACT["fsdp2"], mt
        assert set(gaps) <= set(CHECKS), (mt, gaps)
        assert f"| {mt} | {', '.join(sorted(gaps))} |" in doc, (
            f"docs/model-matrix.md lacks the gap row of {mt}"
        )


def test_engine_matrix_sample(tmp_path: Path) -> None:
    """Today's shard of the rows (names in the assertion message on failure)."""
    rows = shard_of_the_day()
    (res,) = run_distributed(check_rows, 1, rows, str(tmp_path), timeout_s=240)
    bad = _compare(res)
    assert not bad, f"shard rows {rows}: {bad}"


@pytest.mark.full_matrix
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_engine_matrix_full(tmp_path: Path) -> None:
    """Every fsdp2 exact row (~2 minutes on an idle 2-core machine, 10+ on a busy one)."""
    (res,) = run_distributed(check_rows, 1, ROWS, str(tmp_path), timeout_s=600, deadline_s=2300)
    bad = _compare(res)
    assert not bad, bad
