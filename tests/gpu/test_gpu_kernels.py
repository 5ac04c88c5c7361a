"""The triton LogprobKernel and Fp8Quantizer on a CUDA GPU, at small shapes, against float64 references.

Run on the GPU host: ``UNDERLAY_DEVICE=cuda pytest -q -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from underlay.interfaces import IGNORE_INDEX

pytestmark = pytest.mark.gpu


def _reference(
    h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, t: float
) -> tuple[torch.Tensor, torch.Tensor]:
    z = h.double() @ w.double().T / t
    logp = torch.log_softmax(z, -1)
    valid = y != IGNORE_INDEX
    lp = logp.gather(1, y.clamp(min=0)[:, None])[:, 0]
    return torch.where(valid, lp, 0.0), torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)


@pytest.mark.parametrize(
    ("dtype", "n", "h", "v", "strided"),
    [
        (torch.bfloat16, 300, 256, 5000, False),
        (torch.float16, 257, 200, 3001, False),
        (torch.float32, 129, 96, 2000, False),
        (torch.bfloat16, 211, 320, 4099, True),
    ],
)
@pytest.mark.parametrize(
    ("mode", "tma"), [("fused", "store"), ("fused", "load"), ("fused", "off"), ("hybrid", "store")]
)
def test_triton_logprobs_match_float64(
    dtype: torch.dtype, n: int, h: int, v: int, strided: bool, mode: str, tma: str
) -> None:
    from underlay import registry
    from underlay.backends.cuda.logprob import TritonLogprobKernel

    registry.get_logprob_kernel("triton")  # the registry can build it on this host
    kernel = TritonLogprobKernel(registry.get_device(), mode=mode, tma=tma)  # type: ignore[arg-type]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n)
    if strided:
        hidden = torch.randn(h, n, device=dev, generator=gen).to(dtype).T
        weight = (torch.randn(v, 2 * h, device=dev, generator=gen) / h**0.5).to(dtype)[:, ::2]
    else:
        hidden = torch.randn(n, h, device=dev, generator=gen).to(dtype)
        weight = (torch.randn(v, h, device=dev, generator=gen) * (2 / h**0.5)).to(dtype)
    labels = torch.randint(0, v, (n,), device=dev, generator=gen)
    labels[::7] = IGNORE_INDEX
    g_lp = torch.randn(n, device=dev, generator=gen)
    g_ent = torch.randn(n, device=dev, generator=gen)
    hh, ww = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    out = kernel(hh, ww, labels, temperature=0.8)
    assert out.entropy is not None and out.log_probs.dtype == torch.float32
    ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
    hd, wd = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    rlp, rent = _reference(hd, wd, labels, 0.8)
    ((rlp * g_lp.double()).sum() + (rent * g_ent.double()).sum()).backward()
    assert hh.grad is not None and ww.grad is not None and hd.grad is not None and wd.grad is not None
    torch.testing.assert_close(out.log_probs.double(), rlp, atol=1e-3, rtol=2e-4)
    torch.testing.assert_close(out.entropy.double(), rent, atol=5e-3, rtol=5e-4)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-8
    for got, ref in ((hh.grad, hd.grad), (ww.grad, wd.grad)):
        assert got.dtype == dtype
        assert float((got.double() - ref).norm() / ref.norm()) < tol
    assert (hh.grad[labels == IGNORE_INDEX] == 0).all()


@pytest.mark.parametrize("autotune", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("shape", "block"), [((1000, 3000), (128, 128)), ((300, 500), (64, 96))])
def test_fp8_triton_bit_identical_to_torch(
    dtype: torch.dtype, shape: tuple[int, int], block: tuple[int, int], autotune: bool
) -> None:
    from underlay.backends.cuda.device import CudaDevice
    from underlay.backends.cuda.fp8 import TritonFp8Quantizer
    from underlay.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

    dev = torch.device("cuda")
    w = torch.randn(shape, device=dev) * torch.logspace(-5, 2, shape[1], device=dev)
    w[: block[0], : block[1]] = 0
    w = w.to(dtype)
    from underlay.backends.cuda import fp8

    tuners = (fp8._quant_kernel, fp8._dequant_kernel)
    tuned = [dict(getattr(k, "cache", {})) for k in tuners]
    tq = TritonFp8Quantizer(CudaDevice(), autotune=autotune)
    q1, s1 = tq.quantize(w, block)
    q2, s2 = quantize_fp8_blockwise(w, block)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s1, s2) and s1[0, 0] == 1.0
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(
            tq.dequantize(q1, s1, block, out_dtype), dequantize_fp8_blockwise(q2, s2, block, out_dtype)
        )
    if not autotune:  # launched directly: the autotuners saw nothing new
        assert [dict(getattr(k, "cache", {})) for k in tuners] == tuned
