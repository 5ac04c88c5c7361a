"""The ``Fp8Quantizer`` contract, run against every registered quantiser whose probe passes on this host.

Blockwise e4m3: output dtypes and shapes, scales ``amax / 448`` per tile (1 for an all-zero tile), the
round trip within half an e4m3 step, every non-zero tile reaching 448, bit-identity with the plain-torch
reference :mod:`underlay.ops.quant` (the protocol promises bit-identical output from every backend),
strided input, partial edge tiles, and refusal of bad blocks, shapes and dtypes with ``InvalidInput``.

Quantisers whose probe fails are skips with the probe's reason. Without a GPU the ``triton`` quantiser
runs the contract through Triton's interpreter (``TRITON_INTERPRET=1``, small sizes) in a child process
(this file as a script). On a GPU host: ``UNDERLAY_DEVICE=cuda pytest tests/conformance``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.conformance._interpret import interpret_skip_reason, report_checks, run_interpreted
from underlay import registry
from underlay.interfaces import Fp8Quantizer, InvalidInput
from underlay.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

E4M3_MAX = 448.0


def _params() -> list[Any]:
    """One param per registered quantiser: runnable here, or skipped with the probe's reason."""
    device = registry.resolve("device").name
    out: list[Any] = []
    for spec in registry.backends("quant"):
        probe = registry.probe("quant", spec.name)
        if probe.available and spec.works_with(device):
            out.append(pytest.param(spec.name, id=spec.name))
        else:
            why = probe.reason or f"needs device {list(spec.devices)}, this host runs {device!r}"
            out.append(pytest.param(spec.name, id=spec.name, marks=pytest.mark.skip(reason=why)))
    registry.reset()
    return out


def _cases(dev: torch.device) -> list[tuple[tuple[int, int], tuple[int, int], torch.dtype]]:
    """(shape, block, dtype): partial edge tiles on both sides, non-square and non-power-of-two blocks."""
    cases = [
        ((200, 300), (128, 128), torch.bfloat16),
        ((37, 50), (16, 24), torch.float16),
        ((64, 96), (32, 32), torch.float32),
        ((1, 129), (128, 128), torch.bfloat16),
        ((70, 130), (32, 64), torch.bfloat16),
    ]
    if dev.type != "cpu":
        cases += [((4096, 2880), (128, 128), torch.bfloat16), ((1000, 3000), (128, 128), torch.float32)]
    return cases


def _weight(shape: tuple[int, int], block: tuple[int, int], dtype: torch.dtype, seed: str) -> torch.Tensor:
    """Random weight whose columns span seven decades (down into e4m3's subnormal range after scaling),
    one all-zero tile and negative zeros."""
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    w = torch.randn(shape, generator=gen, dtype=torch.float64) * torch.logspace(
        -5, 2, shape[1], dtype=torch.float64
    )
    w[: block[0], : block[1]] = 0
    w[-1, -3:] = -0.0
    return w.to(dtype)


def _expand(scales: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    return scales.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu()))


# ------------------------------------------------------------------------------------ the contract


def check_protocol(quant: Fp8Quantizer, name: str, dev: torch.device) -> None:
    """The quantiser satisfies the protocol and carries its registry name."""
    assert isinstance(quant, Fp8Quantizer), type(quant)
    assert quant.name == name


def check_shapes_and_scales(quant: Fp8Quantizer, name: str, dev: torch.device) -> None:
    """q is float8_e4m3fn ``[M, K]``; scales are float32 ``[ceil(M/bm), ceil(K/bk)]`` on the weight's
    device, equal to ``amax / 448`` of each tile (from a float64 view), 1 for the all-zero tile; every
    non-zero tile uses 448."""
    for shape, block, dtype in _cases(dev):
        w = _weight(shape, block, dtype, f"scales/{shape}").to(dev)
        q, s = quant.quantize(w, block)
        mb, kb = -(-shape[0] // block[0]), -(-shape[1] // block[1])
        assert q.dtype == torch.float8_e4m3fn and q.shape == shape and q.device == w.device
        assert s.dtype == torch.float32 and s.shape == (mb, kb) and s.device == w.device
        pad = torch.zeros(mb * block[0], kb * block[1], dtype=torch.float64)
        pad[: shape[0], : shape[1]] = w.cpu().double().abs()
        amax = pad.view(mb, block[0], kb, block[1]).amax(dim=(1, 3))
        expect = torch.where(amax == 0, 1.0, amax / E4M3_MAX)
        assert torch.allclose(s.cpu().double(), expect, rtol=2**-23, atol=0), (shape, block, dtype)
        assert s[0, 0].item() == 1.0
        qpad = torch.zeros_like(pad)
        qpad[: shape[0], : shape[1]] = q.cpu().double().abs()
        qmax = qpad.view(mb, block[0], kb, block[1]).amax(dim=(1, 3))
        assert bool((qmax[amax > 0] == E4M3_MAX).all()), (shape, block, dtype)


def check_round_trip_bound(quant: Fp8Quantizer, name: str, dev: torch.device) -> None:
    """``dequantize(quantize(w))`` is within half an e4m3 step of ``w``: ``2^-4 |w|`` for normal values,
    ``2^-10 scale`` in the subnormal range; dequantize returns the requested dtype."""
    for shape, block, dtype in _cases(dev):
        w = _weight(shape, block, dtype, f"roundtrip/{shape}").to(dev)
        q, s = quant.quantize(w, block)
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            back = quant.dequantize(q, s, block, out_dtype)
            assert back.dtype == out_dtype and back.shape == shape and back.device == w.device
        back64 = quant.dequantize(q, s, block, torch.float32).cpu().double()
        w64 = w.cpu().double()
        scale = _expand(s.cpu(), shape, block).double()
        bound = torch.maximum(w64.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 2**-20)
        worst = float(((back64 - w64).abs() - bound).max())
        assert worst <= 0, (shape, block, dtype, worst)


def check_bit_identical_to_reference(quant: Fp8Quantizer, name: str, dev: torch.device) -> None:
    """q bytes and scales equal the torch reference's bit for bit (including -0 for negative values that
    round to zero); dequantisation equals the reference's for every output dtype, from strided q too."""
    for shape, block, dtype in _cases(dev):
        w = _weight(shape, block, dtype, f"bits/{shape}").to(dev)
        q, s = quant.quantize(w, block)
        q_ref, s_ref = quantize_fp8_blockwise(w, block)
        assert _bytes_equal(q, q_ref) and torch.equal(s.cpu(), s_ref.cpu()), (shape, block, dtype)
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = dequantize_fp8_blockwise(q_ref, s_ref, block, out_dtype)
            assert torch.equal(quant.dequantize(q_ref, s_ref, block, out_dtype), want), (shape, out_dtype)
            q_t, s_t = q_ref.T.contiguous().T, s_ref.T.contiguous().T
            assert torch.equal(quant.dequantize(q_t, s_t, block, out_dtype), want), ("strided", shape)


def check_float64(quant: Fp8Quantizer, name: str, dev: torch.device) -> None:
    """An fp64 weight is refused; dequantising to fp64 either equals ``q * scale`` computed exactly in
    fp64 or is refused with ``InvalidInput``."""
    w = _weight((40, 72), (16, 32), torch.float32, "fp64").to(dev)
    try:
        quant.quantize(w.double(), (16, 32))
    except InvalidInput:
        pass
    else:
        raise AssertionError("quantize accepted a float64 weight")
    q, s = quantize_fp8_blockwise(w, (16, 32))
    try:
        out = quant.dequantize(q, s, (16, 32), torch.float64)
    except InvalidInput as exc:
        message = str(exc)
        if "float64" not in message and "fp64" not in message:
            raise AssertionError(f"the refusal does not name the dtype: {message}") from exc
        return
    exact = q.cpu().double() * _expand(s.cpu(), (40, 72), (16, 32)).double()
    assert out.dtype == torch.float64 and torch.equal(out.cpu(), exact)


def check_strided_input(quant: Fp8Quantizer, name: str, dev: torch.device) -> None:
    """A non-contiguous weight (transposed view, every other column) quantises like its contiguous copy."""
    w = _weight((96, 160), (32, 32), torch.bfloat16, "strided").to(dev)
    for view in (w.T.contiguous().T, torch.stack([w, -w], dim=2)[:, :, 0]):
        assert not view.is_contiguous() and torch.equal(view, w)
        q, s = quant.quantize(view, (32, 32))
        q2, s2 = quant.quantize(w.contiguous(), (32, 32))
        assert _bytes_equal(q, q2) and torch.equal(s, s2)


def check_refuses_bad_input(quant: Fp8Quantizer, name: str, dev: torch.device) -> None:
    """Bad blocks (zero, negative, one side, bools, floats), non-2-D or non-float weights and mismatched
    dequantisation arguments raise ``InvalidInput``."""
    w = torch.randn(16, 16).to(dev)
    bad_quant: list[tuple[torch.Tensor, Any]] = [
        (w, (0, 8)),
        (w, (8, -1)),
        (w, (8,)),
        (w, (8, 8, 8)),
        (w, (True, 8)),
        (w, (8.0, 8)),
        (w, 8),
        (w.view(4, 4, 16), (8, 8)),
        (w.double(), (8, 8)),
        (w.to(torch.int32), (8, 8)),
    ]
    for weight, block in bad_quant:
        try:
            quant.quantize(weight, block)
        except InvalidInput:
            continue
        raise AssertionError(f"quantize accepted weight {weight.dtype} {tuple(weight.shape)} block {block!r}")
    q, s = quantize_fp8_blockwise(w, (8, 8))
    bad_deq: list[tuple[torch.Tensor, torch.Tensor, Any, torch.dtype]] = [
        (q, s[:, :1], (8, 8), torch.bfloat16),
        (q, s.double(), (8, 8), torch.bfloat16),
        (q.float(), s, (8, 8), torch.bfloat16),
        (q, s, (8, 0), torch.bfloat16),
        (q, s, (4, 8), torch.bfloat16),
        (q, s, (8, 8), torch.int32),
    ]
    for qq, ss, block, dtype in bad_deq:
        try:
            quant.dequantize(qq, ss, block, dtype)
        except InvalidInput:
            continue
        raise AssertionError(
            f"dequantize accepted q {qq.dtype} scales {tuple(ss.shape)} block {block} {dtype}"
        )


def check_empty_weight(quant: Fp8Quantizer, name: str, dev: torch.device) -> None:
    """A weight with no rows gives empty q and a ``[0, ceil(K/bk)]`` scales tensor."""
    q, s = quant.quantize(torch.empty(0, 40, dtype=torch.bfloat16, device=dev), (16, 16))
    assert q.shape == (0, 40) and s.shape == (0, 3)


CHECKS: dict[str, Callable[[Fp8Quantizer, str, torch.device], None]] = {
    "protocol": check_protocol,
    "shapes_and_scales": check_shapes_and_scales,
    "round_trip_bound": check_round_trip_bound,
    "bit_identical_to_reference": check_bit_identical_to_reference,
    "strided_input": check_strided_input,
    "float64": check_float64,
    "refuses_bad_input": check_refuses_bad_input,
    "empty_weight": check_empty_weight,
}


# ------------------------------------------------------------------------------------ in process


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("name", _params())
def test_fp8_contract(name: str, check: str) -> None:
    quant = registry.get_quantizer(name)
    CHECKS[check](quant, name, registry.get_device().torch_device())


# ------------------------------------------------------------- the triton quantiser under the interpreter


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Every check on ``TritonFp8Quantizer`` over CPU tensors, in a ``TRITON_INTERPRET=1`` child."""
    return run_interpreted(__file__)


@pytest.mark.skipif(
    interpret_skip_reason("test_fp8_contract") is not None,
    reason=str(interpret_skip_reason("test_fp8_contract")),
)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_triton_contract_interpreted(interpreted: dict[str, str], check: str) -> None:
    assert interpreted[check] == "ok", interpreted[check]


def _child() -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.cuda.fp8 import TritonFp8Quantizer

    report_checks(CHECKS, TritonFp8Quantizer(CpuDevice()))


if __name__ == "__main__":
    _child()
