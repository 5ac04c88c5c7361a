"""The ``triton`` Fp8Quantizer: blockwise e4m3 quantisation, one Triton program per ``(bm, bk)`` tile.

Bit-identical to :mod:`underlay.ops.quant`: each element is divided by its tile's scale with IEEE
round-to-nearest division (``div_rn``) and converted to e4m3 with round-to-nearest-even (Triton's
``.to(float8e4nv, "rtne")``; exact integer/fp32 rounding under the interpreter, whose own fp8 and bf16
casts do not round to nearest even). The input's sign bit is ORed into every byte, so a negative value
that rounds to zero gives -0 as torch does. Dequantisation multiplies in fp32 and rounds once to the
output dtype. Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before this module is imported) for tests.

``TritonFp8Quantizer(device, autotune=False)`` launches with 8 warps instead of autotuning the warp count
(and register cap) for each new shape (the launch configuration does not change the result).

This kernel was chosen on the H200 among variants (reciprocal division, inline-PTX conversion, several
tiles per program) that were no faster; its figures are in ``benchmarks/results/fp8.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from underlay.backends.cuda._interpret import triton_interprets
from underlay.interfaces import ConfigError, Device, InvalidInput
from underlay.ops.quant import E4M3_MAX, check_dequant_args, check_quant_args

__all__ = ["TritonFp8Quantizer"]

_INTERPRET = triton_interprets()
"""Whether Triton runs its CPU interpreter (``TRITON_INTERPRET`` as Triton reads it). Read at import on
purpose: Triton itself decides this when the kernels below are defined, so a later change of the
variable cannot take effect in this process."""

_SW, _CAST = 0, 1  # how fp32 is rounded to e4m3: exact arithmetic (interpreter) or the hardware cast


def _make_configs() -> list[Any]:
    """Launch configurations: 1..16 warps, and 8/16 warps capped at 64/32 registers per thread (4
    programs per SM). The caps are left out where this Triton's ``Config`` has no ``maxnreg``."""
    configs = []
    for warps, maxnreg in ((1, None), (2, None), (4, None), (8, None), (16, None), (8, 64), (16, 32)):
        try:
            kw = {} if maxnreg is None else {"maxnreg": maxnreg}
            configs.append(triton.Config({}, num_warps=warps, **kw))
        except TypeError:
            pass
    return configs


_CONFIGS = _make_configs()


def _maxnreg(config: Any) -> int | None:
    return getattr(config, "maxnreg", None)


def _fitting(configs: list[Any], bm: int, bk: int) -> list[Any]:
    """Configurations that give every thread at least 4 elements of a ``bm x bk`` tile: those of 4..16
    warps when the tile allows, else the widest that fits."""
    fit = [c for c in configs if c.num_warps * 32 * 4 <= bm * bk] or [configs[0]]
    big = [c for c in fit if c.num_warps >= 4]
    return big or [max(fit, key=lambda c: c.num_warps)]


def _untuned(configs: list[Any], **meta: Any) -> Any:
    """The one configuration launched without autotuning (``autotune=False``, or the interpreter) for
    the tile ``meta["BM"] x meta["BK"]``: 8 warps without a register cap where it fits, else the
    widest fitting one without a cap."""
    fit = _fitting(configs, int(meta["BM"]), int(meta["BK"]))
    plain = [c for c in fit if _maxnreg(c) is None]
    pick = [c for c in plain if c.num_warps == 8] or plain[-1:] or fit[:1]
    return pick[0]


def _prune(configs: list[Any], nargs: dict[str, Any], **kwargs: Any) -> list[Any]:
    """The autotuner's candidates (its ``early_config_prune``) for the tile in ``nargs``/``kwargs``:
    :func:`_fitting`, or only :func:`_untuned`'s pick under the interpreter."""
    args = {**nargs, **kwargs}
    if _INTERPRET:
        return [_untuned(configs, **args)]
    return _fitting(configs, int(args["BM"]), int(args["BK"]))


_KEY = ["M", "K", "bm", "bk", "CVT"]
_NO_SPECIALIZE = ["M", "K", "n_kb"]  # only masks and program ids use them: fewer compilations


@triton.jit  # type: ignore[untyped-decorator]
def _tile_ptrs(  # type: ignore[no-untyped-def]
    ptr,
    pid_m,
    kt,
    bm,
    bk,
    stride_m,
    stride_k,
    BM: tl.constexpr,
    BK: tl.constexpr,
    OFF64: tl.constexpr,
    VEC: tl.constexpr = 0,
):
    """Pointers to the ``[BM, BK]`` block at tile ``(pid_m, kt)``: int64 tile origin, int32 offsets
    inside the tile unless ``OFF64``. ``VEC`` > 0 tells the compiler the offsets are contiguous in runs
    of ``VEC`` along K (callers pass it only for a unit stride along K), so a load is vectorised like
    the store it feeds (no layout conversion through shared memory)."""
    base = ptr + (pid_m.to(tl.int64) * bm) * stride_m + (kt.to(tl.int64) * bk) * stride_k
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    if OFF64:
        offs = rm.to(tl.int64)[:, None] * stride_m + rk.to(tl.int64)[None, :] * stride_k
    else:
        offs = rm[:, None] * stride_m + rk[None, :] * stride_k
    if VEC > 0:
        offs = tl.max_contiguous(offs, [1, VEC])
    return base + offs


@triton.jit  # type: ignore[untyped-decorator]
def _tile_mask(  # type: ignore[no-untyped-def]
    pid_m,
    kt,
    M,
    K,
    bm,
    bk,
    BM: tl.constexpr,
    BK: tl.constexpr,
    PAD_M: tl.constexpr,
    EDGE_M: tl.constexpr,
    PAD_K: tl.constexpr,
    EDGE_K: tl.constexpr,
):
    """In-bounds elements of the block: only the terms that can be false (``PAD_*``: the block side is
    larger than the tile side; ``EDGE_*``: the matrix side is not a multiple of the tile side)."""
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    row = rm < BM
    col = rk < BK
    if PAD_M:
        row = row & (rm < bm)
    if EDGE_M:
        row = row & (pid_m * bm + rm < M)
    if PAD_K:
        col = col & (rk < bk)
    if EDGE_K:
        col = col & (kt * bk + rk < K)
    return row[:, None] & col[None, :]


@triton.jit
def _round_e4m3(x):  # type: ignore[no-untyped-def]
    """Round fp32 ``x`` (``|x| <= 448``) to the nearest e4m3 value, ties to even, in exact fp32 steps.

    The grid step is ``2^(max(e, -6) - 3)`` for ``x``'s binary exponent ``e`` (three mantissa bits,
    subnormals below ``2^-6``); ``x / step`` is rounded with the ``1.5 * 2^23`` trick. The result is
    exactly representable, so the final fp8 conversion is exact on every Triton target (the CPU
    interpreter's own fp8 rounding is not round-to-nearest-even). The sign of a zero result is not
    reliable; callers OR the input's sign into the byte.
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


@triton.jit  # type: ignore[untyped-decorator]
def _store_e4m3(x, w_raw, q_ptrs, mask, CVT: tl.constexpr, MASKED: tl.constexpr):  # type: ignore[no-untyped-def]
    """Round fp32 ``x`` to e4m3 (``CVT``: 0 exact arithmetic, 1 Triton's RNE cast), OR the sign bit of the
    input ``w_raw`` into every byte and store the bytes at ``q_ptrs``."""
    if CVT == 0:
        x = _round_e4m3(x)
    qb = x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    # The sign bit of the input goes on every byte: values that round to zero must give -0 for negative
    # inputs, as round-to-nearest-even (and torch) does; a no-op elsewhere.
    sign = ((w_raw.to(tl.float32).to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    q8 = (qb | sign).to(tl.float8e4nv, bitcast=True)
    if MASKED:
        tl.store(q_ptrs, q8, mask=mask)
    else:
        tl.store(q_ptrs, q8)


@triton.autotune(configs=_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune})  # type: ignore[untyped-decorator]
@triton.jit(do_not_specialize=_NO_SPECIALIZE)  # type: ignore[untyped-decorator]
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
    n_kb,
    BM: tl.constexpr,
    BK: tl.constexpr,
    PAD_M: tl.constexpr,
    EDGE_M: tl.constexpr,
    PAD_K: tl.constexpr,
    EDGE_K: tl.constexpr,
    OFF64: tl.constexpr,
    CVT: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One program per tile, consecutive programs along K (the tiles in flight cover whole rows):
    ``scale = amax / 448`` (1 for an all-zero tile), ``q = RNE_e4m3(div_rn(w, scale))``."""
    pid = tl.program_id(0)
    pid_m = pid // n_kb
    kt = pid % n_kb
    w_ptrs = _tile_ptrs(w_ptr, pid_m, kt, bm, bk, stride_wm, stride_wk, BM, BK, OFF64)
    mask = _tile_mask(pid_m, kt, M, K, bm, bk, BM, BK, PAD_M, EDGE_M, PAD_K, EDGE_K)
    if MASKED:
        w_raw = tl.load(w_ptrs, mask=mask, other=0.0)
    else:
        w_raw = tl.load(w_ptrs)
    amax = tl.max(tl.max(tl.abs(w_raw), 1), 0).to(tl.float32)
    scale = tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, 448.0))
    tl.store(s_ptr + pid_m * stride_sm + kt, scale)
    x = tl.math.div_rn(w_raw.to(tl.float32), scale)
    q_ptrs = _tile_ptrs(q_ptr, pid_m, kt, bm, bk, stride_qm, 1, BM, BK, OFF64)
    _store_e4m3(x, w_raw, q_ptrs, mask, CVT, MASKED)


@triton.autotune(configs=_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune})  # type: ignore[untyped-decorator]
@triton.jit(do_not_specialize=_NO_SPECIALIZE)  # type: ignore[untyped-decorator]
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
    n_kb,
    BM: tl.constexpr,
    BK: tl.constexpr,
    PAD_M: tl.constexpr,
    EDGE_M: tl.constexpr,
    PAD_K: tl.constexpr,
    EDGE_K: tl.constexpr,
    OFF64: tl.constexpr,
    CVT: tl.constexpr,
    MASKED: tl.constexpr,
    VEC: tl.constexpr,
):
    """One program per tile: ``q * scale`` in fp32, rounded once to the output dtype (with exact integer
    rounding to bf16 under the interpreter, ``CVT == 0``)."""
    pid = tl.program_id(0)
    pid_m = pid // n_kb
    kt = pid % n_kb
    q_ptrs = _tile_ptrs(q_ptr, pid_m, kt, bm, bk, stride_qm, stride_qk, BM, BK, OFF64, VEC)
    mask = _tile_mask(pid_m, kt, M, K, bm, bk, BM, BK, PAD_M, EDGE_M, PAD_K, EDGE_K)
    scale = tl.load(s_ptr + pid_m * stride_sm + kt * stride_sk)
    if MASKED:
        q = tl.load(q_ptrs, mask=mask, other=0.0)
    else:
        q = tl.load(q_ptrs)
    out = q.to(tl.float32) * scale
    out_ty = o_ptr.dtype.element_ty
    if CVT == 0 and out_ty == tl.bfloat16:
        out = _round_bf16(out)
    out = out.to(out_ty, fp_downcast_rounding="rtne")
    o_ptrs = _tile_ptrs(o_ptr, pid_m, kt, bm, bk, stride_om, 1, BM, BK, OFF64)
    if MASKED:
        tl.store(o_ptrs, out, mask=mask)
    else:
        tl.store(o_ptrs, out)


def _launch(kernel: Any, grid: int, args: tuple[Any, ...], meta: dict[str, Any], autotune: bool) -> None:
    """Launch through the autotuner when ``autotune`` (and not interpreted), else directly with the one
    configuration :func:`_untuned` picks (no autotuner bookkeeping at all)."""
    if autotune and not _INTERPRET:
        kernel[(grid,)](*args, **meta)
        return
    cfg = _untuned(_CONFIGS, **meta)
    opts: dict[str, Any] = {"num_warps": cfg.num_warps}
    if _maxnreg(cfg) is not None:
        opts["maxnreg"] = _maxnreg(cfg)
    kernel.fn[(grid,)](*args, **meta, **opts)


class TritonFp8Quantizer:
    """``Fp8Quantizer`` on CUDA GPUs through Triton; one program per ``(bm, bk)`` tile.

    Tiles larger than 128 x 256 elements (after rounding each side up to a power of two) are refused
    (``InvalidInput``) because one program holds a whole tile; use the ``torch`` quantiser for those.

    ``autotune`` (default ``True``): time the launch configurations (warps, register cap) once per new
    shape and keep the fastest; ``False`` launches every shape with 8 warps (benchmarks use it to time
    without tuning). The results are bit-identical either way. A non-bool raises ``ConfigError``.
    """

    _MAX_TILE = 128 * 256

    def __init__(self, device: Device, autotune: bool = True) -> None:
        if not isinstance(autotune, bool):
            raise ConfigError(f"TritonFp8Quantizer(autotune=...) must be True or False, got {autotune!r}")
        self._device = device
        self._autotune = autotune
        if E4M3_MAX != 448.0:  # the kernel hard-codes the e4m3 maximum
            raise AssertionError("E4M3_MAX changed; update _quant_kernel")

    @property
    def name(self) -> str:
        """Registry name ``"triton"``."""
        return "triton"

    @property
    def autotune(self) -> bool:
        """Whether launches autotune their configuration per shape (see the class docstring)."""
        return self._autotune

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

    @staticmethod
    def _meta(
        shape: tuple[int, int], block: tuple[int, int], big: tuple[int, int], strides: list[int]
    ) -> tuple[int, dict[str, Any]]:
        """``(n_kb, constexprs)`` for a ``shape`` matrix in ``block`` tiles padded to ``big``; ``strides``
        are the (row, column) strides of every tensor the kernel addresses."""
        (m, k), (bm, bk), (big_m, big_k) = shape, block, big
        off64 = max(
            strides[i] * (big_m - 1) + strides[i + 1] * (big_k - 1) for i in range(0, len(strides), 2)
        )
        meta: dict[str, Any] = {
            "BM": big_m,
            "BK": big_k,
            "PAD_M": bm != big_m,
            "EDGE_M": m % bm != 0,
            "PAD_K": bk != big_k,
            "EDGE_K": k % bk != 0,
            "OFF64": off64 >= 2**31,
            "CVT": _SW if _INTERPRET else _CAST,
        }
        meta["MASKED"] = bool(meta["PAD_M"] or meta["EDGE_M"] or meta["PAD_K"] or meta["EDGE_K"])
        return -(-k // bk), meta

    def quantize(
        self, weight: torch.Tensor, block: tuple[int, int] = (128, 128)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [M, K] float8_e4m3fn, scales [ceil(M/bm), ceil(K/bk)] float32)`` for ``weight [M, K]``
        (bf16/fp16/fp32, any strides); ``scale = amax / 448`` per tile (1 if all zero). Raises
        ``InvalidInput`` for a non-2-D weight, a bad dtype or block, a tile too large or a non-CUDA
        tensor."""
        bm, bk = check_quant_args(weight, block)
        big = self._tile((bm, bk), weight)
        m, k = weight.shape
        q = torch.empty((m, k), device=weight.device, dtype=torch.float8_e4m3fn)
        scales = torch.empty((-(-m // bm), -(-k // bk)), device=weight.device, dtype=torch.float32)
        if q.numel():
            strides = [abs(weight.stride(0)), abs(weight.stride(1)), k, 1]
            n_kb, meta = self._meta((m, k), (bm, bk), big, strides)
            args = (weight, q, scales, m, k, bm, bk, weight.stride(0), weight.stride(1), q.stride(0),
                    scales.stride(0), n_kb)  # fmt: skip
            _launch(_quant_kernel, scales.numel(), args, meta, self._autotune)
        return q, scales

    def dequantize(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        block: tuple[int, int] = (128, 128),
        dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """``q * scale`` per tile, in fp32 then rounded once to ``dtype`` (bf16/fp16/fp32). Raises
        ``InvalidInput`` on mismatched shapes, dtypes or devices, and for ``float64`` (the torch quantiser
        computes that in float64)."""
        bm, bk = check_dequant_args(q, scales, block, dtype)
        if dtype == torch.float64:
            raise InvalidInput(
                "the triton quantiser dequantises to bf16, fp16 or fp32; for float64 (computed exactly in "
                "float64) use the torch quantiser (UNDERLAY_QUANT=torch)"
            )
        big = self._tile((bm, bk), q)
        m, k = q.shape
        out = torch.empty((m, k), device=q.device, dtype=dtype)
        if out.numel():
            strides = [abs(q.stride(0)), abs(q.stride(1)), k, 1]
            n_kb, meta = self._meta((m, k), (bm, bk), big, strides)
            # q bytes per thread = output elements per 16-byte store (a contiguity hint: only where the
            # q rows are contiguous, i.e. stride 1 along K, which Triton then specialises on)
            meta["VEC"] = 16 // out.element_size() if q.stride(1) == 1 else 0
            args = (q, scales, out, m, k, bm, bk, q.stride(0), q.stride(1), scales.stride(0),
                    scales.stride(1), out.stride(0), n_kb)  # fmt: skip
            _launch(_dequant_kernel, scales.numel(), args, meta, self._autotune)
        return out
