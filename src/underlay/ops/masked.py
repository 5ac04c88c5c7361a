"""Masked statistics over token tensors (1 = keep), safe against NaN/inf at masked-out positions.

Masked-out values are replaced with ``torch.where`` (never multiplied by 0), so a NaN or inf where the
mask is 0 never reaches the result, while one where the mask is 1 does. Masks may be bool or numeric
(any non-zero value keeps) and must broadcast to ``x``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from underlay.interfaces import InvalidInput
from underlay.ops._checks import checked

__all__ = ["clip_by_value", "masked_mean", "masked_sum", "masked_var", "masked_whiten", "response_mask"]

Dim = int | Sequence[int] | None


def _keep(x: torch.Tensor, mask: torch.Tensor, what: str) -> torch.Tensor:
    """Boolean mask broadcast to ``x``; ``InvalidInput`` when the shapes do not broadcast."""
    if not isinstance(x, torch.Tensor) or not isinstance(mask, torch.Tensor):
        raise InvalidInput(
            f"{what}: x and mask must be tensors, got {type(x).__name__}, {type(mask).__name__}"
        )
    try:
        shape = torch.broadcast_shapes(x.shape, mask.shape)  # type: ignore[no-untyped-call]
    except RuntimeError as exc:
        raise InvalidInput(
            f"{what}: mask shape {tuple(mask.shape)} does not broadcast to x shape {tuple(x.shape)}"
        ) from exc
    if shape != x.shape:
        raise InvalidInput(f"{what}: mask shape {tuple(mask.shape)} would enlarge x shape {tuple(x.shape)}")
    if mask.device != x.device:
        raise InvalidInput(f"{what}: mask on {mask.device}, x on {x.device}; move them to one device")
    keep = mask if mask.dtype == torch.bool else mask != 0
    return keep.expand(x.shape)


def _dims(dim: Dim) -> tuple[int, ...] | None:
    if dim is None:
        return None
    return (dim,) if isinstance(dim, int) else tuple(dim)


def _sum(t: torch.Tensor, dim: Dim) -> torch.Tensor:
    d = _dims(dim)
    return t.sum() if d is None else t.sum(dim=d)


@checked
def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is non-zero, over ``dim`` (all dims when ``None``); dtype of ``x``."""
    keep = _keep(x, mask, "masked_sum")
    return _sum(torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)), dim)


def _count(keep: torch.Tensor, dim: Dim, dtype: torch.dtype) -> torch.Tensor:
    return _sum(keep.to(dtype), dim)


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.float()


@checked
def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """Mean of the kept elements of ``x`` over ``dim`` (all dims when ``None``).

    Float dtype of ``x`` (integers become fp32). A slice with no kept element has mean 0 (so that an
    all-padding micro-batch contributes a zero loss instead of NaN).
    """
    keep = _keep(x, mask, "masked_mean")
    xf = _float(x)
    total = _sum(torch.where(keep, xf, torch.zeros((), dtype=xf.dtype, device=x.device)), dim)
    count = _count(keep, dim, xf.dtype)
    return torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total))


@checked
def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, dim: Dim = None) -> torch.Tensor:
    """Variance of the kept elements over ``dim``; Bessel-corrected (``n - 1``) when ``unbiased``.

    Two-pass (mean first) for accuracy. A slice with fewer than 2 kept elements (1 when biased) has
    variance 0.
    """
    keep = _keep(x, mask, "masked_var")
    xf = _float(x)
    zero = torch.zeros((), dtype=xf.dtype, device=x.device)
    count = _count(keep, dim, xf.dtype)
    mean = torch.where(count > 0, _sum(torch.where(keep, xf, zero), dim) / count.clamp_min(1), zero)
    d = _dims(dim)
    mean_b = mean if d is None else _unsqueeze(mean, d, x.dim())
    centered = torch.where(keep, xf - mean_b, zero)
    ss = _sum(centered * centered, dim)
    denom = count - 1 if unbiased else count
    return torch.where(denom > 0, ss / denom.clamp_min(1), torch.zeros_like(ss))


def _unsqueeze(t: torch.Tensor, dims: tuple[int, ...], ndim: int) -> torch.Tensor:
    for d in sorted(di % ndim for di in dims):
        t = t.unsqueeze(d)
    return t


@checked
def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the (unbiased) mean/var of the kept elements of all of ``x``.

    With ``shift_mean=False`` the mean is added back (only the scale changes). Masked-out positions of
    the result are 0. Same shape as ``x``; float dtype. ``eps`` must be >= 0.
    """
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise InvalidInput(f"masked_whiten: eps={eps!r} must be a finite number >= 0")
    keep = _keep(x, mask, "masked_whiten")
    xf = _float(x)
    mean = masked_mean(xf, keep)
    var = masked_var(xf, keep, unbiased=True)
    out = (xf - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


@checked
def response_mask(
    response_ids: torch.Tensor, eos_token_ids: int | Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """``[B, R]`` int64 mask: 1 up to and including the first EOS of each row, 0 after it.

    ``response_ids [B, R]`` integer tokens; ``eos_token_ids`` one id or several (any of them ends the
    response). A row without EOS is all ones. Raises ``InvalidInput`` on a non-integer or non-2-d input
    or an empty EOS list.
    """
    if (
        not isinstance(response_ids, torch.Tensor)
        or response_ids.dim() != 2
        or response_ids.is_floating_point()
    ):
        raise InvalidInput(
            f"response_mask: response_ids must be an integer [B, R] tensor, got "
            f"{getattr(response_ids, 'dtype', type(response_ids).__name__)} {tuple(getattr(response_ids, 'shape', ()))}"
        )
    eos = torch.as_tensor(
        [eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids, device=response_ids.device
    ).reshape(-1)
    if eos.numel() == 0:
        raise InvalidInput("response_mask: eos_token_ids is empty; pass the tokenizer's eos id(s)")
    is_eos = torch.isin(response_ids, eos.to(response_ids.dtype)).to(torch.int64)
    seen_before = torch.cumsum(is_eos, dim=1) - is_eos
    return (seen_before == 0).to(torch.int64)


@checked
def clip_by_value(x: torch.Tensor, low: float | torch.Tensor, high: float | torch.Tensor) -> torch.Tensor:
    """``min(max(x, low), high)`` elementwise; bounds are numbers or tensors broadcasting to ``x``.

    Raises ``InvalidInput`` when a bound is NaN (``torch.maximum`` would turn every element into NaN)
    or number bounds have ``low > high``; infinite bounds mean no bound on that side. Gradient flows
    where unclipped.
    """
    for name, b in (("low", low), ("high", high)):
        nan = bool(torch.isnan(b).any()) if isinstance(b, torch.Tensor) else b != b
        if nan:
            raise InvalidInput(f"clip_by_value: {name} bound is NaN; give a number (use inf for no bound)")
    if not isinstance(low, torch.Tensor) and not isinstance(high, torch.Tensor) and low > high:
        raise InvalidInput(f"clip_by_value: low={low} > high={high}; swap the bounds")
    for name, b in (("low", low), ("high", high)):
        if isinstance(b, torch.Tensor):
            try:
                fits = torch.broadcast_shapes(x.shape, b.shape) == x.shape  # type: ignore[no-untyped-call]
            except RuntimeError:
                fits = False
            if not fits:
                raise InvalidInput(
                    f"clip_by_value: {name} bound shape {tuple(b.shape)} does not broadcast to x shape "
                    f"{tuple(x.shape)}; give a number or a tensor of a broadcastable shape"
                )
    lo = low if isinstance(low, torch.Tensor) else torch.tensor(low, dtype=x.dtype, device=x.device)
    hi = high if isinstance(high, torch.Tensor) else torch.tensor(high, dtype=x.dtype, device=x.device)
    return torch.minimum(torch.maximum(x, lo.to(x.dtype)), hi.to(x.dtype))
