"""Megatron-Core at scale on the CPU fixture: validated config pass-through, uneven pipeline stages,
partial recompute. One 2-rank process group runs every layout (``_scale_workers``)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from tests._dist import run_distributed
from tests.mcore import _scale_workers as S
from tests.mcore.test_mcore_engine import GRAD_TOL, LOSS_TOL, LP_TOL

pytestmark = [pytest.mark.mcore, pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def pipeline() -> list[dict[str, Any]]:
    return run_distributed(S.pipeline_phase, 2, timeout_s=300)


def _exact(r: dict[str, Any]) -> None:
    assert r["lp"] < LP_TOL and r["loss"] < LOSS_TOL and r["grad_rel"] < GRAD_TOL, r


def test_uneven_stages_block_recompute_and_passthrough(pipeline: list[dict[str, Any]]) -> None:
    """First stage 1 layer, last stage 3 (megatron's uneven split) with block recompute of the first
    layer of each chunk: log-probs, loss and gradients equal float64 HF; the pass-through fields of
    TransformerConfig, OptimizerConfig and the DDP config reach megatron; the recomputed layer (only
    the first of each chunk) runs its forward twice in training."""
    for rank, res in enumerate(pipeline):
        r = res["uneven_block"]
        _exact(r)
        assert r["read_back"] == {
            "first": 1,
            "last": 3,
            "method": "block",
            "unit": 1,
            "granularity": "full",
            "zeros": True,
            "nan_check": True,
        }, r
        assert r["layers"] == ([1] if rank == 0 else [2, 3, 4]), r
        assert r["calls"] == ([2] if rank == 0 else [2, 1, 1]), r


def test_uniform_recompute_units(pipeline: list[dict[str, Any]]) -> None:
    """Even stages (2 layers each) with uniform recompute in units of 2 layers: exact against HF and
    every layer recomputed (two forwards per training micro-batch)."""
    for res in pipeline:
        r = res["uniform2"]
        _exact(r)
        assert r["read_back"]["method"] == "uniform" and r["read_back"]["unit"] == 2, r
        assert r["calls"] == [2, 2], r
