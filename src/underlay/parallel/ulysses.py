"""Ulysses sequence parallelism: all-to-all between the sequence and head dimensions around attention.

Each of the ``sp`` ranks of a sequence-parallel group holds a contiguous ``1/sp`` slice of the packed
tokens (padded to a multiple of ``sp``). Around attention, :func:`seq_to_head` trades the token slice for
a head slice: every rank then sees *all* tokens for ``heads / sp`` heads, runs an ordinary varlen kernel,
and :func:`head_to_seq` trades back. Outside attention everything is token-wise, so no other
communication is needed; :func:`gather_seq` collects per-token outputs at the end.

Gradient convention: every rank of the group computes the same loss from the gathered outputs, and the
backward of :func:`gather_seq` keeps only this rank's slice of the incoming gradient. The parameter
gradients of one rank are therefore its partial contribution, and their **sum** over the group equals
the gradient of a single process running the whole sequence. (An engine that *averages* gradients over
a data-parallel group containing the sp ranks must multiply by ``sp`` to recover the per-shard mean.)

All collectives use ``torch.distributed.all_to_all_single`` / ``all_gather_single``-style
single-tensor calls (gloo has no list ``all_to_all``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from underlay.interfaces import ConfigError, InvalidInput

__all__ = [
    "gather_seq",
    "head_to_seq",
    "repeat_kv_for_sp",
    "seq_to_head",
    "slice_for_rank",
    "sp_rank",
    "sp_world_size",
    "validate_sp",
    "validate_ulysses_heads",
]


def sp_world_size(group: Any | None) -> int:
    """Size of the sequence-parallel ``group``; 1 when ``group`` is ``None`` or no process group exists."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size(group))


def sp_rank(group: Any | None) -> int:
    """This process's rank inside ``group``; 0 when ``group`` is ``None`` or no process group exists."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return int(dist.get_rank(group))


def validate_ulysses_heads(num_heads: int, num_kv_heads: int, ulysses: int) -> None:
    """The Ulysses head rule: can attention with ``num_heads`` query and ``num_kv_heads`` key/value heads
    be split over ``ulysses`` ranks? The one rule engines (at construction) and the attention route (per
    call) both apply.

    Requires ``num_heads % ulysses == 0`` and either ``num_kv_heads % ulysses == 0`` or
    ``ulysses % num_kv_heads == 0`` (then each kv head is repeated ``ulysses / num_kv_heads`` times, see
    :func:`repeat_kv_for_sp`). Raises ``ConfigError`` naming the sizes and the valid values otherwise.
    """
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1:
        raise ConfigError(f"Ulysses ulysses={ulysses!r}: must be an int >= 1")
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ConfigError(
            f"Ulysses: num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}"
        )
    valid = [
        s
        for s in range(1, num_heads + 1)
        if num_heads % s == 0 and (num_kv_heads % s == 0 or s % num_kv_heads == 0)
    ]
    if num_heads % ulysses:
        raise ConfigError(
            f"Ulysses ulysses={ulysses} does not divide the number of attention heads {num_heads}; "
            f"choose ulysses in {valid}"
        )
    if num_kv_heads % ulysses and ulysses % num_kv_heads:
        raise ConfigError(
            f"Ulysses ulysses={ulysses} and num_kv_heads={num_kv_heads}: kv heads must divide ulysses or "
            f"ulysses must divide kv heads (so kv heads can be repeated); choose ulysses in {valid}"
        )


validate_sp = validate_ulysses_heads
"""The name ``underlay.models`` calls the rule by (same function)."""


def repeat_kv_for_sp(x: torch.Tensor, sp: int) -> torch.Tensor:
    """Repeat each kv head of ``x [T, Hk, D]`` ``sp // Hk`` times (``Hk < sp``) so that after
    :func:`seq_to_head` rank ``r`` holds the kv head its query heads use. Returns ``x`` unchanged when
    ``Hk >= sp``. Raises ``InvalidInput`` when ``sp % Hk != 0``."""
    heads = int(x.shape[1])
    if heads >= sp:
        return x
    if sp % heads:
        raise InvalidInput(f"repeat_kv_for_sp: sp={sp} is not a multiple of kv heads {heads}")
    return x.repeat_interleave(sp // heads, dim=1)


def slice_for_rank(x: torch.Tensor, group: Any | None, *, dim: int = 0) -> torch.Tensor:
    """This rank's contiguous ``1/sp`` slice of ``x`` along ``dim`` (a view). The length must be a
    multiple of the group size (pad it with ``underlay.ops.packing.pad_to_multiple(x, sp, dim)``); raises ``InvalidInput`` otherwise."""
    sp = sp_world_size(group)
    if sp == 1:
        return x
    length = int(x.shape[dim])
    if length % sp:
        raise InvalidInput(
            f"slice_for_rank: length {length} along dim {dim} is not a multiple of sp={sp}; "
            "pad it first with underlay.ops.packing.pad_to_multiple"
        )
    part = length // sp
    return x.narrow(dim, sp_rank(group) * part, part)


def _a2a(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``all_to_all_single`` over dim 0 in equal chunks (out-of-place, contiguous input)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_head(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    t, h = int(x.shape[0]), int(x.shape[1])
    rest = x.shape[2:]
    chunks = x.reshape(t, sp, h // sp, *rest).transpose(0, 1)  # [sp, T_l, H/sp, ...]
    out = _a2a(chunks, group)  # chunk s = tokens of rank s, this rank's heads
    return out.reshape(sp * t, h // sp, *rest)


def _head_to_seq(y: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    t_full, hl = int(y.shape[0]), int(y.shape[1])
    rest = y.shape[2:]
    t = t_full // sp
    out = _a2a(y.reshape(sp, t, hl, *rest), group)  # chunk j = head group j of this rank's tokens
    return out.transpose(0, 1).reshape(t, sp * hl, *rest)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
        ctx.group, ctx.sp = group, sp
        return _seq_to_head(x, group, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _head_to_seq(grad, ctx.group, ctx.sp), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
        ctx.group, ctx.sp = group, sp
        return _head_to_seq(y, group, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _seq_to_head(grad, ctx.group, ctx.sp), None, None


def seq_to_head(x: torch.Tensor, group: Any | None) -> torch.Tensor:
    """All-to-all from a token slice to a head slice: ``x [T_l, H, ...]`` (this rank's ``T_l`` tokens,
    all heads) -> ``[sp * T_l, H / sp, ...]`` (all tokens in rank order, heads
    ``[r * H / sp, (r + 1) * H / sp)`` of rank ``r``). Differentiable (backward is :func:`head_to_seq`).
    Every rank must pass the same ``T_l``. Raises ``InvalidInput`` when ``H % sp != 0``.
    Identity when the group has one rank."""
    sp = sp_world_size(group)
    if sp == 1:
        return x
    if x.dim() < 2 or x.shape[1] % sp:
        raise InvalidInput(
            f"seq_to_head: heads dim of shape {tuple(x.shape)} must be divisible by sp={sp}; "
            "repeat kv heads with repeat_kv_for_sp or pick an sp that divides the heads"
        )
    out: torch.Tensor = _SeqToHead.apply(x, group, sp)  # type: ignore[no-untyped-call]
    return out


def head_to_seq(y: torch.Tensor, group: Any | None) -> torch.Tensor:
    """Inverse of :func:`seq_to_head`: ``y [sp * T_l, H / sp, ...]`` -> ``[T_l, H, ...]`` (this rank's
    tokens, all heads). Differentiable. Raises ``InvalidInput`` when the token count is not a multiple
    of sp. Identity when the group has one rank."""
    sp = sp_world_size(group)
    if sp == 1:
        return y
    if y.dim() < 2 or y.shape[0] % sp:
        raise InvalidInput(f"head_to_seq: token dim of shape {tuple(y.shape)} must be divisible by sp={sp}")
    out: torch.Tensor = _HeadToSeq.apply(y, group, sp)  # type: ignore[no-untyped-call]
    return out


def _all_gather_dim0(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    out = x.new_empty((sp * int(x.shape[0]), *x.shape[1:]))
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous(), group=group)
    return out


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
        ctx.group, ctx.sp, ctx.rank, ctx.n = group, sp, sp_rank(group), int(x.shape[0])
        return _all_gather_dim0(x, group, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.narrow(0, ctx.rank * ctx.n, ctx.n).contiguous(), None, None


def gather_seq(x: torch.Tensor, group: Any | None) -> torch.Tensor:
    """Concatenate every rank's ``x [T_l, ...]`` along dim 0 in rank order -> ``[sp * T_l, ...]`` on
    every rank. Backward keeps this rank's slice of the gradient (see the module docstring for the
    convention). Identity when the group has one rank."""
    sp = sp_world_size(group)
    if sp == 1:
        return x
    out: torch.Tensor = _GatherSeq.apply(x, group, sp)  # type: ignore[no-untyped-call]
    return out
