"""Context parallelism (CP) for the mcore engine's packed THD micro-batches on the local layer spec.

Layout (megatron's load-balanced CP split, the one its THD RoPE and Transformer Engine's attention
expect). Every packed sequence ``i`` of real length ``n_i`` is padded to ``P_i``, a multiple of
``2 * cp``, and cut into ``2 * cp`` chunks of ``c_i = P_i / (2 * cp)`` tokens; CP rank ``r`` keeps
chunks ``r`` and ``2 * cp - 1 - r`` (an early and a late chunk, so causal work is balanced). A rank's
local tokens are, sequence after sequence, its two chunks of that sequence. ``PackedSeqParams`` carry
the GLOBAL cumulative lengths: ``cu_seqlens_q/kv`` of the real lengths and ``cu_seqlens_q/kv_padded``
of the padded ones, ``max_seqlen_q/kv`` the largest padded length. Megatron's unfused THD RoPE
(``_apply_rotary_pos_emb_thd``, megatron-core 0.16.1 and 0.19.2 alike) derives each local token's
rotary position from exactly these: local lengths ``(cu_padded[i+1] - cu_padded[i]) // cp`` and the
position slices ``[r * c, (r + 1) * c)`` and ``[P - (r + 1) * c, P - r * c)`` of a table of
``max_seqlen`` positions (the table is indexed per sequence from 0, or by packed offset when its
length equals ``cu_padded[-1]``, which for a single sequence is the same thing).

Padding tokens sit after the real tokens of their sequence, so no real query ever attends to one
(causality); their labels are ``IGNORE_INDEX`` and their outputs are dropped. With sequence
parallelism the local token count must divide by ``tp``: one extra all-padding sequence is appended
when needed.

Attention (``cp_attention``): K/V of the local tokens are all-gathered over the CP group (backward:
the K/V gradients of every rank are summed and each rank keeps its own tokens' share), the full
padded K/V of each sequence is rebuilt, and each local query chunk attends causally to the key
prefix that ends with it, through the ``AttentionKernel``'s varlen call with ``cu_seqlens_q !=
cu_seqlens_k`` (bottom-right causal alignment: query ``a`` of chunk ``j`` sees keys ``<= j * c + a``).

Outputs (``CPSplit.gather``): per-token results of the local tokens are all-gathered over CP and put
back in the real packed order, so every rank of the CP group holds the whole micro-batch (the
contract's layout); the backward keeps this rank's slice, as every CP rank computes the same loss
from the same gathered values. The loss-token count is reported by CP rank 0 only, so megatron's
all-reduce of the count over dp x cp yields the global count ``N`` while its gradient all-reduce sums
the CP ranks' partial gradients.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from underlay.interfaces import IGNORE_INDEX, InvalidInput

__all__ = ["CPSplit", "cp_attention", "gather_kv", "split_packed"]


def _group_size_rank(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _chunk_index(
    offsets: list[int], lengths: list[int], cp: int, rank: int, device: torch.device
) -> torch.Tensor:
    """Indices into the padded packed layout of the tokens CP ``rank`` holds (its chunks ``rank`` and
    ``2 * cp - 1 - rank`` of every sequence, sequence after sequence); ``int64 [sum(lengths) / cp]``."""
    parts: list[torch.Tensor] = []
    for off, length in zip(offsets, lengths):
        c = length // (2 * cp)
        parts.append(torch.arange(off + rank * c, off + (rank + 1) * c, device=device))
        parts.append(torch.arange(off + (2 * cp - 1 - rank) * c, off + (2 * cp - rank) * c, device=device))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)


def _gathered_position(offsets: list[int], lengths: list[int], cp: int, device: torch.device) -> torch.Tensor:
    """``inv [P_total]``: where padded-layout token ``p`` sits in the rank-order concatenation of every
    CP rank's local tokens (what an all-gather over the CP group returns)."""
    order = torch.cat([_chunk_index(offsets, lengths, cp, r, device) for r in range(cp)])
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=device)
    return inv


@dataclass
class CPSplit:
    """How one packed micro-batch is split over the CP group (all lengths global, host ints).

    ``cu_real``/``cu_padded``: int32 ``[n + 1]`` cumulative real and padded sequence lengths (an
    appended all-padding sequence, if any, counts as real tokens in both); ``real_index``: int64
    ``[T]`` position of each real packed token (original order) in the CP all-gather of local tokens;
    ``max_seqlen``: the largest padded length."""

    cp: int
    rank: int
    group: Any
    cu_real: torch.Tensor
    cu_padded: torch.Tensor
    real_index: torch.Tensor
    max_seqlen: int

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's per-token values ``[T_local, ...]`` (local token order) -> ``[T, ...]`` of the
        whole micro-batch in the real packed order, on every CP rank. Backward: this rank's slice of the
        incoming gradient (every CP rank computes the same function of the gathered values)."""
        from underlay.parallel.ulysses import gather_seq

        full = gather_seq(local.contiguous(), self.group)
        return full.index_select(0, self.real_index)


def local_token_count(lengths: list[int], cp: int) -> int:
    """Tokens per CP rank of a packed micro-batch of sequences ``lengths`` before any padding
    sequence: each sequence padded to a multiple of ``2 * cp``, the sum split over ``cp`` ranks
    (always even)."""
    unit = 2 * cp
    return sum(-(-n // unit) * unit for n in lengths) // cp


def split_packed(
    ids: torch.Tensor,
    pos: torch.Tensor,
    labels: torch.Tensor,
    cu: torch.Tensor,
    *,
    group: Any,
    multiple: int = 1,
    cp_rank: tuple[int, int] | None = None,
    local_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, CPSplit]:
    """Split a packed micro-batch for CP rank ``rank`` of ``group`` (size ``cp >= 1``).

    ``ids``, ``pos``, ``labels``: ``[T]`` token ids, positions within their sequence, next-token labels
    (``IGNORE_INDEX`` where none); ``cu``: int ``[n + 1]`` cumulative real lengths (0 ... T).
    ``multiple``: the local token count is made a multiple of it (``tp`` under sequence parallelism)
    by appending one all-padding sequence. ``local_length``: the local token count instead (virtual
    pipelines run every micro-batch of a step at one shape): an even number at least
    ``local_token_count(cu, cp)``, reached the same way. ``cp_rank = (cp, rank)`` overrides the group's size and
    rank (the split is pure; only ``CPSplit.gather`` communicates). Returns this rank's ``(ids, pos,
    labels)`` ``[T_local]`` (padding: id 0, label ``IGNORE_INDEX``, positions continuing the sequence)
    and the ``CPSplit``. ``InvalidInput`` for a malformed ``cu``."""
    cp, rank = _group_size_rank(group) if cp_rank is None else cp_rank
    if multiple < 1:
        raise InvalidInput(f"split_packed: multiple={multiple} must be >= 1")
    device = ids.device
    total = int(ids.numel())
    bounds = [int(x) for x in cu.tolist()]
    if (
        len(bounds) < 2
        or bounds[0] != 0
        or bounds[-1] != total
        or any(b <= a for a, b in itertools.pairwise(bounds))
    ):
        raise InvalidInput(
            f"split_packed: cu_seqlens {bounds} must rise strictly from 0 to the token count {total}"
        )
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    unit = 2 * cp
    padded = [-(-n // unit) * unit for n in lengths]
    local = local_token_count(lengths, cp)
    if local_length is not None:
        extra = local_length - local
        if extra < 0 or extra % 2:
            raise InvalidInput(
                f"split_packed: local_length={local_length} must be even and >= this micro-batch's "
                f"{local} local tokens"
            )
    else:
        extra = (-local) % multiple
        if extra % 2:  # local shares of a sequence come in pairs of equal chunks: keep it even
            extra += multiple
    real_lengths = list(lengths)
    if extra:
        padded.append(extra * cp)
        real_lengths.append(extra * cp)
    offsets = [0]
    for p in padded:
        offsets.append(offsets[-1] + p)
    p_total = offsets[-1]
    # destination of every real token in the padded layout
    starts = torch.tensor(offsets[: len(lengths)], dtype=torch.int64, device=device)
    seq_of = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )
    within = torch.arange(total, device=device) - torch.tensor(bounds[:-1], device=device)[seq_of]
    dest = starts[seq_of] + within
    full_ids = torch.zeros(p_total, dtype=ids.dtype, device=device)
    full_ids[dest] = ids
    full_labels = torch.full((p_total,), IGNORE_INDEX, dtype=labels.dtype, device=device)
    full_labels[dest] = labels
    full_pos = torch.cat(
        [torch.arange(p, dtype=pos.dtype, device=device) for p in padded]
    )  # padding continues its sequence's positions
    full_pos[dest] = pos
    mine = _chunk_index(offsets[:-1], padded, cp, rank, device)
    inv = _gathered_position(offsets[:-1], padded, cp, device)
    cu_real = [0]
    for n in real_lengths:
        cu_real.append(cu_real[-1] + n)
    split = CPSplit(
        cp=cp,
        rank=rank,
        group=group,
        cu_real=torch.tensor(cu_real, dtype=torch.int32, device=device),
        cu_padded=torch.tensor(offsets, dtype=torch.int32, device=device),
        real_index=inv[dest],
        max_seqlen=max(padded),
    )
    return full_ids[mine], full_pos[mine], full_labels[mine], split


class _GatherKV(torch.autograd.Function):
    """All-gather along dim 0 over a group (rank order); backward sums every rank's gradient of the
    gathered tensor and returns this rank's rows (a reduce-scatter; all-reduce + slice on gloo, which
    has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.size, ctx.rank, ctx.n = group, size, rank, int(x.shape[0])
        out = x.new_empty((size * int(x.shape[0]), *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous()
        if str(dist.get_backend(ctx.group)).lower() == "gloo":
            dist.all_reduce(grad, group=ctx.group)
            return grad.narrow(0, ctx.rank * ctx.n, ctx.n).contiguous(), None, None, None
        out = grad.new_empty((ctx.n, *grad.shape[1:]))
        # torch >= 2.13 names it reduce_scatter_single (reduce_scatter_tensor is deprecated there)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, grad, group=ctx.group)
        return out, None, None, None


def gather_kv(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every CP rank's ``x [T_local, ...]`` concatenated in rank order -> ``[cp * T_local, ...]``; the
    gradient of the result is summed over the group and each rank gets its own rows back. Identity for
    a one-rank group."""
    size, rank = _group_size_rank(group)
    if size == 1:
        return x
    out: torch.Tensor = _GatherKV.apply(x, group, size, rank)  # type: ignore[no-untyped-call]
    return out


@dataclass
class _AttentionPlan:
    cu_q: torch.Tensor  # int32 [2n + 1]: the local query chunks, two per sequence
    cu_k: torch.Tensor  # int32 [2n + 1]: the key prefix each chunk attends to
    key_index: torch.Tensor  # int64 [sum of prefixes]: rows of the K/V all-gather forming the prefixes
    max_q: int
    max_k: int


def _attention_plan(cu_padded: torch.Tensor, cp: int, rank: int, device: torch.device) -> _AttentionPlan:
    bounds = [int(x) for x in cu_padded.tolist()]
    offsets, lengths = bounds[:-1], [b - a for a, b in itertools.pairwise(bounds)]
    if any(n % (2 * cp) for n in lengths):
        raise InvalidInput(
            f"cp attention: padded sequence lengths {lengths} must be multiples of 2*cp = {2 * cp} "
            "(split the micro-batch with split_packed)"
        )
    inv = _gathered_position(offsets, lengths, cp, device)
    q_lens: list[int] = []
    k_lens: list[int] = []
    keys: list[torch.Tensor] = []
    for off, n in zip(offsets, lengths):
        c = n // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            q_lens.append(c)
            k_lens.append((chunk + 1) * c)
            keys.append(inv[off : off + (chunk + 1) * c])

    def cumsum(xs: list[int]) -> torch.Tensor:
        out = [0]
        for x in xs:
            out.append(out[-1] + x)
        return torch.tensor(out, dtype=torch.int32, device=device)

    return _AttentionPlan(cumsum(q_lens), cumsum(k_lens), torch.cat(keys), max(q_lens), max(k_lens))


def cp_attention(
    kernel: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_padded: torch.Tensor,
    group: Any,
    *,
    scale: float | None,
    cache: Any = None,
) -> torch.Tensor:
    """Causal attention of this CP rank's local tokens against the whole sequences.

    ``query [T_local, Hq, D]``, ``key [T_local, Hk, D]``, ``value [T_local, Hk, Dv]`` in the local
    token order of ``split_packed``; ``cu_padded`` int ``[n + 1]`` the global padded cumulative lengths
    (each a multiple of ``2 * cp``). Returns ``[T_local, Hq, Dv]`` through ``kernel.varlen`` (GQA left
    to the kernel). Collective over ``group`` (forward all-gather of K/V; backward sums K/V gradients).
    ``cache``: any object that lives as long as ``cu_padded`` (the micro-batch's ``PackedSeqParams``);
    the index plan, which reads ``cu_padded`` on the host, is kept on it so the layers of one
    micro-batch build it once. ``InvalidInput`` when the lengths do not fit the layout."""
    cp, rank = _group_size_rank(group)
    total = int(cu_padded[-1])
    if total != cp * int(query.shape[0]):
        raise InvalidInput(
            f"cp attention: {int(query.shape[0])} local tokens x cp={cp} != padded total {total}; the "
            "micro-batch must be split with split_packed over the same CP group"
        )
    plan = getattr(cache, "underlay_cp_plan", None) if cache is not None else None
    if plan is None:
        plan = _attention_plan(cu_padded, cp, rank, query.device)
        if cache is not None:
            cache.underlay_cp_plan = plan
    d = int(key.shape[-1])
    kv = gather_kv(torch.cat([key, value], dim=-1), group)
    kv = kv.index_select(0, plan.key_index)
    k, v = kv[..., :d].contiguous(), kv[..., d:].contiguous()
    out: torch.Tensor = kernel.varlen(
        query, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, causal=True, scale=scale
    )
    return out
