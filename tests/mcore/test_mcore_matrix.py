"""The architecture matrix through the megatron-core engine (CPU fixture, world size 1, one spawned
process): every row of ``coverage.EXACT["mcore"]`` passes each engine-level check of
``tests/distributed/_engine_matrix.CHECKS`` (load from transformers' ``save_pretrained`` bit-for-bit,
``infer`` == ``forward_backward`` log-probs with the model's dropout/jitter settings on, ``export_hf``
-> ``from_pretrained`` logits, checkpoint save/load/step, value model) or is refused by name as reviewed
in ``MCORE_GAPS``; every other row of the fsdp2 matrix is refused by the mcore engine's build with the
``ConfigError`` that ``coverage`` reports for it. Exactness against transformers at TP=2 and PP=2 is
``test_mcore_models.py``'s.

CI runs a deterministic rotating sample of the exact rows, as the fsdp2 matrix does
(``test_engine_matrix.shard_of_the_day``: ``SHARDS`` shards of the sorted rows, the shard of the day
``date.today().toordinal() % SHARDS``, ``UNDERLAY_TEST_MATRIX_SHARD=<k>`` picks one); all of them run under
``-m full_matrix``."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from tests._dist import run_distributed
from tests.distributed._engine_matrix import CHECKS, check_rows, mcore_refusals
from tests.distributed.test_value_checkpoint_names import renamed_tensor_outcomes
from underlay.interfaces import ConfigError
from underlay.models import coverage

pytestmark = [pytest.mark.mcore, pytest.mark.distributed, pytest.mark.timeout(900)]

ROWS = sorted(coverage.EXACT["mcore"])
SHARDS = 9
"""One of the 9 rows per CI run (each spawn imports megatron; a row costs a few seconds more)."""

MCORE_GAPS: dict[str, dict[str, str]] = {}
"""Reviewed engine-level refusals of mcore exact rows: per model type, check -> message fragment (as
``coverage.ENGINE_GAPS`` for fsdp2). Beyond it, ``value`` is refused for the types transformers has no
token-classification class for (``coverage.value_refused``)."""


def shard_of_the_day() -> list[str]:
    """The exact rows CI checks today (see the module docstring)."""
    k = int(os.environ.get("UNDERLAY_TEST_MATRIX_SHARD", datetime.date.today().toordinal())) % SHARDS
    return ROWS[k::SHARDS]


def _bad(res: dict[str, dict[str, str]]) -> dict[str, object]:
    bad: dict[str, object] = {}
    for mt, got in res.items():
        gaps = dict(MCORE_GAPS.get(mt, {}))
        if coverage.value_refused(mt):
            gaps.setdefault("value", "token-classification")
        for check in CHECKS:
            want, outcome = gaps.get(check, ""), got[check]
            ok = outcome == "" if not want else (want in outcome and outcome.split(":")[0].endswith("Error"))
            if not ok:
                bad[f"{mt}/{check}"] = {"want": want or "pass", "got": outcome[:300]}
    return bad


def _ci_job(rank: int, world: int, root: str, others: list[str]) -> dict[str, Any]:
    """One spawned process for the CI tests of this module (each spawn imports megatron anew)."""
    return {
        "sample": check_rows(rank, world, shard_of_the_day(), f"{root}/rows", "", "mcore"),
        "refusals": mcore_refusals(rank, world, others),
        "renamed": renamed_tensor_outcomes(rank, world, f"{root}/renamed", "mcore"),
    }


OTHERS = sorted(coverage.EXACT["fsdp2"] - coverage.EXACT["mcore"])
"""The fsdp2 exact rows that mcore does not claim."""


@pytest.fixture(scope="module")
def ci(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mcore_matrix")
    (res,) = run_distributed(_ci_job, 1, str(root), OTHERS, timeout_s=300)
    return res  # type: ignore[no-any-return]


def test_mcore_matrix_sample(ci: dict[str, Any]) -> None:
    """Today's shard of the exact rows (names in the assertion message on failure)."""
    bad = _bad(ci["sample"])
    assert not bad, f"shard rows {shard_of_the_day()}: {bad}"


@pytest.mark.full_matrix
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_mcore_matrix_full(tmp_path: Path) -> None:
    (res,) = run_distributed(check_rows, 1, ROWS, str(tmp_path), "", "mcore", timeout_s=600, deadline_s=2300)
    bad = _bad(res)
    assert not bad, bad


def test_mcore_refuses_the_other_rows_by_name(ci: dict[str, Any]) -> None:
    """Every fsdp2 exact row that mcore does not claim: building the mcore engine raises the
    ``ConfigError`` of the capability check that ``coverage.classify`` reports as the row's mcore
    reason (``arch_of``; before any weights), and ``coverage.KNOWN`` lists the row as refused."""
    from underlay.engines.mcore.config import arch_of

    assert {coverage.KNOWN[mt][1] for mt in OTHERS} == {"refused"}
    want: dict[str, str] = {}
    for mt in OTHERS:
        with pytest.raises(ConfigError) as err:
            arch_of(coverage.tiny_config(mt))
        want[mt] = str(err.value)
    res = ci["refusals"]
    assert set(res) == set(OTHERS)
    bad = {mt: (msg[:200], want[mt][:200]) for mt, msg in res.items() if not msg or want[mt] not in msg}
    assert not bad, bad


def test_mcore_value_model_refuses_tensors_it_would_not_read(ci: dict[str, Any]) -> None:
    """``test_value_checkpoint_names``' cases through the mcore engine: a value checkpoint's head,
    backbone, expert or routing-bias tensor saved under another name is refused naming it, never
    seed-initialised."""
    res = ci["renamed"]
    assert {arch: len(r) for arch, r in res.items()} == {"qwen2": 4, "mixtral": 1, "deepseek_v3": 1}
    bad = {f"{arch}/{case}": why for arch, r in res.items() for case, why in r.items() if why}
    assert not bad, bad
