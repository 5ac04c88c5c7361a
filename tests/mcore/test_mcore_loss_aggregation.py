"""Loss contract v3 on mcore (CPU fixture, gloo, fp32): for every ``ops.aggregate_loss`` mode, TP=2 with
one micro-batch and DP=2 with three uneven micro-batches per rank (plain DDP all-reduce) give the float64
formula of verl's ``agg_loss`` over the whole global batch, for the loss and every gradient after
``forward_backward``; metrics reduce as declared (max, min, mean over calls, sum), identical on every
rank. One 2-rank process group runs both layouts and every mode."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from tests._dist import run_distributed
from tests._loss_reference import MODES, ModeLoss, global_batch, per_token, reference_agg, reference_metrics
from tests.mcore import _helpers as H

pytestmark = [pytest.mark.mcore, pytest.mark.distributed]

TOL = 2e-5  # fp32 engine against float64, relative to the largest magnitude
LAYOUTS = {"tp2": (2, 10_000, 1), "dp2": (1, 24, 3)}  # tp, micro_batch_max_tokens, micro-batches per rank


def _worker(rank: int, world: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from tests.mcore._workers import eng_dp_rank, grad_by_hf_name

    out: dict[str, Any] = {}
    for name, (tp, max_tokens, _) in LAYOUTS.items():
        cfg = H.engine_config(H.tiny_config("llama"), tp=tp, distributed_optimizer=False)
        eng = H.make_engine(dataclasses.replace(cfg, micro_batch_max_tokens=max_tokens))
        dp = eng.layout.dp
        full = global_batch()
        mine = full.select(list(range(eng_dp_rank(eng), full.batch_size, dp)))
        for mode in MODES:
            res = eng.forward_backward(mine, ModeLoss(mode))
            grads = grad_by_hf_name(eng)
            eng.zero_grad()
            out[name, mode] = {
                "metrics": dict(res.metrics),
                "micro_batches": res.num_micro_batches,
                "counts": (res.loss_tokens, res.sequences),
                "grads": grads if rank == 0 else None,
            }
        del eng
        ps.destroy_model_parallel()
    return out


def _reference() -> dict[str, Any]:
    """Per mode: the float64 loss and gradients by HF name (per-expert names), seed-0 HF model."""
    from underlay.engines.fsdp2._build import build_model
    from underlay.engines.mcore._hf import per_expert_names
    from underlay.interfaces import ModelConfig

    cfg = H.tiny_config("llama")
    batch = global_batch()
    model = build_model(ModelConfig(hf_config=cfg, seed=0), cfg, meta=False).double()
    out: dict[str, Any] = {}
    for mode in MODES:
        model.zero_grad()
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], 1) * batch.attention_mask
        loss = reference_agg(per_token(lp, batch), batch.loss_mask, mode)
        loss.backward()
        grads = per_expert_names({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        out[mode] = {"loss": float(loss.detach()), "grads": grads, "lp": lp.detach()}
    return out


def test_every_mode_equals_the_float64_formula_at_tp2_and_dp2() -> None:
    ranks = run_distributed(_worker, 2)
    ref = _reference()
    batch = global_batch()
    tokens = int(batch.loss_mask.sum())
    seqs = int((batch.loss_mask.sum(1) > 0).sum())
    for name, (tp, _, micro_batches) in LAYOUTS.items():
        dp = 2 // tp
        for mode in MODES:
            got = [r[name, mode] for r in ranks]
            want = ref[mode]
            assert [g["micro_batches"] for g in got] == [micro_batches] * 2, (name, mode)
            assert all(g["counts"] == (tokens, seqs) for g in got)
            assert got[0]["metrics"] == got[1]["metrics"], "metrics differ between ranks"
            m = got[0]["metrics"]
            assert abs(m["loss"] - want["loss"]) <= TOL * max(1.0, abs(want["loss"])), (name, mode)
            g0, wg = got[0]["grads"], want["grads"]
            assert set(g0) == set(wg), sorted(set(g0) ^ set(wg))
            scale = max(float(t.abs().max()) for t in wg.values())
            err = max(float((g0[k].double() - wg[k]).abs().max()) for k in wg) / scale
            assert err <= TOL, (name, mode, err)
            expect = reference_metrics(want["lp"], batch.loss_mask, dp * micro_batches)
            for key, value in expect.items():
                assert abs(m[key] - value) <= TOL * max(1.0, abs(value)), (name, mode, key, m[key], value)
