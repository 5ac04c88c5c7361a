"""The ``triton`` Fp8Quantizer: blockwise e4m3 quantisation with one Triton program per tile.

Bit-identical to :mod:`underlay.ops.quant` (IEEE fp32 division ``div_rn``, round-to-nearest-even
conversion). Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before this module is imported) for tests.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from underlay.interfaces import Device, InvalidInput
from underlay.ops.quant import E4M3_MAX, check_dequant_args, check_quant_args

__all__ = ["TritonFp8Quantizer"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MANUAL_ROUNDING = _INTERPRET or os.environ.get("UNDERLAY_FP8_MANUAL_ROUNDING", "1") != "0"
"""Round with integer/fp32 arithmetic (exact round-to-nearest-even, the path that ran on the H200) rather
than the hardware conversions (``UNDERLAY_FP8_MANUAL_ROUNDING=0``; not yet checked on a GPU). Always on
under the interpreter, whose own fp8/bf16 casts are not round-to-nearest-even. Read at import."""
_WARPS = (
    [triton.Config({}, num_warps=4)] if _INTERPRET else [triton.Config({}, num_warps=w) for w in (4, 8, 16)]
)


@triton.jit  # type: ignore[untyped-decorator]
def _tile_offsets(  # type: ignore[no-untyped-def]
    M, K, bm, bk, BM: tl.constexpr, BK: tl.constexpr
):
    """Rows/columns of this program's tile and the mask of its in-bounds elements."""
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    offs_m = tl.program_id(0) * bm + rm
    offs_k = tl.program_id(1) * bk + rk
    mask = ((rm < bm) & (offs_m < M))[:, None] & ((rk < bk) & (offs_k < K))[None, :]
    return offs_m.to(tl.int64), offs_k.to(tl.int64), mask


@triton.jit
def _round_e4m3(x):  # type: ignore[no-untyped-def]
    """Round fp32 ``x`` (``|x| <= 448``) to the nearest e4m3 value, ties to even, in exact fp32 steps (sign kept, -0 too).

    The grid step is ``2^(max(e, -6) - 3)`` for ``x``'s binary exponent ``e`` (three mantissa bits,
    subnormals below ``2^-6``); ``x / step`` is rounded with the ``1.5 * 2^23`` trick. The result is
    exactly representable, so the final fp8 conversion is exact on every Triton target (the CPU
    interpreter's own fp8 rounding is not round-to-nearest-even).
    """
    bits = x.to(tl.int32, bitcast=True)
    ax = tl.abs(x)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6) - 3
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0
    r = ((ax * inv + magic) - magic) * step
    return tl.where(bits < 0, -r, r)


@triton.jit
def _round_bf16(x):  # type: ignore[no-untyped-def]
    """Round finite fp32 ``x`` to the nearest bfloat16 (ties to even) with integer ops; exact fp32 result.

    Matches hardware conversion on GPUs; the CPU interpreter's own fp32 -> bf16 cast truncates.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.autotune(configs=_WARPS, key=["M", "K", "bm", "bk"])  # type: ignore[untyped-decorator]
@triton.jit  # type: ignore[untyped-decorator]
def _quant_kernel(  # type: ignore[no-untyped-def]
    w_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    bm,
    bk,
    stride_wm,
    stride_wk,
    stride_qm,
    stride_sm,
    BM: tl.constexpr,
    BK: tl.constexpr,
    MANUAL: tl.constexpr,
):
    offs_m, offs_k, mask = _tile_offsets(M, K, bm, bk, BM, BK)
    w = tl.load(w_ptr + offs_m[:, None] * stride_wm + offs_k[None, :] * stride_wk, mask=mask, other=0.0).to(
        tl.float32
    )
    amax = tl.max(tl.max(tl.abs(w), 1), 0)
    scale = tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, 448.0))
    x = tl.math.div_rn(w, scale)
    if MANUAL:
        x = _round_e4m3(x)
    q = x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    # The sign bit of x goes on every byte: on the H200 values that round to zero came out +0 where
    # round-to-nearest-even (and torch) gives -0 for negative x. OR-ing it is a no-op elsewhere.
    # (taken from w, not the rounded x: the compiler may turn -0.0 produced by the rounding into +0.0)
    sign = ((w.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    q = (q.to(tl.uint8, bitcast=True) | sign).to(tl.float8e4nv, bitcast=True)
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], q, mask=mask)
    tl.store(s_ptr + tl.program_id(0) * stride_sm + tl.program_id(1), scale)


@triton.autotune(configs=_WARPS, key=["M", "K", "bm", "bk"])  # type: ignore[untyped-decorator]
@triton.jit  # type: ignore[untyped-decorator]
def _dequant_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    s_ptr,
    o_ptr,
    M,
    K,
    bm,
    bk,
    stride_qm,
    stride_qk,
    stride_sm,
    stride_sk,
    stride_om,
    BM: tl.constexpr,
    BK: tl.constexpr,
    MANUAL: tl.constexpr,
):
    offs_m, offs_k, mask = _tile_offsets(M, K, bm, bk, BM, BK)
    scale = tl.load(s_ptr + tl.program_id(0) * stride_sm + tl.program_id(1) * stride_sk)
    q = tl.load(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :] * stride_qk, mask=mask, other=0.0)
    out = q.to(tl.float32) * scale
    if MANUAL and o_ptr.dtype.element_ty == tl.bfloat16:
        out = _round_bf16(out)
    out = out.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(o_ptr + offs_m[:, None] * stride_om + offs_k[None, :], out, mask=mask)


class TritonFp8Quantizer:
    """``Fp8Quantizer`` on CUDA GPUs through Triton; one program per ``(bm, bk)`` tile.

    Tiles larger than 128 x 256 elements (after rounding each side up to a power of two) are refused
    (``InvalidInput``) because one program holds a whole tile; use the ``torch`` quantiser for those.
    """

    _MAX_TILE = 128 * 256

    def __init__(self, device: Device) -> None:
        self._device = device
        if E4M3_MAX != 448.0:  # the kernel hard-codes the e4m3 maximum
            raise AssertionError("E4M3_MAX changed; update _quant_kernel")

    @property
    def name(self) -> str:
        """Registry name ``"triton"``."""
        return "triton"

    def _tile(self, block: tuple[int, int], t: torch.Tensor) -> tuple[int, int]:
        if t.device.type != "cuda" and not (_INTERPRET and t.device.type == "cpu"):
            raise InvalidInput(
                f"the triton quantiser needs CUDA tensors, got {t.device}; move them with .cuda() or "
                f"select UNDERLAY_QUANT=torch"
            )
        p2 = (triton.next_power_of_2(block[0]), triton.next_power_of_2(block[1]))
        if p2[0] * p2[1] > self._MAX_TILE:
            raise InvalidInput(
                f"block {block} is too large for the triton quantiser (at most {self._MAX_TILE} elements "
                f"after rounding each side up to a power of two); use UNDERLAY_QUANT=torch"
            )
        return p2

    def quantize(
        self, weight: torch.Tensor, block: tuple[int, int] = (128, 128)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [M, K] float8_e4m3fn, scales [ceil(M/bm), ceil(K/bk)] float32)`` for ``weight [M, K]``
        (bf16/fp16/fp32, any strides); ``scale = amax / 448`` per tile (1 if all zero). Raises
        ``InvalidInput`` for a non-2-D weight, a bad dtype or block, or a non-CUDA tensor."""
        bm, bk = check_quant_args(weight, block)
        big_m, big_k = self._tile((bm, bk), weight)
        m, k = weight.shape
        q = torch.empty((m, k), device=weight.device, dtype=torch.float8_e4m3fn)
        scales = torch.empty((-(-m // bm), -(-k // bk)), device=weight.device, dtype=torch.float32)
        if q.numel():
            _quant_kernel[scales.shape[0], scales.shape[1]](
                weight, q, scales, m, k, bm, bk, weight.stride(0), weight.stride(1), q.stride(0),
                scales.stride(0), BM=big_m, BK=big_k, MANUAL=MANUAL_ROUNDING,
            )  # fmt: skip
        return q, scales

    def dequantize(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        block: tuple[int, int] = (128, 128),
        dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """``q * scale`` per tile, in fp32 then rounded once to ``dtype``. Raises ``InvalidInput`` on
        mismatched shapes, dtypes or devices."""
        bm, bk = check_dequant_args(q, scales, block, dtype)
        big_m, big_k = self._tile((bm, bk), q)
        m, k = q.shape
        out = torch.empty((m, k), device=q.device, dtype=dtype)
        if out.numel():
            _dequant_kernel[scales.shape[0], scales.shape[1]](
                q, scales, out, m, k, bm, bk, q.stride(0), q.stride(1), scales.stride(0),
                scales.stride(1), out.stride(0), BM=big_m, BK=big_k, MANUAL=MANUAL_ROUNDING,
            )  # fmt: skip
        return out
