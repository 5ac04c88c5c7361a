"""Per-sequence rotary embeddings for RoPE types whose frequencies depend on the sequence length.

transformers' ``dynamic`` (NTK) and ``longrope`` (Phi-3) rotary embeddings choose their frequencies from
``max(position_ids) + 1`` of the whole call (``transformers.modeling_rope_utils.dynamic_rope_update``).
On a packed micro-batch that is the longest sequence of the pack, so a short sequence packed next to a
long one would get the long factor and its log-probs would depend on how the engine grouped the
micro-batches. :func:`apply_per_sequence_rope` makes such a rotary module compute its ``cos``/``sin``
once per sequence (a sequence starts at the first token of a row and wherever the position id is 0),
each from that sequence's own length, as a forward of that sequence alone computes them; ``dynamic``
additionally starts every sequence from the module's original frequencies, so the result is a function of
the sequence alone and not of the lengths seen before (transformers keeps the largest length seen). Other
rope types (default, linear, llama3, yarn, ...) do not depend on the length and are left unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from underlay.parallel.ulysses import gather_seq, sp_world_size

__all__ = ["PER_SEQUENCE_ATTR", "SP_ATTR", "apply_per_sequence_rope", "length_dependent_rope"]

PER_SEQUENCE_ATTR = "_underlay_per_sequence_rope"
"""Class attribute (``True``) of the per-sequence rotary classes :func:`apply_per_sequence_rope` installs."""

SP_ATTR = "_underlay_rope_sp"
"""Attribute of a per-sequence rotary module that holds its Ulysses group."""


def _rope_types(module: nn.Module) -> list[str]:
    kind = getattr(module, "rope_type", None)
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, dict):
        return [str(v) for v in kind.values()]
    return []


def length_dependent_rope(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers rotary embedding whose frequencies depend on the sequence
    length (a ``rope_type`` containing ``"dynamic"``, or ``"longrope"``: the types transformers'
    ``dynamic_rope_update`` recomputes per call)."""
    return any("dynamic" in t or t == "longrope" for t in _rope_types(module))


def _segments(row: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each sequence in one row of position ids (starts at index 0 and at every 0)."""
    n = int(row.numel())
    starts = torch.nonzero(row == 0).reshape(-1).tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    ends = [*starts[1:], n]
    return list(zip(starts, ends))


def _reset_dynamic(module: nn.Module) -> None:
    """Put a ``dynamic`` rotary module back on its original frequencies (the state of a fresh module)."""
    original_len = getattr(module, "original_max_seq_len", None)
    if original_len is None:
        return
    kinds = getattr(module, "rope_type", None)
    layer_types = list(kinds) if isinstance(kinds, dict) else [None]
    for layer_type in layer_types:
        prefix = "" if layer_type is None else f"{layer_type}_"
        original = getattr(module, f"{prefix}original_inv_freq", None)
        if isinstance(original, torch.Tensor):
            current = getattr(module, f"{prefix}inv_freq", None)
            device = current.device if isinstance(current, torch.Tensor) else original.device
            module.register_buffer(f"{prefix}inv_freq", original.to(device), persistent=False)
        setattr(module, f"{prefix}max_seq_len_cached", original_len)


class _SpGroup:
    """The Ulysses group of a rotary module (shared, not copied, by ``copy.deepcopy`` of the model)."""

    def __init__(self, group: Any | None) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict[int, Any]) -> _SpGroup:
        return self


def _sequence_lengths(row: torch.Tensor, segments: list[tuple[int, int]], group: Any | None) -> list[int]:
    """The full length of the sequence each segment of ``row`` (this rank's position ids) belongs to.
    Under Ulysses (``group`` of more than one rank) a sequence may continue on the next rank: the
    positions of the whole packed sequence are gathered (one all-gather of ints, no gradient)."""
    sp = sp_world_size(group)
    if sp == 1:
        return [int(row[end - 1]) + 1 for _, end in segments]
    with torch.no_grad():
        full = gather_seq(row, group)
    offset = dist.get_rank(group) * int(row.numel())
    starts = [*torch.nonzero(full == 0).reshape(-1).tolist(), int(full.numel())]
    lengths = []
    for start, _ in segments:
        g = offset + start
        end = next(s for s in starts if s > g)
        lengths.append(int(full[end - 1]) + 1)
    return lengths


def _per_sequence_forward(
    module: nn.Module,
    forward: Callable[..., Any],
    x: torch.Tensor,
    position_ids: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward`` (the class's own) called once per sequence of ``position_ids``, results side by side.
    Each call sees its sequence's full length as ``max(position_ids) + 1`` (the last position is appended
    to a segment that ends early, e.g. on another Ulysses rank, and its output dropped)."""
    dynamic = any("dynamic" in t for t in _rope_types(module))
    holder = getattr(module, SP_ATTR, None)
    group = holder.group if isinstance(holder, _SpGroup) else None
    rows_cos: list[torch.Tensor] = []
    rows_sin: list[torch.Tensor] = []
    flat = position_ids.reshape(-1, position_ids.shape[-1])
    for b in range(int(flat.shape[0])):
        parts_cos: list[torch.Tensor] = []
        parts_sin: list[torch.Tensor] = []
        segments = _segments(flat[b])
        lengths = _sequence_lengths(flat[b], segments, group if flat.shape[0] == 1 else None)
        for (start, end), length in zip(segments, lengths):
            if dynamic:
                _reset_dynamic(module)
            pos = flat[b : b + 1, start:end]
            extra = int(pos[0, -1]) + 1 < length
            if extra:
                pos = torch.cat([pos, pos.new_full((1, 1), length - 1)], dim=1)
            cos, sin = forward(module, x, pos, *args, **kwargs)
            if extra:
                cos, sin = cos[..., :-1, :], sin[..., :-1, :]
            parts_cos.append(cos)
            parts_sin.append(sin)
        rows_cos.append(torch.cat(parts_cos, dim=-2))
        rows_sin.append(torch.cat(parts_sin, dim=-2))
    if dynamic:
        _reset_dynamic(module)
    cos_all, sin_all = torch.cat(rows_cos), torch.cat(rows_sin)
    shape = (*position_ids.shape, cos_all.shape[-1])
    return cos_all.reshape(shape), sin_all.reshape(shape)


@functools.cache
def _per_sequence_class(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of the rotary class ``cls`` whose forward runs per sequence (made once per class; a
    class rather than an instance attribute, so that copies of the model keep the behaviour and call
    their own module)."""
    own_forward = cls.forward

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def forward(
        self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        return _per_sequence_forward(self, own_forward, x, position_ids, *args, **kwargs)

    return type(f"PerSequence{cls.__name__}", (cls,), {"forward": forward, PER_SEQUENCE_ATTR: True})


def apply_per_sequence_rope(model: nn.Module, sp_group: Any | None = None) -> int:
    """Make every length-dependent rotary module of ``model`` (:func:`length_dependent_rope`) compute its
    ``cos``/``sin`` per sequence (see the module docstring), in place and idempotently.

    The wrapped forward takes what the module's own forward takes (``x``, ``position_ids [B, T]`` int,
    optional ``layer_type``) and returns ``(cos, sin)`` of shape ``[B, T, rotary_dim]`` in ``x``'s dtype,
    equal to the module's own forward called on each sequence alone. It reads the sequence starts on the
    host (one device sync per call) and runs eagerly under ``torch.compile``. With ``sp_group`` (Ulysses:
    each rank passes its slice of the packed position ids) a sequence's length is that of the whole
    sequence, across ranks. Returns the number of modules wrapped now or before."""
    count = 0
    for module in model.modules():
        if not length_dependent_rope(module):
            continue
        count += 1
        setattr(module, SP_ATTR, _SpGroup(sp_group))
        if not getattr(module, PER_SEQUENCE_ATTR, False):
            module.__class__ = _per_sequence_class(type(module))  # type: ignore[arg-type]
    return count
