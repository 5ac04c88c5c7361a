"""Blockwise FP8 (e4m3) weight quantisation in plain torch: the reference every quantiser backend matches.

Each ``block = (bm, bk)`` tile of a 2-D weight gets one fp32 scale ``amax / 448`` (``1`` for an all-zero
tile); its values become ``weight / scale`` rounded to nearest-even ``float8_e4m3fn``. Edge tiles may be
partial. Dequantisation multiplies back in fp32 and rounds once to the requested dtype (fp64 output is
computed in fp64, where the product of an e4m3 value and an fp32 scale is exact). Weights are bf16, fp16
or fp32: an fp64 weight is refused, since the scales and the e4m3 rounding are defined on fp32 values.
"""

from __future__ import annotations

import torch

from underlay.interfaces import InvalidInput

__all__ = [
    "E4M3_MAX",
    "check_dequant_args",
    "check_quant_args",
    "dequantize_fp8_blockwise",
    "quantize_fp8_blockwise",
]

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value; a tile's amax maps to it."""

_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if (
        not isinstance(block, (tuple, list))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise InvalidInput(f"block must be a pair of positive ints (bm, bk), got {block!r}; e.g. (128, 128)")
    return int(block[0]), int(block[1])


def check_quant_args(weight: torch.Tensor, block: tuple[int, int]) -> tuple[int, int]:
    """Validate ``quantize`` arguments; returns ``block`` as ints. Raises ``InvalidInput``."""
    bm, bk = _check_block(block)
    if weight.dim() != 2:
        raise InvalidInput(
            f"weight must be 2-D [M, K], got shape {tuple(weight.shape)}; reshape it (e.g. .flatten(1))"
        )
    if weight.dtype not in _IN_DTYPES:
        raise InvalidInput(
            f"weight dtype must be bf16, fp16 or fp32, got {weight.dtype}; cast it (an fp64 weight: "
            ".float(), the scales and e4m3 rounding are defined on fp32 values)"
        )
    return bm, bk


def check_dequant_args(
    q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> tuple[int, int]:
    """Validate ``dequantize`` arguments; returns ``block`` as ints. Raises ``InvalidInput``."""
    bm, bk = _check_block(block)
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        raise InvalidInput(f"q must be a 2-D float8_e4m3fn tensor, got {q.dtype} of shape {tuple(q.shape)}")
    want = (-(-q.shape[0] // bm), -(-q.shape[1] // bk))
    if scales.dtype != torch.float32 or tuple(scales.shape) != want:
        raise InvalidInput(
            f"scales must be float32 of shape {want} for q {tuple(q.shape)} and block {(bm, bk)}; got "
            f"{scales.dtype} {tuple(scales.shape)}"
        )
    if scales.device != q.device:
        raise InvalidInput(f"q and scales must be on one device, got {q.device} and {scales.device}")
    if dtype not in (*_IN_DTYPES, torch.float64):
        raise InvalidInput(f"dtype must be bf16, fp16, fp32 or fp64, got {dtype}")
    return bm, bk


def _expand(scales: torch.Tensor, shape: torch.Size, bm: int, bk: int) -> torch.Tensor:
    """Per-element scale ``[M, K]`` from per-tile ``scales``."""
    return scales.repeat_interleave(bm, 0)[: shape[0]].repeat_interleave(bk, 1)[:, : shape[1]]


def quantize_fp8_blockwise(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight [M, K]`` (bf16/fp16/fp32, any strides, any device) tile by tile.

    Returns ``(q [M, K] float8_e4m3fn, scales [ceil(M/bm), ceil(K/bk)] float32)`` on ``weight``'s device,
    ``scale = amax / 448`` per tile (1 when the tile is all zero), ``q = RNE(weight / scale)``.
    Non-finite inputs give unspecified values. Raises ``InvalidInput`` for a non-2-D weight, an
    unsupported dtype or a bad ``block``.
    """
    bm, bk = check_quant_args(weight, block)
    m, k = weight.shape
    mb, kb = -(-m // bm), -(-k // bk)
    w = weight.float()
    padded = torch.zeros((mb * bm, kb * bk), dtype=torch.float32, device=weight.device)
    padded[:m, :k] = w.abs()
    amax = padded.view(mb, bm, kb, bk).amax(dim=(1, 3))
    # tensor / tensor: IEEE division on every device (CUDA turns division by a scalar into a multiply)
    scales = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, E4M3_MAX))
    q = (w / _expand(scales, weight.shape, bm, bk)).to(torch.float8_e4m3fn)
    return q, scales


def dequantize_fp8_blockwise(
    q: torch.Tensor,
    scales: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``q * scale`` per tile, computed in fp32 and rounded once to ``dtype`` (bf16/fp16/fp32; fp64 is
    computed in fp64, exactly).

    ``q [M, K]`` float8_e4m3fn and ``scales [ceil(M/bm), ceil(K/bk)]`` float32 as returned by
    :func:`quantize_fp8_blockwise`. Raises ``InvalidInput`` on mismatched shapes, dtypes or devices.
    """
    bm, bk = check_dequant_args(q, scales, block, dtype)
    if dtype == torch.float64:
        return q.double() * _expand(scales, q.shape, bm, bk).double()
    return (q.float() * _expand(scales, q.shape, bm, bk)).to(dtype)
