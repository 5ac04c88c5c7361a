"""Loss contract v3 on fsdp2: for every ``ops.aggregate_loss`` mode, one rank with one micro-batch and
two gloo ranks with three uneven micro-batches each give the float64 formula of verl's ``agg_loss`` over
the whole global batch, for the loss and for every gradient after ``forward_backward``; metrics reduce
as declared (max, min, mean over calls, sum). One process group per world size runs every mode."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests._loss_reference import MODES, ModeLoss, global_batch, per_token, reference_agg, reference_metrics
from tests.distributed import _fsdp_helpers as H

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

TOL = 2e-5  # fp32 engine against float64, relative to the largest magnitude
LAYOUTS = ((1, 10_000, 1), (2, 24, 3))  # (ranks, micro_batch_max_tokens, micro-batches per rank)


def _worker(rank: int, world: int, max_tokens: int) -> dict[str, Any]:
    from underlay.engines.fsdp2._build import hf_name
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.registry import get_device

    engine = FSDP2Engine(H.engine_config(H.llama_config(), max_tokens=max_tokens), get_device("cpu"))
    local = H.shard(global_batch(), rank, world)
    out: dict[str, Any] = {}
    for mode in MODES:
        res = engine.forward_backward(local, ModeLoss(mode))
        grads = {hf_name(n): H.full(p.grad) for n, p in engine.model.named_parameters()}
        engine.zero_grad()
        out[mode] = {
            "metrics": dict(res.metrics),
            "micro_batches": res.num_micro_batches,
            "counts": (res.loss_tokens, res.sequences),
            "grads": grads if rank == 0 else None,
        }
    return out


def _reference() -> dict[str, Any]:
    """Per mode: the float64 loss and gradients by HF name, from the seed-identical HF model."""
    batch = global_batch()
    model = H.reference_model(H.llama_config(), 0)
    params = H.hf_names(model)
    out: dict[str, Any] = {}
    for mode in MODES:
        model.zero_grad()
        lp = H.reference_outputs(model, batch).log_probs
        assert lp is not None
        loss = reference_agg(per_token(lp, batch), batch.loss_mask, mode)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        out[mode] = {"loss": float(loss.detach()), "grads": grads, "lp": lp.detach()}
    return out


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    scale = max(float(t.abs().max()) for t in b.values())
    return max(float((a[k].double() - b[k]).abs().max()) for k in b) / scale


def test_every_mode_equals_the_float64_formula_at_1_and_2_ranks() -> None:
    ref = _reference()
    batch = global_batch()
    tokens = int(batch.loss_mask.sum())
    seqs = int((batch.loss_mask.sum(1) > 0).sum())
    for world, max_tokens, micro_batches in LAYOUTS:
        ranks = run_distributed(_worker, world, max_tokens)
        for mode in MODES:
            got = [r[mode] for r in ranks]
            want = ref[mode]
            assert [g["micro_batches"] for g in got] == [micro_batches] * world, (world, mode)
            assert all(g["counts"] == (tokens, seqs) for g in got)
            assert all(g["metrics"] == got[0]["metrics"] for g in got), "metrics differ between ranks"
            m = got[0]["metrics"]
            assert abs(m["loss"] - want["loss"]) <= TOL * max(1.0, abs(want["loss"])), (world, mode)
            assert _rel(got[0]["grads"], want["grads"]) <= TOL, (world, mode)
            expect = reference_metrics(want["lp"], batch.loss_mask, world * micro_batches)
            for key, value in expect.items():
                assert abs(m[key] - value) <= TOL * max(1.0, abs(value)), (world, mode, key, m[key], value)
