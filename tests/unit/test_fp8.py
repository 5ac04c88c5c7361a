"""Blockwise FP8 quantisation: the torch reference/quantiser and the library's Triton quantiser,
interpreted on CPU.

The Triton checks run in a child process (this file as a script) with ``TRITON_INTERPRET=1`` so the
interpreter never reaches the pytest process.
"""

from __future__ import annotations

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


# ---- the library kernel's options ----------------------------------------------------------------------


def test_library_kernel_has_no_variant_switches() -> None:
    """The library keeps the one default kernel: no variant switches, no process-wide tuning flags."""
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


def _child(autotunes: list[bool]) -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.cuda.fp8 import TritonFp8Quantizer

    res = []
    for autotune in autotunes:
        tq = TritonFp8Quantizer(CpuDevice(), autotune=autotune)
        for i, (shape, block, dtype) in enumerate(_CASES):
            w = _weight(shape, block, dtype, seed=100 + i)
            if i == 1:
                w = w.T.contiguous().T  # non-contiguous input
            res.append({"autotune": autotune, "case": f"random{i}", **_compare(tq, w, block, strided=i == 1)})
        for j, (block, dtype) in enumerate(_ADVERSARIAL):
            w = _adversarial_weight(dtype, block, seed=j)
            res.append({"autotune": autotune, "case": f"adversarial{j}", **_compare(tq, w, block)})
    print(json.dumps(res))


def _run_child(autotunes: list[bool]) -> subprocess.Popen[str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([_SRC, env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, __file__, ",".join("1" if a else "0" for a in autotunes)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_triton_interpreted_is_bit_identical_to_torch() -> None:
    """The library's Triton quantiser, autotuned and not, bit for bit against torch on random and
    adversarial tiles (one child process for both: CI's lanes already keep its 2 cores busy, and a
    second child would import torch and triton again)."""
    proc = _run_child([True, False])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    results = json.loads(out.strip().splitlines()[-1])
    assert {r["autotune"] for r in results} == {True, False}
    assert sum(r["case"].startswith("adversarial") for r in results) == 2 * len(_ADVERSARIAL)
    for r in results:
        assert r["q"] and r["scales"] and r["deq"], r


if __name__ == "__main__":
    _child([a == "1" for a in sys.argv[1].split(",")])
