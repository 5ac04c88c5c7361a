"""Plain-torch ops take float64 and compute in float64: what a user checking gradients needs."""

from __future__ import annotations

import torch

from underlay.interfaces import IGNORE_INDEX
from underlay.ops.distributed import distributed_masked_mean, distributed_mean_max_min_std
from underlay.ops.logprob import entropy_from_logits, linear_logprobs, logprobs_from_logits
from underlay.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    weight = torch.randn(11, 5, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 11, (7,), generator=gen)
    labels[2] = IGNORE_INDEX
    return hidden, weight, labels


def test_linear_logprobs_float64_passes_gradcheck() -> None:
    hidden, weight, labels = _inputs(1)

    def f(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = linear_logprobs(h, w, labels, temperature=0.8, chunk_size=3)
        assert out.entropy is not None
        return out.log_probs, out.entropy

    assert torch.autograd.gradcheck(f, (hidden.requires_grad_(), weight.requires_grad_()))
    lp, ent = f(hidden.detach(), weight.detach())
    assert lp.dtype == torch.float64 and ent.dtype == torch.float64
    logp = torch.log_softmax(hidden.detach() @ weight.detach().T / 0.8, dim=-1)
    ref = torch.where(labels != IGNORE_INDEX, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    assert torch.allclose(lp, ref, atol=1e-13, rtol=0)


def test_logits_ops_float64_pass_gradcheck() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (2, 4), generator=gen)
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, labels, 1.3, chunk_size=3), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 0.7, chunk_size=5), (logits,))
    ent = entropy_from_logits(logits.detach())
    p = torch.softmax(logits.detach(), -1)
    assert ent.dtype == torch.float64 and torch.allclose(ent, -(p * p.log()).sum(-1), atol=1e-14, rtol=0)


def test_distributed_summaries_keep_float64() -> None:
    x = torch.tensor([1.0 + 2**-40, 1.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 0])
    mean = distributed_masked_mean(x, mask)
    assert mean.dtype == torch.float64 and mean.item() == (2.0 + 2**-40) / 2
    stats = distributed_mean_max_min_std(x)
    assert all(t.dtype == torch.float64 for t in stats)
    assert distributed_masked_mean(x.float(), mask).dtype == torch.float32


def test_fp8_dequantize_to_float64_is_exact() -> None:
    w = torch.randn(20, 30, dtype=torch.float32)
    q, s = quantize_fp8_blockwise(w, (8, 16))
    out = dequantize_fp8_blockwise(q, s, (8, 16), torch.float64)
    scale = s.repeat_interleave(8, 0)[:20].repeat_interleave(16, 1)[:, :30]
    assert out.dtype == torch.float64 and torch.equal(out, q.double() * scale.double())
