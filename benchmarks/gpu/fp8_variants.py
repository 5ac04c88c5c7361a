"""The FP8 kernel variants that ``bench_fp8.py`` measures: a benchmark's zoo, not library code.

The library keeps one kernel (``underlay.backends.cuda.fp8``: ``div-cast-t1``, the fastest variant that was
bit-identical to torch on the H200). This module holds every variant the benchmark compares against it,
named ``<div>-<cvt>-t<n>[-mfast]``, and reuses the library's tile addressing and exact rounding helpers:

* ``div``: ``div`` divides every element with IEEE ``div_rn``; ``rcp`` takes the reciprocal
  ``y = RN(1 / scale)`` once per tile and corrects ``q = RN(w * y)`` with fused multiply-adds
  (``x = RN(q + RN(w - q * scale) * y)``, Markstein's correction; twice for fp32 inputs), equal to
  IEEE division (see ``_quant_tile``). Tiles whose scale is outside ``[2^-80, 2^80]`` fall back to
  ``div_rn``.
* ``cvt``: ``sw`` rounds onto the e4m3 grid in exact fp32/integer arithmetic (then converts exactly);
  ``cast`` uses Triton's ``.to(float8e4nv, "rtne")`` (one ``cvt.rn.satfinite.e4m3x2.f32`` on sm_90;
  through fp16 on sm_89); ``ptx`` converts four elements per inline-PTX block with
  ``cvt.rn.satfinite.e4m3x2.f32`` and ORs the input's sign bits into the bytes in the same block.
  Every variant ORs the input's sign into each byte, so a negative value that rounds to zero gives -0
  as round-to-nearest-even (and torch) does. For dequantisation ``sw`` rounds fp32 -> bf16 with integer
  ops, ``cast`` uses the hardware conversions, ``ptx`` converts and scales four bytes per PTX block
  (bf16/fp16 outputs).
* ``t<n>``: tiles per program along K (1, 2 or 4; fewer when the number of K tiles is not a multiple);
  the next tile is loaded before the current one is processed.
* ``-mfast``: programs walk down M first; by default consecutive programs walk along K, so the tiles
  being processed at one time cover whole rows of the weight.

Under the interpreter ``cast`` and ``ptx`` run as ``sw`` (the interpreter cannot run inline PTX and its
fp8/bf16 casts are not round-to-nearest-even). Tiles of fewer than 128 elements use ``sw`` for ``ptx``.

Launch settings are this module's own switches, set by the benchmark: :data:`AUTOTUNE` (autotune the
warp count per shape; off: 8 warps) and :data:`FORCE_CONFIG` (one ``(num_warps, maxnreg)`` launched
without the autotuner, to compile every configuration ahead of a timed run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from underlay.backends.cuda.fp8 import _make_configs, _round_bf16, _round_e4m3, _tile_mask, _tile_ptrs
from underlay.interfaces import Device, InvalidInput
from underlay.ops.quant import E4M3_MAX, check_dequant_args, check_quant_args

__all__ = ["DEFAULT_VARIANT", "VARIANTS", "Fp8Variant", "VariantFp8Quantizer", "parse_variant"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

DEFAULT_VARIANT = "div-cast-t1"
"""The variant the library kernel (``underlay.backends.cuda.fp8``) implements."""

VARIANTS = (
    *(f"{d}-{c}-t{n}" for d in ("div", "rcp") for c in ("sw", "cast", "ptx") for n in (1, 2, 4)),
    "div-sw-t1-mfast",
    "rcp-ptx-t1-mfast",
)
"""Every variant the benchmark measures (``parse_variant`` accepts any combination of the fields)."""

AUTOTUNE = True
"""Autotune the launch configuration (4/8/16 warps, with or without a register cap) for each new shape
and variant. Read at each launch; the benchmark's correctness pass switches it off to save compilations;
off, the kernels launch with 8 warps."""

FORCE_CONFIG: tuple[int, int | None] | None = None
"""``(num_warps, maxnreg)`` of the one launch configuration to use (when it fits the
tile; launched without the autotuner), e.g. to compile every configuration ahead of a timed
autotuning run."""

_SW, _CAST, _PTX = 0, 1, 2
_CVT_CODES = {"sw": _SW, "cast": _CAST, "ptx": _PTX}
_PTX_MIN_ELEMS = 128  # one warp with 4 elements per thread: the inline PTX converts 4 at a time


@dataclass(frozen=True)
class Fp8Variant:
    """One kernel variant: see the module docstring for the meaning of each field."""

    div: str
    cvt: str
    tiles_per_program: int
    k_fast: bool

    @property
    def name(self) -> str:
        """Canonical name, e.g. ``"rcp-ptx-t2"``."""
        return f"{self.div}-{self.cvt}-t{self.tiles_per_program}" + ("" if self.k_fast else "-mfast")


def parse_variant(name: str) -> Fp8Variant:
    """The :class:`Fp8Variant` named ``<div>-<cvt>-t<n>[-mfast]`` with div in ``div``/``rcp``, cvt in
    ``sw``/``cast``/``ptx`` and n in 1/2/4. Raises ``InvalidInput`` for any other name."""
    parts = name.strip().lower().split("-")
    k_fast = True
    if len(parts) == 4 and parts[3] == "mfast":
        parts, k_fast = parts[:3], False
    if (
        len(parts) != 3
        or parts[0] not in ("div", "rcp")
        or parts[1] not in _CVT_CODES
        or parts[2] not in ("t1", "t2", "t4")
    ):
        raise InvalidInput(
            f"unknown FP8 kernel variant {name!r}; expected <div|rcp>-<sw|cast|ptx>-<t1|t2|t4>[-mfast], "
            f"e.g. {DEFAULT_VARIANT!r}"
        )
    return Fp8Variant(parts[0], parts[1], int(parts[2][1:]), k_fast)


_CONFIGS = _make_configs()


def _maxnreg(config: Any) -> int | None:
    return getattr(config, "maxnreg", None)


def _prune(configs: list[Any], nargs: dict[str, Any], **kwargs: Any) -> list[Any]:
    """Configurations that give every thread at least 4 elements of a tile (the inline PTX packs 4):
    those of 4..16 warps when the tile allows, else the widest that fits; one configuration (8 warps,
    no register cap, where it fits) under the interpreter or with ``AUTOTUNE`` off."""
    args = {**nargs, **kwargs}
    elems = int(args["BM"]) * int(args["BK"])
    fit = [c for c in configs if c.num_warps * 32 * 4 <= elems] or [configs[0]]
    big = [c for c in fit if c.num_warps >= 4]
    fit = big or [max(fit, key=lambda c: c.num_warps)]
    forced = [c for c in fit if FORCE_CONFIG is not None and (c.num_warps, _maxnreg(c)) == FORCE_CONFIG]
    if forced and not _INTERPRET:
        return forced[:1]
    if _INTERPRET or not AUTOTUNE:
        plain = [c for c in fit if _maxnreg(c) is None]
        pick = [c for c in plain if c.num_warps == 8] or plain[-1:] or fit[:1]
        return pick[:1]
    return fit


_KEY = ["M", "K", "bm", "bk", "DIV", "CVT", "TPK", "KFAST"]
_NO_SPECIALIZE = ["M", "K", "n_m", "n_kg"]  # only masks and program ids use them: fewer compilations


@triton.jit  # type: ignore[untyped-decorator]
def _program_tiles(n_m, n_kg, KFAST: tl.constexpr):  # type: ignore[no-untyped-def]
    """``(tile row, first tile column group)`` of this program; K-fastest or M-fastest order."""
    pid = tl.program_id(0)
    if KFAST:
        pid_m = pid // n_kg
        pid_g = pid % n_kg
    else:
        pid_m = pid % n_m
        pid_g = pid // n_m
    return pid_m, pid_g


@triton.jit
def _e4m3_bytes_ptx(x, w):  # type: ignore[no-untyped-def]
    """e4m3 bytes (uint8) of fp32 ``x`` by ``cvt.rn.satfinite.e4m3x2.f32``, with the sign bit of the
    input ``w`` (same shape; bf16/fp16/fp32) ORed into every byte. Four elements per PTX block.

    In ``cvt...e4m3x2.f32 d, a, b`` ``a`` goes to the upper byte of ``d`` and ``b`` to the lower one; a
    packed register holds element 0 in its lowest byte (or lowest half for 16-bit inputs).
    """
    if w.dtype.primitive_bitwidth == 16:
        out = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b16 lo, hi;
            .reg .b32 v, sg;
            cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
            cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
            mov.b32 v, {lo, hi};
            prmt.b32 sg, $5, $6, 0x7531;
            and.b32 sg, sg, 0x80808080;
            or.b32 $0, v, sg;
            }
            """,
            constraints="=r,f,f,f,f,r,r",
            args=[x, w.to(tl.int16, bitcast=True)],
            dtype=tl.uint8,
            is_pure=True,
            pack=4,
        )
    else:
        out = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b16 lo, hi;
            .reg .b32 v, s01, s23, sg;
            cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
            cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
            mov.b32 v, {lo, hi};
            prmt.b32 s01, $5, $6, 0x0073;
            prmt.b32 s23, $7, $8, 0x0073;
            prmt.b32 sg, s01, s23, 0x5410;
            and.b32 sg, sg, 0x80808080;
            or.b32 $0, v, sg;
            }
            """,
            constraints="=r,f,f,f,f,r,r,r,r",
            args=[x, w.to(tl.int32, bitcast=True)],
            dtype=tl.uint8,
            is_pure=True,
            pack=4,
        )
    return out


@triton.jit  # type: ignore[untyped-decorator]
def _store_e4m3(  # type: ignore[no-untyped-def]
    x, w_raw, q_ptrs, mask, CVT: tl.constexpr, MASKED: tl.constexpr
):
    """Round fp32 ``x`` to e4m3 (``CVT``: 0 exact arithmetic, 1 Triton cast, 2 inline PTX), OR the sign
    bit of the input ``w_raw`` into every byte and store the bytes at ``q_ptrs``."""
    if CVT == 2:
        qb = _e4m3_bytes_ptx(x, w_raw)
    else:
        if CVT == 0:
            x = _round_e4m3(x)
        qb = x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        # The sign bit of the input goes on every byte: values that round to zero must give -0 for
        # negative inputs, as round-to-nearest-even (and torch) does; a no-op elsewhere.
        sign = ((w_raw.to(tl.float32).to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
        qb = qb | sign
    q8 = qb.to(tl.float8e4nv, bitcast=True)
    if MASKED:
        tl.store(q_ptrs, q8, mask=mask)
    else:
        tl.store(q_ptrs, q8)


@triton.jit  # type: ignore[untyped-decorator]
def _quant_tile(  # type: ignore[no-untyped-def]
    w_raw,
    w_ptrs,
    q_ptrs,
    s_ptr_tile,
    mask,
    DIV: tl.constexpr,
    CVT: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Quantise one loaded tile ``w_raw`` (input dtype, read from ``w_ptrs``); store bytes and scale.

    ``DIV`` = 0: ``x = div_rn(w, scale)`` per element. ``DIV`` = 1: ``y = RN(1 / scale)`` once, then
    ``q = RN(w * y)`` and one fma correction ``x = RN(q + RN(w - q * scale) * y)``, which equals
    ``RN(w / scale)`` for every pair of bf16 or fp16 significands and fp32 scale (an exhaustive sweep,
    run once; tests/unit/test_fp8.py checks a slice of it and random quantiser inputs); fp32 inputs get
    a second correction (Markstein's theorem: ``y`` correctly rounded and a quotient within one ulp
    give the correctly rounded quotient after one correction). Tiles whose
    scale is outside ``[2^-80, 2^80]`` (where underflow could break this) re-read their values and use
    ``div_rn``. Each branch converts and stores its own result, so no tile-sized fp32 value stays live
    across the branch.
    """
    amax = tl.max(tl.max(tl.abs(w_raw), 1), 0).to(tl.float32)
    scale = tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, 448.0))
    tl.store(s_ptr_tile, scale)
    if DIV == 1:
        if (scale >= 8.271806125530277e-25) & (scale <= 1.2089258196146292e24):  # 2^-80 .. 2^80
            y = tl.math.div_rn(scale * 0.0 + 1.0, scale)
            w = w_raw.to(tl.float32)
            q = w * y
            x = tl.fma(tl.fma(q, -scale, w), y, q)  # q + (w - q * scale) * y
            if w_raw.dtype == tl.float32:
                # 24-bit inputs: q above can be more than an ulp off (then the remainder is rounded);
                # after one correction x is within an ulp, so a second one is Markstein's exact case.
                x = tl.fma(tl.fma(x, -scale, w), y, x)
            _store_e4m3(x, w_raw, q_ptrs, mask, CVT, MASKED)
        else:
            if MASKED:
                w_again = tl.load(w_ptrs, mask=mask, other=0.0)
            else:
                w_again = tl.load(w_ptrs)
            x = tl.math.div_rn(w_again.to(tl.float32), scale)
            _store_e4m3(x, w_again, q_ptrs, mask, CVT, MASKED)
    else:
        x = tl.math.div_rn(w_raw.to(tl.float32), scale)
        _store_e4m3(x, w_raw, q_ptrs, mask, CVT, MASKED)


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
    n_m,
    n_kg,
    BM: tl.constexpr,
    BK: tl.constexpr,
    PAD_M: tl.constexpr,
    EDGE_M: tl.constexpr,
    PAD_K: tl.constexpr,
    EDGE_K: tl.constexpr,
    OFF64: tl.constexpr,
    DIV: tl.constexpr,
    CVT: tl.constexpr,
    TPK: tl.constexpr,
    KFAST: tl.constexpr,
    MASKED: tl.constexpr,
):
    pid_m, pid_g = _program_tiles(n_m, n_kg, KFAST)
    kt0 = pid_g * TPK
    w_ptrs = _tile_ptrs(w_ptr, pid_m, kt0, bm, bk, stride_wm, stride_wk, BM, BK, OFF64)
    mask = _tile_mask(pid_m, kt0, M, K, bm, bk, BM, BK, PAD_M, EDGE_M, PAD_K, EDGE_K)
    if MASKED:
        w_cur = tl.load(w_ptrs, mask=mask, other=0.0)
    else:
        w_cur = tl.load(w_ptrs)
    for t in tl.static_range(TPK):
        kt = kt0 + t
        if t + 1 < TPK:  # prefetch the next tile before working on this one
            nxt_ptrs = _tile_ptrs(w_ptr, pid_m, kt + 1, bm, bk, stride_wm, stride_wk, BM, BK, OFF64)
            nxt_mask = _tile_mask(pid_m, kt + 1, M, K, bm, bk, BM, BK, PAD_M, EDGE_M, PAD_K, EDGE_K)
            if MASKED:
                w_nxt = tl.load(nxt_ptrs, mask=nxt_mask, other=0.0)
            else:
                w_nxt = tl.load(nxt_ptrs)
        q_ptrs = _tile_ptrs(q_ptr, pid_m, kt, bm, bk, stride_qm, 1, BM, BK, OFF64)
        _quant_tile(w_cur, w_ptrs, q_ptrs, s_ptr + pid_m * stride_sm + kt, mask, DIV, CVT, MASKED)
        if t + 1 < TPK:
            w_cur = w_nxt
            w_ptrs = nxt_ptrs
            mask = nxt_mask


@triton.jit  # type: ignore[untyped-decorator]
def _dequant_values(q, scale, out_ty: tl.constexpr, CVT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``q * scale`` (fp8 tile, fp32 scalar) in fp32, rounded once to ``out_ty``."""
    if CVT == 2 and out_ty == tl.bfloat16:
        out = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b16 q01, q23, a0, a1, a2, a3;
            .reg .b32 h01, h23;
            .reg .f32 f0, f1, f2, f3;
            mov.b32 {q01, q23}, $2;
            cvt.rn.f16x2.e4m3x2 h01, q01;
            cvt.rn.f16x2.e4m3x2 h23, q23;
            mov.b32 {a0, a1}, h01;
            mov.b32 {a2, a3}, h23;
            cvt.f32.f16 f0, a0;
            cvt.f32.f16 f1, a1;
            cvt.f32.f16 f2, a2;
            cvt.f32.f16 f3, a3;
            mul.rn.f32 f0, f0, $3;
            mul.rn.f32 f1, f1, $4;
            mul.rn.f32 f2, f2, $5;
            mul.rn.f32 f3, f3, $6;
            cvt.rn.bf16x2.f32 $0, f1, f0;
            cvt.rn.bf16x2.f32 $1, f3, f2;
            }
            """,
            constraints="=r,=r,r,f,f,f,f",
            args=[q.to(tl.uint8, bitcast=True), tl.zeros(q.shape, tl.float32) + scale],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )
    elif CVT == 2 and out_ty == tl.float16:
        out = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b16 q01, q23, a0, a1, a2, a3;
            .reg .b32 h01, h23;
            .reg .f32 f0, f1, f2, f3;
            mov.b32 {q01, q23}, $2;
            cvt.rn.f16x2.e4m3x2 h01, q01;
            cvt.rn.f16x2.e4m3x2 h23, q23;
            mov.b32 {a0, a1}, h01;
            mov.b32 {a2, a3}, h23;
            cvt.f32.f16 f0, a0;
            cvt.f32.f16 f1, a1;
            cvt.f32.f16 f2, a2;
            cvt.f32.f16 f3, a3;
            mul.rn.f32 f0, f0, $3;
            mul.rn.f32 f1, f1, $4;
            mul.rn.f32 f2, f2, $5;
            mul.rn.f32 f3, f3, $6;
            cvt.rn.f16x2.f32 $0, f1, f0;
            cvt.rn.f16x2.f32 $1, f3, f2;
            }
            """,
            constraints="=r,=r,r,f,f,f,f",
            args=[q.to(tl.uint8, bitcast=True), tl.zeros(q.shape, tl.float32) + scale],
            dtype=tl.float16,
            is_pure=True,
            pack=4,
        )
    else:
        out = q.to(tl.float32) * scale
        if CVT == 0 and out_ty == tl.bfloat16:
            out = _round_bf16(out)
        out = out.to(out_ty, fp_downcast_rounding="rtne")
    return out


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
    n_m,
    n_kg,
    BM: tl.constexpr,
    BK: tl.constexpr,
    PAD_M: tl.constexpr,
    EDGE_M: tl.constexpr,
    PAD_K: tl.constexpr,
    EDGE_K: tl.constexpr,
    OFF64: tl.constexpr,
    DIV: tl.constexpr,
    CVT: tl.constexpr,
    TPK: tl.constexpr,
    KFAST: tl.constexpr,
    MASKED: tl.constexpr,
    VEC: tl.constexpr,
):
    pid_m, pid_g = _program_tiles(n_m, n_kg, KFAST)
    kt0 = pid_g * TPK
    q_ptrs = _tile_ptrs(q_ptr, pid_m, kt0, bm, bk, stride_qm, stride_qk, BM, BK, OFF64, VEC)
    mask = _tile_mask(pid_m, kt0, M, K, bm, bk, BM, BK, PAD_M, EDGE_M, PAD_K, EDGE_K)
    s_row = s_ptr + pid_m * stride_sm
    scale = tl.load(s_row + kt0 * stride_sk)
    if MASKED:
        q_cur = tl.load(q_ptrs, mask=mask, other=0.0)
    else:
        q_cur = tl.load(q_ptrs)
    for t in tl.static_range(TPK):
        kt = kt0 + t
        if t + 1 < TPK:  # prefetch the next tile before working on this one
            nxt_ptrs = _tile_ptrs(q_ptr, pid_m, kt + 1, bm, bk, stride_qm, stride_qk, BM, BK, OFF64, VEC)
            nxt_mask = _tile_mask(pid_m, kt + 1, M, K, bm, bk, BM, BK, PAD_M, EDGE_M, PAD_K, EDGE_K)
            s_nxt = tl.load(s_row + (kt + 1) * stride_sk)
            if MASKED:
                q_nxt = tl.load(nxt_ptrs, mask=nxt_mask, other=0.0)
            else:
                q_nxt = tl.load(nxt_ptrs)
        out = _dequant_values(q_cur, scale, o_ptr.dtype.element_ty, CVT)
        o_ptrs = _tile_ptrs(o_ptr, pid_m, kt, bm, bk, stride_om, 1, BM, BK, OFF64)
        if MASKED:
            tl.store(o_ptrs, out, mask=mask)
        else:
            tl.store(o_ptrs, out)
        if t + 1 < TPK:
            q_cur = q_nxt
            scale = s_nxt
            mask = nxt_mask


def _launch(kernel: Any, grid: int, args: tuple[Any, ...], meta: dict[str, Any]) -> None:
    """Launch an autotuned kernel: through its autotuner when ``AUTOTUNE`` (and no ``FORCE_CONFIG``),
    else directly with the one configuration ``_prune`` picks (no autotuner bookkeeping at all)."""
    if AUTOTUNE and FORCE_CONFIG is None and not _INTERPRET:
        kernel[(grid,)](*args, **meta)
        return
    cfg = _prune(_CONFIGS, {}, **meta)[0]
    opts: dict[str, Any] = {"num_warps": cfg.num_warps}
    if _maxnreg(cfg) is not None:
        opts["maxnreg"] = _maxnreg(cfg)
    kernel.fn[(grid,)](*args, **meta, **opts)


def _tiles_per_program(want: int, kb: int) -> int:
    """The largest of ``want``, ``want / 2``, ..., 1 that divides ``kb`` (no program runs past the end)."""
    n = want
    while n > 1 and kb % n:
        n //= 2
    return n


class VariantFp8Quantizer:
    """``Fp8Quantizer`` through Triton in one kernel variant; one program per 1, 2 or 4 ``(bm, bk)`` tiles.

    ``variant`` (a name from :data:`VARIANTS`, see the module docstring; default
    :data:`DEFAULT_VARIANT`) fixes the kernel variant. Raises
    ``InvalidInput`` for an unknown variant name. Tiles larger than 128 x 256 elements (after rounding
    each side up to a power of two) are refused (``InvalidInput``) because one program holds a whole
    tile; use the ``torch`` quantiser for those.
    """

    _MAX_TILE = 128 * 256

    def __init__(self, device: Device, variant: str = DEFAULT_VARIANT) -> None:
        self._device = device
        self._variant = parse_variant(variant)
        if E4M3_MAX != 448.0:  # the kernel hard-codes the e4m3 maximum
            raise AssertionError("E4M3_MAX changed; update _quant_kernel")

    @property
    def name(self) -> str:
        """Registry name ``"triton"``."""
        return "triton"

    @property
    def variant(self) -> str:
        """Name of this quantiser's kernel variant."""
        return self._variant.name

    def _current(self) -> Fp8Variant:
        return self._variant

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

    def _launch_args(
        self, shape: tuple[int, int], block: tuple[int, int], big: tuple[int, int], strides: list[int]
    ) -> tuple[tuple[int, int, int], dict[str, Any]]:
        """``((n_m, n_kg, programs), constexprs)`` for a ``shape`` matrix in ``block`` tiles padded to
        ``big``; ``strides`` are the (row, column) strides of every tensor the kernel addresses."""
        (m, k), (bm, bk), (big_m, big_k) = shape, block, big
        v = self._current()
        n_m, kb = -(-m // bm), -(-k // bk)
        tpk = _tiles_per_program(v.tiles_per_program, kb)
        cvt = _CVT_CODES[v.cvt]
        if _INTERPRET or (cvt == _PTX and big_m * big_k < _PTX_MIN_ELEMS):
            cvt = _SW
        off64 = max(
            strides[i] * (big_m - 1) + strides[i + 1] * (big_k - 1) for i in range(0, len(strides), 2)
        )
        meta = {
            "BM": big_m,
            "BK": big_k,
            "PAD_M": bm != big_m,
            "EDGE_M": m % bm != 0,
            "PAD_K": bk != big_k,
            "EDGE_K": k % bk != 0,
            "OFF64": off64 >= 2**31,
            "DIV": 1 if v.div == "rcp" else 0,
            "CVT": cvt,
            "TPK": tpk,
            "KFAST": v.k_fast,
        }
        meta["MASKED"] = bool(meta["PAD_M"] or meta["EDGE_M"] or meta["PAD_K"] or meta["EDGE_K"])
        return (n_m, kb // tpk, n_m * (kb // tpk)), meta

    def quantize(
        self, weight: torch.Tensor, block: tuple[int, int] = (128, 128)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [M, K] float8_e4m3fn, scales [ceil(M/bm), ceil(K/bk)] float32)`` for ``weight [M, K]``
        (bf16/fp16/fp32, any strides); ``scale = amax / 448`` per tile (1 if all zero). Raises
        ``InvalidInput`` for a non-2-D weight, a bad dtype or block, a non-CUDA tensor."""
        bm, bk = check_quant_args(weight, block)
        big = self._tile((bm, bk), weight)
        m, k = weight.shape
        q = torch.empty((m, k), device=weight.device, dtype=torch.float8_e4m3fn)
        scales = torch.empty((-(-m // bm), -(-k // bk)), device=weight.device, dtype=torch.float32)
        if q.numel():
            strides = [abs(weight.stride(0)), abs(weight.stride(1)), k, 1]
            (n_m, n_kg, grid), meta = self._launch_args((m, k), (bm, bk), big, strides)
            args = (weight, q, scales, m, k, bm, bk, weight.stride(0), weight.stride(1), q.stride(0),
                    scales.stride(0), n_m, n_kg)  # fmt: skip
            _launch(_quant_kernel, grid, args, meta)
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
        if dtype == torch.float64:
            raise InvalidInput("the variant kernels dequantise to bf16, fp16 or fp32")
        big = self._tile((bm, bk), q)
        m, k = q.shape
        out = torch.empty((m, k), device=q.device, dtype=dtype)
        if out.numel():
            strides = [abs(q.stride(0)), abs(q.stride(1)), k, 1]
            (n_m, n_kg, grid), meta = self._launch_args((m, k), (bm, bk), big, strides)
            # q bytes per thread = output elements per 16-byte store (a contiguity hint: only where the
            # q rows are contiguous, i.e. stride 1 along K, which Triton then specialises on)
            meta["VEC"] = 16 // out.element_size() if q.stride(1) == 1 else 0
            meta["DIV"] = 0  # dequantisation does not divide: one compilation for div-* and rcp-*
            args = (q, scales, out, m, k, bm, bk, q.stride(0), q.stride(1), scales.stride(0),
                    scales.stride(1), out.stride(0), n_m, n_kg)  # fmt: skip
            _launch(_dequant_kernel, grid, args, meta)
        return out
