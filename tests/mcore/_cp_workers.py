"""Per-rank bodies of the context-parallel mcore tests (module level so ``run_distributed`` can pickle
them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from tests.mcore import _helpers as H
from tests.mcore._workers import eng_dp_rank, grad_by_hf_name
from underlay.interfaces import TokenBatch

# real lengths of the 8 sequences: 1 and 2 are shorter than 2*cp = 4, several are odd
LENGTHS = [5, 2, 12, 1, 9, 7, 11, 4]


def cp_batch(seed: int) -> TokenBatch:
    """Right-padded ``[8, 12]`` batch with the lengths ``LENGTHS``, loss mask past 2 prompt tokens."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(0, H.VOCAB, (b, s), generator=g)
    mask = (torch.arange(s)[None] < torch.tensor(LENGTHS)[:, None]).long()
    loss = mask.clone()
    loss[:, :2] = 0
    return TokenBatch(ids * mask, mask, loss, {"adv": torch.randn(b, generator=g)})


@contextlib.contextmanager
def _negative(kind: str | None) -> Iterator[None]:
    """Break the CP implementation on purpose (negative controls):

    - ``contiguous``: rank r keeps the contiguous chunks 2r and 2r+1 instead of megatron's
      load-balanced chunks r and 2*cp-1-r (megatron's RoPE then rotates with the wrong positions);
    - ``kv_grad_not_summed``: the K/V all-gather's backward keeps this rank's slice of its own
      gradient without summing the other ranks' (the forward is still right)."""
    import underlay.engines.mcore.context_parallel as cpm

    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if kind == "contiguous":

        def contiguous(
            offsets: list[int], lengths: list[int], cp: int, rank: int, device: torch.device
        ) -> torch.Tensor:
            parts = [
                torch.arange(off + 2 * rank * (n // (2 * cp)), off + (2 * rank + 2) * (n // (2 * cp)))
                for off, n in zip(offsets, lengths)
            ]
            return torch.cat(parts).to(device)

        patch(cpm, "_chunk_index", contiguous)
    elif kind == "kv_grad_not_summed":

        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
            return grad.narrow(0, ctx.rank * ctx.n, ctx.n).contiguous(), None, None, None

        patch(cpm._GatherKV, "backward", staticmethod(backward))
    elif kind is not None:
        raise ValueError(kind)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def cp_cases(
    rank: int, world: int, cases: list[tuple[str, int, int, int, dict[str, Any], str | None]]
) -> list[dict[str, float]]:
    """For each ``(family, tp, pp, cp, options, negative)`` in turn (megatron's parallel state is torn
    down between cases): an engine from seed 0 at that layout (ranks left over are data parallel)
    runs ``infer`` and one ``forward_backward`` on its dp share of ``cp_batch``; returns the largest
    log-prob error, the loss error and the largest relative gradient error against the float64
    HF model (plain DDP all-reduce, so every rank holds whole gradients), the global grad norm
    ``optimizer_step`` reports and the HF model's, with the CP size reported by the layout."""
    from megatron.core import parallel_state as ps

    results = []
    full = cp_batch(3)
    for family, tp, pp, cp, opts, negative in cases:
        cfg = H.tiny_config(family)
        ref_lp, ref_loss, ref_grads = H.hf_reference(cfg, full)
        with _negative(negative):
            eng = H.make_engine(
                H.engine_config(cfg, tp=tp, pp=pp, cp=cp, distributed_optimizer=False, **opts)
            )
            dp = eng.layout.dp_shard
            rows = list(range(eng_dp_rank(eng), full.batch_size, dp))
            mine = full.select(rows)
            out = eng.infer(mine, with_entropy=True)
            res = eng.forward_backward(mine, H.pg_loss)
            grads = grad_by_hf_name(eng)
            norm = eng.optimizer_step().grad_norm
        gerr = 0.0
        for name, g in grads.items():
            r = ref_grads[name]
            gerr = max(gerr, float((g.double() - r).abs().max() / (r.abs().max() + 1e-6)))
        assert out.entropy is not None
        results.append(
            {
                "lp": float((out.log_probs.double() - ref_lp[rows]).abs().max()),
                "entropy_finite": float(bool(torch.isfinite(out.entropy).all())),
                "loss": abs(res.metrics["loss"] - float(ref_loss)),
                "grad_rel": gerr,
                "norm": norm,
                "hf_norm": sum(float(g.pow(2).sum()) for g in ref_grads.values()) ** 0.5,
                "n_tokens": float(res.loss_tokens),
                "cp": float(eng.layout.cp),
                "dp": float(dp),
            }
        )
        del eng
        ps.destroy_model_parallel()
    return results
