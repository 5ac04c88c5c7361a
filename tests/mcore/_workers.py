"""Per-rank bodies of the mcore tests (module level so ``run_distributed`` can pickle them)."""

from __future__ import annotations

from typing import Any

import torch

from tests.mcore import _helpers as H


def grad_by_hf_name(eng: Any) -> dict[str, torch.Tensor]:
    """Full gradients by HF name: megatron's ``main_grad`` gathered like the weights."""
    saved = {}
    for c in eng.chunks:
        for p in c.parameters():
            saved[p] = p.data.clone()
            p.data.copy_(p.main_grad.to(p.dtype))
    out = {n: t.clone() for n, t in eng.named_full_tensors()}
    for p, v in saved.items():
        p.data.copy_(v)
    return out


def check_forward_grads(rank: int, world: int, family: str, tp: int, pp: int, ep: int, opts: dict[str, Any]) -> dict[str, float]:
    """Log-probs (infer), loss and gradients of one forward_backward against the float64 HF model."""
    cfg = H.tiny_config(family)
    eng = H.make_engine(H.engine_config(cfg, tp=tp, pp=pp, ep=ep, **opts))
    dp = eng.layout.dp_shard
    full = H.make_batch(1, b=4 * dp // max(dp, 1) * dp)
    mine = full.select(list(range(eng_dp_rank(eng), full.batch_size, dp)))
    out = eng.infer(mine, with_entropy=True)
    ref_lp, ref_loss, ref_grads = H.hf_reference(cfg, full)
    ref_mine = ref_lp[list(range(eng_dp_rank(eng), full.batch_size, dp))]
    res = eng.forward_backward(mine, H.pg_loss)
    grads = grad_by_hf_name(eng)
    gerr = 0.0
    for name, g in grads.items():
        r = ref_grads[name]
        gerr = max(gerr, float((g.double() - r).abs().max() / (r.abs().max() + 1e-6)))
    return {
        "lp": float((out.log_probs.double() - ref_mine).abs().max()),
        "loss": abs(res.metrics["loss"] - float(ref_loss)),
        "grad_rel": gerr,
        "n": len(grads),
    }


def eng_dp_rank(eng: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(eng.layout.groups["dp"])
