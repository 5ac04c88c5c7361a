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


def attention_vs_full(
    rank: int, world: int, kernel_name: str, multiples: list[int]
) -> list[dict[str, float]]:
    """``split_packed`` + ``cp_attention`` + ``CPSplit.gather`` over the world as the CP group (no
    megatron) against causal GQA attention over the whole packed sequences in float64: the largest
    output error and, for a random linear loss, the largest q/k/v gradient error after summing the
    ranks' gradients (each rank's backward covers its own tokens, as megatron's DDP sums them); one
    result per ``multiple`` of the local token count (``split_packed``'s sequence-parallel padding)."""
    import torch.distributed as dist

    from underlay.engines.mcore.context_parallel import cp_attention, split_packed
    from underlay.registry import get_attention

    torch.manual_seed(0)  # the same tensors on every rank
    lengths = [1, 3, 8, 5, 2, 13]
    total, hq, hk, d = sum(lengths), 4, 2, 8
    q, k, v = (torch.randn(total, h, d, dtype=torch.float64) for h in (hq, hk, hk))
    weight = torch.randn(total, hq, d, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qs = q[a:b].transpose(0, 1)
            ks = k[a:b].repeat_interleave(hq // hk, 1).transpose(0, 1)
            vs = v[a:b].repeat_interleave(hq // hk, 1).transpose(0, 1)
            s = qs @ ks.transpose(1, 2) * d**-0.5
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
            outs.append((s.softmax(-1) @ vs).transpose(0, 1))
        return torch.cat(outs)

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = reference(*leaves)
    (want * weight).sum().backward()
    ref_grads = [t.grad for t in leaves]

    results = []
    for multiple in multiples:
        ids = torch.arange(1, total + 1)  # 0 marks padding after the split
        local_ids, _, _, split = split_packed(
            ids, torch.zeros_like(ids), torch.zeros_like(ids), cu, group=dist.group.WORLD, multiple=multiple
        )
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        local = [torch.cat([t.new_zeros(1, *t.shape[1:]), t])[local_ids] for t in leaves]
        out_local = cp_attention(
            get_attention(kernel_name), *local, split.cu_padded, dist.group.WORLD, scale=None
        )
        got = split.gather(out_local)
        (got * weight).sum().backward()
        gerr = 0.0
        for t, r in zip(leaves, ref_grads):
            assert t.grad is not None and r is not None
            g = t.grad.clone()
            dist.all_reduce(g)
            gerr = max(gerr, float((g - r).abs().max()))
        results.append(
            {"out": float((got - want).abs().max()), "grad": gerr, "local": float(local_ids.numel())}
        )
    return results
