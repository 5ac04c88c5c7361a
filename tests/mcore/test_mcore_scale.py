"""Megatron-Core at scale on the CPU fixture: validated config pass-through, uneven pipeline stages,
partial recompute, gradient-reduce and parameter-gather overlap. One 2-rank process group runs every
layout (``_scale_workers.all_phases``)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from tests._dist import run_distributed
from tests.mcore import _scale_workers as S
from tests.mcore.test_mcore_engine import GRAD_TOL, LOSS_TOL, LP_TOL

pytestmark = [pytest.mark.mcore, pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def phases() -> list[dict[str, Any]]:
    return run_distributed(S.all_phases, 2, timeout_s=300)


@pytest.fixture(scope="module")
def pipeline(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p["pipeline"] for p in phases]


@pytest.fixture(scope="module")
def overlap(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p["overlap"] for p in phases]


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


def test_overlap_equal_to_no_overlap(overlap: list[dict[str, Any]]) -> None:
    """Overlapped gradient reduce-scatter (and all-reduce) and parameter all-gather give bit-equal
    parameters after each of three steps, bit-equal log-probs and grad norms (the same sums over two
    ranks, only started earlier); the weights read right after a step see the deferred gather; a
    second forward_backward before the step is refused by the option's name."""
    for res in overlap:
        for name, r in res.items():
            assert r["moved"] > 1e-4, r  # the steps changed the weights
            assert r["param_diff"] == 0.0 and r["lp_diff"] == 0.0 and r["norm_diff"] == 0.0, (name, r)
            assert "overlap_grad_reduce=True" in r["refused"], (name, r)
