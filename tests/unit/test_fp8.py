"""Blockwise FP8 quantisation: the torch reference/quantiser and the Triton quantiser (interpreted on CPU).

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
from underlay.interfaces import Fp8Quantizer, InvalidInput
from underlay.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

_SRC = str(Path(__file__).resolve().parents[2] / "src")
_CASES = [
    ((200, 300), (128, 128), torch.bfloat16),
    ((37, 50), (16, 24), torch.float16),
    ((64, 64), (32, 32), torch.float32),
    ((1, 129), (128, 128), torch.bfloat16),
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


def _child() -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.cuda.fp8 import TritonFp8Quantizer

    tq = TritonFp8Quantizer(CpuDevice())
    res = []
    for i, (shape, block, dtype) in enumerate(_CASES):
        w = _weight(shape, block, dtype, seed=100 + i)
        if i == 1:
            w = w.T.contiguous().T  # non-contiguous input
        q1, s1 = tq.quantize(w, block)
        q2, s2 = quantize_fp8_blockwise(w, block)
        same_deq = all(
            torch.equal(tq.dequantize(q1, s1, block, dt), dequantize_fp8_blockwise(q2, s2, block, dt))
            for dt in (torch.bfloat16, torch.float16, torch.float32)
        )
        res.append(
            {
                "case": i,
                "q": torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)),
                "scales": torch.equal(s1, s2),
                "deq": same_deq,
            }
        )
    print(json.dumps(res))


def test_triton_interpreted_is_bit_identical_to_torch() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([_SRC, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(_CASES)
    for r in results:
        assert r["q"] and r["scales"] and r["deq"], r


if __name__ == "__main__":
    _child()
