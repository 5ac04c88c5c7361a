"""Padding removal and restoration (THD packing) and position ids, for left- or right-padded batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from underlay.interfaces import InvalidInput, PackedBatch
from underlay.ops._checks import checked

__all__ = ["pad", "pad_to_multiple", "position_ids_from_mask", "unpad"]


def _check_mask(attention_mask: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise InvalidInput(
            f"{what}: attention_mask must be a [B, S] tensor, got shape "
            f"{tuple(getattr(attention_mask, 'shape', ()))}"
        )
    keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    return keep


@checked
def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedBatch:
    """Remove the padding of ``input_ids [B, S]`` under ``attention_mask [B, S]`` (1/True = real token).

    Returns a ``PackedBatch``: kept tokens sequence after sequence (``[T]``), ``cu_seqlens [B + 1]``
    int32, ``max_seqlen``, ``indices [T]`` int64 into the flattened ``[B * S]`` batch, ``position_ids
    [T]`` int64 restarting at 0 per sequence. Works for left and right padding (and any mask: tokens
    keep their order). ``input_ids`` may carry trailing dims (``[B, S, ...]``). Raises ``InvalidInput``
    when the shapes or devices differ.
    """
    keep = _check_mask(attention_mask, "unpad")
    if not isinstance(input_ids, torch.Tensor) or input_ids.shape[:2] != attention_mask.shape:
        raise InvalidInput(
            f"unpad: input_ids shape {tuple(getattr(input_ids, 'shape', ()))} must start with "
            f"attention_mask shape {tuple(attention_mask.shape)}"
        )
    if input_ids.device != attention_mask.device:
        raise InvalidInput(
            f"unpad: input_ids on {input_ids.device}, attention_mask on {attention_mask.device}"
        )
    b, s = attention_mask.shape
    flat_keep = keep.reshape(-1)
    indices = torch.nonzero(flat_keep, as_tuple=False).flatten()
    seqlens = keep.sum(dim=1, dtype=torch.int32)
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    position_ids = (torch.cumsum(keep.to(torch.int64), dim=1) - 1).reshape(-1)[indices]
    tokens = input_ids.reshape(b * s, *input_ids.shape[2:])[indices]
    max_seqlen = int(seqlens.max().item()) if b > 0 else 0
    return PackedBatch(
        input_ids=tokens,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        indices=indices,
        position_ids=position_ids,
        batch_size=b,
        seqlen=s,
    )


@checked
def pad(values: torch.Tensor, packed: PackedBatch, pad_value: float = 0) -> torch.Tensor:
    """Inverse of ``unpad``: scatter ``values [T, ...]`` back to ``[B, S, ...]``, ``pad_value`` elsewhere.

    Differentiable w.r.t. ``values`` (padding gets no gradient). Raises ``InvalidInput`` when
    ``values`` does not have ``packed.total_tokens`` rows.
    """
    if not isinstance(values, torch.Tensor) or values.dim() < 1 or values.shape[0] != packed.total_tokens:
        raise InvalidInput(
            f"pad: values shape {tuple(getattr(values, 'shape', ()))} must have "
            f"{packed.total_tokens} rows (the packed token count)"
        )
    b, s = packed.batch_size, packed.seqlen
    out = torch.full((b * s, *values.shape[1:]), pad_value, dtype=values.dtype, device=values.device)
    out = out.index_put((packed.indices.to(values.device),), values)
    return out.view(b, s, *values.shape[1:])


@checked
def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` int64 position ids counting real tokens from 0 in each row; padding gets 0.

    Right padding: ``0, 1, ..., n-1, 0, 0``; left padding: ``0, 0, 0, 1, ..., n-1``.
    """
    keep = _check_mask(attention_mask, "position_ids_from_mask")
    pos = torch.cumsum(keep.to(torch.int64), dim=1) - 1
    return torch.where(keep, pos, torch.zeros_like(pos))


@checked
def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = -1, value: float = 0) -> torch.Tensor:
    """Append ``value`` along ``dim`` so its size becomes the next multiple of ``multiple``.

    Returns ``x`` itself when already a multiple. Raises ``InvalidInput`` when ``multiple < 1`` or
    ``dim`` is out of range.
    """
    if not isinstance(multiple, int) or multiple < 1:
        raise InvalidInput(f"pad_to_multiple: multiple={multiple!r} must be an int >= 1")
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise InvalidInput(f"pad_to_multiple: dim={dim} out of range for a {x.dim()}-d tensor")
    d = dim % x.dim()
    extra = (-x.shape[d]) % multiple
    if extra == 0:
        return x
    widths = [0, 0] * (x.dim() - d - 1) + [0, extra]
    return F.pad(x, widths, value=value)
