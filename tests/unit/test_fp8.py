"""Blockwise FP8 quantisation: the torch reference/quantiser, the library's Triton quantiser and the
benchmark's kernel variants (``benchmarks/gpu/fp8_variants.py``), interpreted on CPU.

The Triton checks run in a child process (this file as a script) with ``TRITON_INTERPRET=1`` so the
interpreter never reaches the pytest process. The reciprocal ("rcp") division of the variant kernels is
also checked in plain torch against IEEE division, with an exact emulation of fp32 fused multiply-add.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from underlay import registry
from underlay.interfaces import ConfigError, Fp8Quantizer, InvalidInput
from underlay.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

_SRC = str(Path(__file__).resolve().parents[2] / "src")
_VARIANTS = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "fp8_variants.py"


def _variants() -> Any:
    """The benchmark's variant module, loaded from its file (benchmarks/ is not a package)."""
    if "fp8_variants" in sys.modules:
        return sys.modules["fp8_variants"]
    spec = importlib.util.spec_from_file_location("fp8_variants", _VARIANTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fp8_variants"] = module
    spec.loader.exec_module(module)
    return module


_CASES = [
    ((200, 300), (128, 128), torch.bfloat16),
    ((37, 50), (16, 24), torch.float16),
    ((64, 64), (32, 32), torch.float32),
    ((1, 129), (128, 128), torch.bfloat16),
    ((70, 512), (32, 64), torch.bfloat16),  # 8 tiles along K: 2 and 4 tiles per program apply
]


def _weight(shape: tuple[int, int], block: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random weight whose tiles span many binades (values down to the e4m3 subnormal range), one zero tile."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * torch.logspace(-5, 2, shape[1])
    w[: block[0], : block[1]] = 0
    return w.to(dtype)


def _expand(scales: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    return scales.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


@pytest.mark.parametrize(("shape", "block", "dtype"), _CASES)
def test_round_trip_within_e4m3_bound(
    shape: tuple[int, int], block: tuple[int, int], dtype: torch.dtype
) -> None:
    w = _weight(shape, block, dtype, seed=shape[0])
    q, scales = quantize_fp8_blockwise(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scales.dtype == torch.float32
    assert scales.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    w64 = w.double()
    # scale is amax / 448 per tile, computed from a float64 view of the same tile
    pad = torch.zeros(scales.shape[0] * block[0], scales.shape[1] * block[1], dtype=torch.float64)
    pad[: shape[0], : shape[1]] = w64.abs()
    amax = pad.view(scales.shape[0], block[0], scales.shape[1], block[1]).amax(dim=(1, 3))
    expect = torch.where(amax == 0, 1.0, amax / 448.0)
    assert torch.allclose(scales.double(), expect, rtol=2**-23, atol=0)
    assert scales[0, 0] == 1.0  # the all-zero tile
    back = dequantize_fp8_blockwise(q, scales, block, torch.float32).double()
    s = _expand(scales, shape, block).double()
    # half an e4m3 step: 2^-4 relative for normals, 2^-10 * scale absolute in the subnormal range
    bound = torch.maximum(w64.abs() * 2.0**-4, s * 2.0**-10) * (1 + 2**-20)
    assert ((back - w64).abs() <= bound).all()
    assert (q.float().abs() <= 448).all()
    # each non-zero tile uses the top of the e4m3 range
    tiles = pad.view(scales.shape[0], block[0], scales.shape[1], block[1])
    nonzero = tiles.amax(dim=(1, 3)) > 0
    qpad = torch.zeros_like(pad)
    qpad[: shape[0], : shape[1]] = q.double().abs()
    qmax = qpad.view_as(tiles).amax(dim=(1, 3))
    assert (qmax[nonzero] == 448).all()


def test_dequantize_dtype_and_rounding() -> None:
    w = _weight((130, 70), (64, 32), torch.float32, seed=3)
    q, s = quantize_fp8_blockwise(w, (64, 32))
    exact = (q.double() * _expand(s, (130, 70), (64, 32)).double()).float()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = dequantize_fp8_blockwise(q, s, (64, 32), dtype)
        assert out.dtype == dtype
        assert torch.equal(out, exact.to(dtype))


def test_torch_quantizer_matches_ops() -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.portable.quant import TorchFp8Quantizer

    quant = TorchFp8Quantizer(CpuDevice())
    assert quant.name == "torch"
    assert isinstance(quant, Fp8Quantizer)
    w = _weight((90, 140), (32, 64), torch.bfloat16, seed=9)
    q, s = quant.quantize(w, (32, 64))
    q2, s2 = quantize_fp8_blockwise(w, (32, 64))
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert torch.equal(quant.dequantize(q, s, (32, 64)), dequantize_fp8_blockwise(q2, s2, (32, 64)))


def test_registry_gives_the_torch_quantizer_on_cpu() -> None:
    quant = registry.get_quantizer()
    assert quant.name == "torch"


def test_strided_input_equals_contiguous() -> None:
    w = _weight((96, 80), (32, 32), torch.bfloat16, seed=5)
    qt, st = quantize_fp8_blockwise(w.T.contiguous().T, (32, 32))
    q, s = quantize_fp8_blockwise(w, (32, 32))
    assert torch.equal(q.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(s, st)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.randn(4, 4, 4), (2, 2)), "2-D"),
        ((torch.randn(4, 4).double(), (2, 2)), "dtype"),
        ((torch.randn(4, 4), (0, 2)), "block"),
        ((torch.randn(4, 4), (2,)), "block"),
        ((torch.randn(4, 4), (True, 2)), "block"),
    ],
)
def test_quantize_rejects_bad_input(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        quantize_fp8_blockwise(*args)


def test_dequantize_rejects_bad_input() -> None:
    q, s = quantize_fp8_blockwise(torch.randn(10, 12), (4, 4))
    with pytest.raises(InvalidInput, match="scales must be float32 of shape"):
        dequantize_fp8_blockwise(q, s[:, :2], (4, 4))
    with pytest.raises(InvalidInput, match="float8_e4m3fn"):
        dequantize_fp8_blockwise(q.float(), s, (4, 4))
    with pytest.raises(InvalidInput, match="dtype"):
        dequantize_fp8_blockwise(q, s, (4, 4), torch.int32)


def test_triton_quantizer_refuses_cpu_tensors_without_interpreter() -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.cuda.fp8 import TritonFp8Quantizer

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter is on in this process")
    quant = TritonFp8Quantizer(CpuDevice())
    assert quant.name == "triton" and isinstance(quant, Fp8Quantizer)
    with pytest.raises(InvalidInput, match="UNDERLAY_QUANT=torch"):
        quant.quantize(torch.randn(8, 8))


# ---- the reciprocal division ("rcp" variants), emulated exactly in torch -------------------------------


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Exact fp32 fused multiply-add ``RN(a * b + c)`` for fp32 tensors.

    ``a * b`` is exact in fp64; ``s = RN64(a * b + c)`` with its exact error ``e`` (TwoSum). Rounding
    ``s`` to fp32 is then correct except when ``s`` is exactly halfway between two fp32 values and
    ``e != 0`` (double rounding): the tie is broken towards the sign of ``e``.
    """
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    e = (p - (s - bb)) + (cd - bb)
    f = s.float()
    fd = f.double()
    inf = torch.full_like(f, float("inf"))
    g = torch.where(s > fd, torch.nextafter(f, inf), torch.nextafter(f, -inf))
    tie = (s != fd) & (s == (fd + g.double()) * 0.5) & (e != 0)
    return torch.where(tie, torch.where(e > 0, torch.maximum(f, g), torch.minimum(f, g)), f)


def _rcp_divide(w: torch.Tensor, s: torch.Tensor, corrections: int) -> torch.Tensor:
    """The kernels' ``rcp`` quotient of fp32 ``w`` by fp32 ``s``: ``y = RN(1/s)``, ``q = RN(w*y)``,
    then ``corrections`` times ``q = RN(q + RN(w - q*s) * y)`` (1 for 16-bit inputs, 2 for fp32)."""
    y = torch.ones_like(s) / s
    q = w * y
    for _ in range(corrections):
        q = _fma32(_fma32(q, -s, w), y, q)
    return q


def _e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).view(torch.uint8)


def test_fma32_emulation_is_exact() -> None:
    from fractions import Fraction

    gen = torch.Generator().manual_seed(1)
    a = torch.randn(300, generator=gen)
    b = torch.randn(300, generator=gen)
    c = torch.randn(300, generator=gen) * torch.exp2(torch.randint(-40, 2, (300,), generator=gen).float())
    # exact fp32 midpoints as a*b, pushed either way by a tiny c (the double-rounding cases)
    a = torch.cat([a, torch.full((3,), 1 + 2**-12)])
    b = torch.cat([b, torch.full((3,), 1 + 2**-12)])
    c = torch.cat([c, torch.tensor([2.0**-80, -(2.0**-80), 0.0])])
    got = _fma32(a, b, c)
    for i in range(len(a)):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        f = torch.tensor([float(exact)], dtype=torch.float64).float()
        cands = [f, torch.nextafter(f, f - 1), torch.nextafter(f, f + 1)]
        best = min(cands, key=lambda t: (abs(Fraction(float(t)) - exact), int(t.view(torch.int32)) & 1))
        assert got[i].item() == best.item(), (i, float(a[i]), float(b[i]), float(c[i]))
    assert (got[-3:].double() - 1).mul(2**23).tolist() == [4097.0, 4096.0, 4096.0]


def test_rcp_division_equals_ieee_division_exhaustive_slice() -> None:
    # Scale invariance: with no underflow the steps scale exactly by powers of two, so significands in
    # [1, 2) cover every exponent. All 2^23 scale significands against a few bf16 significands here;
    # the full 2^7 (bf16) and 2^10 (fp16) sweeps were run once offline with no mismatch.
    s = (torch.arange(1 << 23, dtype=torch.int32) | (127 << 23)).view(torch.float32)
    for wv in (1.0 + 2**-7, 2.0 - 2**-7):
        w = torch.full_like(s, wv)
        x = _rcp_divide(w, s, 1)
        assert torch.equal(x.view(torch.int32), (w / s).view(torch.int32)), wv


def _quant_pairs(dtype: torch.dtype, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, scale)`` as the quantiser sees them: ``scale = RN(amax / 448)`` for a random amax in the
    input dtype over the kernels' reciprocal range, ``|w| <= amax``, w in the input dtype, with exact
    e4m3 midpoints (times the scale), the amax itself, signed zeros and tiny values mixed in."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-20, 15) if dtype == torch.float16 else (-70, 70)
    amax = (torch.rand(n, generator=gen) + 1) * torch.exp2(torch.randint(lo, hi, (n,), generator=gen).float())
    amax = amax.to(dtype).float()
    scale = amax / torch.full_like(amax, 448.0)
    w = (torch.rand(n, generator=gen) * 2 - 1) * amax
    grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2
    k = n // 8
    pick = torch.randint(0, len(mids), (k,), generator=gen)
    w[:k] = mids[pick] * scale[:k] * torch.where(torch.rand(k, generator=gen) < 0.5, -1.0, 1.0)
    w[k : 2 * k] = amax[k : 2 * k]  # the amax element itself -> exactly 448
    w[2 * k : 2 * k + 16] = -0.0
    w[2 * k + 16 : 3 * k] *= torch.exp2(-torch.randint(5, 30, (k - 16,), generator=gen).float())
    return w.to(dtype).float(), scale


@pytest.mark.parametrize(
    ("dtype", "corrections"), [(torch.bfloat16, 1), (torch.float16, 1), (torch.float32, 2)]
)
def test_rcp_division_equals_ieee_division_on_quantiser_inputs(dtype: torch.dtype, corrections: int) -> None:
    w, s = _quant_pairs(dtype, 1 << 20, seed=7)
    ref = w / s
    x = _rcp_divide(w, s, corrections)
    normal = ref.abs() >= 2.0**-126
    assert torch.equal(x[normal].view(torch.int32), ref[normal].view(torch.int32))
    # sign fix as in the kernels: the input's sign goes on every byte (Markstein turns -0 into +0)
    sign = ((w.view(torch.int32) >> 24) & 0x80).to(torch.uint8)
    assert torch.equal(_e4m3_bytes(x) | sign, _e4m3_bytes(ref))
    amax_pos = slice(len(w) // 8, 2 * len(w) // 8)
    assert (x[amax_pos].to(torch.float8_e4m3fn).float().abs() == 448).all()  # amax -> exactly 448


def test_rcp_division_fp32_significands_random() -> None:
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 1 << 23, (2, 1 << 21), generator=gen, dtype=torch.int32) | (127 << 23)
    w, s = bits[0].view(torch.float32), bits[1].view(torch.float32)
    ref = (w / s).view(torch.int32)
    assert torch.equal(_rcp_divide(w, s, 2).view(torch.int32), ref)
    assert torch.equal(_rcp_divide(w, s, 1).view(torch.int32), ref)  # one correction suffices here too


# ---- variants -------------------------------------------------------------------------------------------


def test_variant_names_and_errors() -> None:
    fp8 = _variants()
    assert fp8.DEFAULT_VARIANT in fp8.VARIANTS
    for name in fp8.VARIANTS:
        assert fp8.parse_variant(name).name == name
    v = fp8.parse_variant(" RCP-ptx-t4-mfast ")
    assert (v.div, v.cvt, v.tiles_per_program, v.k_fast) == ("rcp", "ptx", 4, False)
    for bad in ("", "rcp", "rcp-ptx", "rcp-hw-t1", "div-sw-t3", "div-sw-t1-kfast", "mul-sw-t1"):
        with pytest.raises(InvalidInput, match="FP8 kernel variant"):
            fp8.parse_variant(bad)
    with pytest.raises(InvalidInput, match="FP8 kernel variant"):
        fp8.VariantFp8Quantizer(None, variant="nope")
    assert fp8.VariantFp8Quantizer(None, variant="div-sw-t4").variant == "div-sw-t4"
    assert fp8.VariantFp8Quantizer(None).variant == "div-cast-t1"


def test_variant_tiles_per_program_and_launch_configurations() -> None:
    fp8 = _variants()
    assert [fp8._tiles_per_program(4, kb) for kb in (1, 2, 3, 4, 6, 7, 8, 64)] == [1, 2, 1, 4, 2, 1, 4, 4]
    assert fp8._tiles_per_program(2, 6) == 2 and fp8._tiles_per_program(1, 8) == 1
    old = fp8.AUTOTUNE
    try:
        fp8.AUTOTUNE = False
        assert [(c.num_warps, c.maxnreg) for c in fp8._prune(fp8._CONFIGS, {}, BM=128, BK=128)] == [(8, None)]
        fp8.AUTOTUNE = True
        fp8.FORCE_CONFIG = (4, None)
        assert [(c.num_warps, c.maxnreg) for c in fp8._prune(fp8._CONFIGS, {}, BM=128, BK=128)] == [(4, None)]
    finally:
        fp8.AUTOTUNE, fp8.FORCE_CONFIG = old, None


def test_library_kernel_has_no_variant_switches() -> None:
    """The library keeps the one default kernel; the variant zoo and its switches live in benchmarks/."""
    from underlay.backends.cuda import fp8

    for gone in ("VARIANTS", "FORCE_CONFIG", "AUTOTUNE", "parse_variant", "Fp8Variant"):
        assert not hasattr(fp8, gone), gone
    with pytest.raises(TypeError):
        fp8.TritonFp8Quantizer(None, variant="div-cast-t1")  # type: ignore[arg-type, call-arg]


def test_autotune_is_a_constructor_option() -> None:
    """``autotune`` is fixed per quantiser (default on); off, every tile launches the one configuration
    ``_untuned`` picks; on, the autotuner chooses among the fitting ones."""
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.cuda import fp8

    configs = fp8._CONFIGS
    assert fp8.TritonFp8Quantizer(CpuDevice()).autotune is True
    assert fp8.TritonFp8Quantizer(CpuDevice(), autotune=False).autotune is False
    with pytest.raises(ConfigError, match=r"TritonFp8Quantizer\(autotune=...\).*'0'"):
        fp8.TritonFp8Quantizer(CpuDevice(), autotune="0")  # type: ignore[arg-type]
    assert (lambda c: (c.num_warps, fp8._maxnreg(c)))(fp8._untuned(configs, BM=128, BK=128)) == (8, None)
    assert fp8._untuned(configs, BM=16, BK=16).num_warps == 2  # 256 elements: 4 each
    assert fp8._untuned(configs, BM=4, BK=8).num_warps == 1
    for bm, bk in ((128, 128), (64, 128), (16, 32), (8, 8)):
        fit = fp8._fitting(configs, bm, bk)
        assert fp8._untuned(configs, BM=bm, BK=bk) in fit
        for c in fit:
            assert c.num_warps * 32 * 4 <= max(bm * bk, 128)
    if os.environ.get("TRITON_INTERPRET") != "1":  # the autotuner's candidates: every fitting one
        assert sorted({c.num_warps for c in fp8._prune(configs, {}, BM=128, BK=128)}) == [4, 8, 16]


# ---- the Triton kernels under the interpreter (child process) ------------------------------------------


def _adversarial_weight(dtype: torch.dtype, block: tuple[int, int], seed: int) -> torch.Tensor:
    """Tiles that stress the rounding: exact e4m3 midpoints after division (ties to even), neighbours of
    midpoints, all-equal tiles, results in the e4m3 subnormal range and below it (tiny negatives -> -0),
    signed zeros, scales below/above the reciprocal range, all-ones significands, random magnitudes
    and an all-zero tile; the last row and column of tiles are partial."""
    bm, bk = block
    gen = torch.Generator().manual_seed(seed)
    tm, tk = 3, 4
    w = torch.zeros(tm * bm, tk * bk)
    grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2
    ibits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    tiny, huge = (2.0**-14, 6.0e4) if dtype == torch.float16 else (1e-30, 1e38)

    def sign(n: int) -> torch.Tensor:
        return torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)

    for i in range(tm):
        for j in range(tk):
            kind = i * tk + j
            t = w[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk]
            n = t.numel()
            s0 = 0.1875 * 2.0 ** (kind - 4)  # amax = 448 * s0 exactly; scale = s0 exactly
            if kind in (0, 1):  # exact midpoints; their neighbours one ulp (of the input dtype) away
                v = (mids[torch.randint(0, len(mids), (n,), generator=gen)] * s0).to(dtype)
                if kind == 1:
                    step = torch.randint(0, 2, (n,), generator=gen).to(ibits) * 2 - 1
                    v = (v.view(ibits) + step).view(dtype)
                t.copy_((v.float() * sign(n)).view_as(t))
                t[0, 0] = 448 * s0
            elif kind == 2:  # all equal
                t.fill_(-0.3)
            elif kind == 3:  # e4m3 subnormal range, its midpoints, below it; signed zeros
                sub = (torch.randint(0, 16, (n,), generator=gen).float() * 0.5 + 0.25) * 2.0**-9
                t.copy_(
                    (
                        sub * s0 * torch.exp2(-torch.randint(0, 4, (n,), generator=gen).float()) * sign(n)
                    ).view_as(t)
                )
                t[0, :4] = torch.tensor([448 * s0, -0.0, 0.0, -s0 * 2.0**-12])
            elif kind == 4:  # scale below the reciprocal range (fp16: as small as it gets)
                t.copy_(torch.randn(t.shape, generator=gen) * tiny)
            elif kind == 5:  # scale above it (finite in the input dtype)
                t.copy_((torch.rand(t.shape, generator=gen) * 2 - 1) * huge)
            elif kind == 6:  # amax with an all-ones significand
                t.copy_(torch.rand(t.shape, generator=gen) * sign(n).view_as(t) * 5)
                t[1, 1] = (2 - 2.0**-7) * 4 if dtype != torch.float32 else (2 - 2.0**-23) * 4
            elif kind == 7:  # a single non-zero value among negative zeros
                t.fill_(-0.0)
                t[bm // 2, bk // 3] = -2.5
            elif kind == 11:  # all zero
                t.zero_()
            else:  # random magnitudes
                t.copy_(
                    torch.randn(t.shape, generator=gen)
                    * torch.exp2(torch.randint(-20, 20, (1,), generator=gen))
                )
    return w[: -(bm // 3) or None, : -(bk // 5) or None].to(dtype)


def _compare(tq: Any, w: torch.Tensor, block: tuple[int, int], strided: bool = False) -> dict[str, bool]:
    q1, s1 = tq.quantize(w, block)
    q2, s2 = quantize_fp8_blockwise(w, block)
    qd, sd = (q2.T.contiguous().T, s2.T.contiguous().T) if strided else (q2, s2)
    deq = all(
        torch.equal(tq.dequantize(qd, sd, block, dt), dequantize_fp8_blockwise(q2, s2, block, dt))
        for dt in (torch.bfloat16, torch.float16, torch.float32)
    )
    return {
        "q": torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)),
        "scales": torch.equal(s1, s2),
        "deq": deq,
    }


_ADVERSARIAL = [((32, 32), torch.bfloat16), ((16, 24), torch.float16), ((32, 16), torch.float32)]


def _child(variants: list[str]) -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.cuda.fp8 import TritonFp8Quantizer

    res = []
    for name in variants:
        tq = (
            TritonFp8Quantizer(CpuDevice())
            if name == "library"
            else _variants().VariantFp8Quantizer(CpuDevice(), variant=name)
        )
        # cast/ptx run as sw under the interpreter: those variants get one case, the others all
        full = "-sw-" in name or name.endswith("-mfast") or name == "library"
        for i, (shape, block, dtype) in enumerate(_CASES if full else _CASES[1:2]):
            w = _weight(shape, block, dtype, seed=100 + i)
            if i == 1:
                w = w.T.contiguous().T  # non-contiguous input
            res.append({"variant": name, "case": f"random{i}", **_compare(tq, w, block, strided=i == 1)})
        if full:
            for j, (block, dtype) in enumerate(_ADVERSARIAL):
                w = _adversarial_weight(dtype, block, seed=j)
                res.append({"variant": name, "case": f"adversarial{j}", **_compare(tq, w, block)})
    print(json.dumps(res))


def _run_child(variants: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([_SRC, env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, __file__, ",".join(variants)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_triton_interpreted_is_bit_identical_to_torch() -> None:
    """Every benchmark variant, bit for bit against torch (the library kernel: the conformance suite)."""
    VARIANTS = _variants().VARIANTS

    # Under the interpreter the cast/ptx conversions run as the exact arithmetic (no inline PTX), so
    # every variant is runnable; two child processes split them (CI has 2 cores).
    halves = [list(VARIANTS[0::2]), list(VARIANTS[1::2])]  # each half has 4 of the "full" variants
    procs = [_run_child(h) for h in halves]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        results += json.loads(out.strip().splitlines()[-1])
    assert {r["variant"] for r in results} == set(VARIANTS)
    full = [v for v in VARIANTS if "-sw-" in v or v.endswith("-mfast")]
    assert len(full) == 8 and sum(r["case"].startswith("adversarial") for r in results) == 3 * len(full)
    for r in results:
        assert r["q"] and r["scales"] and r["deq"], r


if __name__ == "__main__":
    _child(sys.argv[1].split(","))
