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


def value_cp_batch(seed: int) -> TokenBatch:
    """``cp_batch`` with per-token returns ``extras["ret"] [8, 12]`` for the value loss."""
    base = cp_batch(seed)
    g = torch.Generator().manual_seed(seed + 1000)
    ret = torch.randn(tuple(base.input_ids.shape), generator=g)
    return TokenBatch(base.input_ids, base.attention_mask, base.loss_mask, {"ret": ret})


@contextlib.contextmanager
def _unpermuted_gather() -> Iterator[None]:
    """Negative control: ``CPSplit.gather`` returns the CP all-gather in rank order (each rank's
    load-balanced chunks one after the other) without mapping it back to the packed token order."""
    from underlay.engines.mcore.context_parallel import CPSplit
    from underlay.parallel.ulysses import gather_seq

    def wrong(self: Any, local: torch.Tensor) -> torch.Tensor:
        return gather_seq(local.contiguous(), self.group)[: self.real_index.numel()]

    saved = CPSplit.gather
    CPSplit.gather = wrong  # type: ignore[method-assign]
    try:
        yield
    finally:
        CPSplit.gather = saved  # type: ignore[method-assign]


def _head_seed(eng: Any) -> int:
    """The dropout seed of this rank's value head (last pipeline stage; -1 elsewhere)."""
    inner = eng.chunks[-1]
    while hasattr(inner, "module"):
        inner = inner.module
    return int(inner.output_layer.seed) if inner.post_process else -1


VALUE_LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("cp1", {}),  # CP1 x DP4: the reference step
    ("cp2", {"cp": 2}),  # CP2 x DP2
    ("cp2tp2sp", {"cp": 2, "tp": 2, "sequence_parallel": True}),
    ("cp2pp2", {"cp": 2, "pp": 2}),
]


def value_cp_cases(rank: int, world: int) -> dict[str, float]:
    """A value model (qwen3, no head dropout) on 4 ranks at each of ``VALUE_LAYOUTS`` in turn, each
    from seed 0 on its dp share of ``value_cp_batch``: ``infer`` values, the token-mean value loss
    and the global loss-token count of ``forward_backward``, every gradient (score head included) and
    the grad norm of ``optimizer_step`` against the float64 HF token-classification model; the
    parameters after the clipped AdamW step against the CP1 engine's (how far CP1's step moved them
    too). At CP2 x DP2 also the values when ``CPSplit.gather`` skips the un-permutation (negative
    control). Per CP layout, whether the value heads' dropout seeds differ on every rank that holds
    different tokens (dp x cp, and tp under sequence parallelism: all 4 ranks here)."""
    import copy

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    full = value_cp_batch(5)
    cfg = H.tiny_config("qwen3", classifier_dropout=0.0)
    ref_v, ref_loss, ref_grads = H.hf_value_reference(cfg, full)
    hf_norm = sum(float(g.pow(2).sum()) for g in ref_grads.values()) ** 0.5
    want_tokens = int(full.loss_mask.sum())
    out: dict[str, float] = {}
    base: dict[str, torch.Tensor] = {}
    for tag, sizes in VALUE_LAYOUTS:
        eng = H.make_engine(
            H.engine_config(copy.deepcopy(cfg), kind="value", distributed_optimizer=False, **sizes)
        )
        dp = eng.layout.dp_shard
        rows = list(range(eng_dp_rank(eng), full.batch_size, dp))
        mine = full.select(rows)
        values = eng.infer(mine).values.double()
        out[f"{tag}_values"] = float((values - ref_v[rows]).abs().max())
        if tag == "cp2":
            with _unpermuted_gather():
                wrong = eng.infer(mine).values.double()
            out["unpermuted_values"] = float((wrong - ref_v[rows]).abs().max())
        if eng.layout.cp > 1:
            seeds = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
            dist.all_gather(seeds, torch.tensor(_head_seed(eng)))
            last = [int(s) for s in seeds if int(s) >= 0]
            out[f"{tag}_seeds_distinct"] = float(len(set(last)) == len(last) == world // eng.layout.pp)
        before = {n: t.clone() for n, t in eng.named_full_tensors()} if tag == "cp1" else {}
        res = eng.forward_backward(mine, H.value_loss)
        grads = grad_by_hf_name(eng)
        step = eng.optimizer_step()
        after = {n: t.clone() for n, t in eng.named_full_tensors()}
        out[f"{tag}_loss"] = abs(res.metrics["loss"] - float(ref_loss))
        out[f"{tag}_tokens"] = float(res.loss_tokens - want_tokens)
        out[f"{tag}_names"] = float(set(grads) == set(ref_grads) and "score.weight" in grads)
        out[f"{tag}_grad_rel"] = max(
            float((grads[n].double() - r).abs().max() / (r.abs().max() + 1e-6)) for n, r in ref_grads.items()
        )
        out[f"{tag}_norm"] = abs(step.grad_norm - hf_norm) / hf_norm
        out[f"{tag}_skipped"] = float(step.skipped)
        if tag == "cp1":
            base = after
            out["cp1_moved"] = max(float((after[n] - before[n]).abs().max()) for n in after)
            out["cp1_head_moved"] = float((after["score.weight"] - before["score.weight"]).abs().max())
        else:
            out[f"{tag}_step"] = max(float((after[n] - base[n]).abs().max()) for n in after)
        del eng
        ps.destroy_model_parallel()
    return out


def cp_suite(
    rank: int, world: int, cases: list[tuple[str, int, int, int, dict[str, Any], str | None]]
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """``cp_cases`` then ``value_cp_cases`` in one spawn (one megatron import and gloo setup)."""
    return cp_cases(rank, world, cases), value_cp_cases(rank, world)
