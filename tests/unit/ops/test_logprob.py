"""Log-probs and entropy against float64 references (forward and gradients)."""

from __future__ import annotations

import pytest
import torch

from underlay import registry
from underlay.interfaces import IGNORE_INDEX, InvalidInput, LogprobKernel
from underlay.ops import entropy_from_logits, linear_logprobs, logprobs_from_logits


def _reference(
    z: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log-prob of labels and entropy of softmax(z / T); ignored rows 0."""
    logp = torch.log_softmax(z.double() / temperature, dim=-1)
    keep = labels != IGNORE_INDEX
    lp = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(keep, lp, zero), torch.where(keep, ent, zero)


def _labels(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[torch.randperm(n, generator=gen)[: max(1, n // 5)]] = IGNORE_INDEX
    return labels


@pytest.mark.parametrize(("temperature", "chunk"), [(1.0, 7), (0.6, 64), (1.7, 1)])
def test_linear_logprobs_matches_float64(temperature: float, chunk: int) -> None:
    gen = torch.Generator().manual_seed(int(temperature * 10) + chunk)
    n, hid, vocab = 29, 12, 53
    h64 = torch.randn(n, hid, generator=gen, dtype=torch.float64)
    w64 = torch.randn(vocab, hid, generator=gen, dtype=torch.float64) * 0.7
    labels = _labels(n, vocab, gen)
    g_lp = torch.randn(n, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(n, generator=gen, dtype=torch.float64)

    hr, wr = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    lp_ref, ent_ref = _reference(hr @ wr.t(), labels, temperature)
    ((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum()).backward()

    h, w = h64.float().requires_grad_(), w64.float().requires_grad_()
    out = linear_logprobs(h, w, labels, temperature=temperature, chunk_size=chunk)
    assert out.log_probs.dtype == torch.float32 and out.entropy is not None
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_ent.float()).sum()).backward()

    torch.testing.assert_close(out.log_probs.double(), lp_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy.double(), ent_ref.detach(), rtol=1e-5, atol=1e-5)
    assert h.grad is not None and w.grad is not None and hr.grad is not None and wr.grad is not None
    torch.testing.assert_close(h.grad.double(), hr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-4, atol=1e-5)
    ignored = labels == IGNORE_INDEX
    assert torch.all(out.log_probs[ignored] == 0) and torch.all(out.entropy[ignored] == 0)
    assert torch.all(h.grad[ignored] == 0)


def test_linear_logprobs_without_entropy_and_strided_hidden() -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(16, 20, generator=gen)
    h = base[:, ::2].clone().requires_grad_()  # non-contiguous view below
    hv = h.t().contiguous().t()
    w = torch.randn(31, 10, generator=gen, requires_grad=True)
    labels = torch.randint(0, 31, (16,), generator=gen)
    out = linear_logprobs(hv, w, labels, with_entropy=False, chunk_size=5)
    assert out.entropy is None
    out.log_probs.sum().backward()
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp_ref, _ = _reference(hr @ wr.t(), labels, 1.0)
    lp_ref.sum().backward()
    torch.testing.assert_close(out.log_probs.double(), lp_ref.detach(), rtol=1e-5, atol=1e-5)
    assert h.grad is not None and hr.grad is not None
    torch.testing.assert_close(h.grad.double(), hr.grad, rtol=1e-4, atol=1e-5)


def test_linear_logprobs_bf16_is_fp32_math() -> None:
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(24, 16, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(40, 16, generator=gen) * 0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, 40, (24,), generator=gen)
    out = linear_logprobs(h, w, labels, chunk_size=8)
    assert out.log_probs.dtype == torch.float32
    (out.log_probs.sum() + out.entropy.sum()).backward()  # type: ignore[union-attr]
    assert h.grad is not None and h.grad.dtype == torch.bfloat16 and w.grad is not None
    # reference on the bf16 logits the matmul produces (what the lm_head would give)
    lp_ref, ent_ref = _reference((h.detach() @ w.detach().t()).double(), labels, 1.0)
    torch.testing.assert_close(out.log_probs.double(), lp_ref, rtol=1e-3, atol=2e-2)
    torch.testing.assert_close(out.entropy.double(), ent_ref, rtol=1e-3, atol=2e-2)  # type: ignore[union-attr]


def test_logprobs_and_entropy_from_logits_3d() -> None:
    gen = torch.Generator().manual_seed(11)
    z64 = torch.randn(3, 9, 37, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, 37, (3, 9), generator=gen)
    labels[0, :2] = IGNORE_INDEX
    g1 = torch.randn(3, 9, generator=gen, dtype=torch.float64)
    g2 = torch.randn(3, 9, generator=gen, dtype=torch.float64)
    zr = z64.clone().requires_grad_()
    lp_ref, _ = _reference(zr.reshape(-1, 37), labels.reshape(-1), 0.8)
    logp_all = torch.log_softmax(zr / 0.8, -1)
    ent_ref = -(logp_all.exp() * logp_all).sum(-1)  # entropy has no labels: every row counts
    ((lp_ref.view(3, 9) * g1).sum() + (ent_ref * g2).sum()).backward()

    z = z64.float().requires_grad_()
    lp = logprobs_from_logits(z, labels, 0.8, chunk_size=4)
    ent = entropy_from_logits(z, 0.8, chunk_size=5)
    assert lp.shape == (3, 9) and ent.shape == (3, 9)
    ((lp * g1.float()).sum() + (ent * g2.float()).sum()).backward()
    torch.testing.assert_close(lp.double(), lp_ref.view(3, 9).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref.detach(), rtol=1e-5, atol=1e-5)
    assert z.grad is not None and zr.grad is not None
    torch.testing.assert_close(z.grad.double(), zr.grad, rtol=1e-4, atol=1e-6)
    assert torch.all(lp[0, :2] == 0)


def test_logits_bf16_grad_dtype_and_auto_chunk() -> None:
    gen = torch.Generator().manual_seed(13)
    z = (torch.randn(10, 21, generator=gen) * 2).bfloat16().requires_grad_()
    labels = torch.randint(0, 21, (10,), generator=gen)
    lp = logprobs_from_logits(z, labels)
    lp.sum().backward()
    assert lp.dtype == torch.float32 and z.grad is not None and z.grad.dtype == torch.bfloat16
    lp_ref, _ = _reference(z.detach().double(), labels, 1.0)
    torch.testing.assert_close(lp.double(), lp_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"labels": torch.tensor([0, 1, 7, 2])}, "label 7"),
        ({"labels": torch.tensor([0, -5, 1, 2])}, "label -5"),
        ({"labels": torch.tensor([0.0, 1.0, 1.0, 2.0])}, "dtype"),
        ({"labels": torch.tensor([0, 1, 2])}, "tokens"),
        ({"weight": torch.randn(7, 5)}, "hidden size"),
        ({"weight": torch.randn(7, 4, dtype=torch.float64)}, "dtype"),
        ({"hidden": torch.randn(4, 4, 1)}, "2-d"),
    ],
)
def test_linear_logprobs_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "hidden": torch.randn(4, 4),
        "weight": torch.randn(7, 4),
        "labels": torch.tensor([0, 1, 2, 3]),
    }
    args.update(kwargs)
    with pytest.raises(InvalidInput, match=match):
        linear_logprobs(**args)  # type: ignore[arg-type]


def test_logits_validation() -> None:
    with pytest.raises(InvalidInput, match="labels shape"):
        logprobs_from_logits(torch.randn(3, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(InvalidInput, match="dtype"):
        entropy_from_logits(torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(InvalidInput, match="temperature"):
        entropy_from_logits(torch.randn(3, 5), temperature=-1.0)


def test_torch_kernel_from_registry() -> None:
    kernel = registry.get_logprob_kernel("torch")
    assert isinstance(kernel, LogprobKernel) and kernel.name == "torch"
    gen = torch.Generator().manual_seed(17)
    h, w = torch.randn(6, 8, generator=gen), torch.randn(11, 8, generator=gen)
    labels = torch.randint(0, 11, (6,), generator=gen)
    out = kernel(h, w, labels, temperature=0.9)
    lp_ref, ent_ref = _reference(h.double() @ w.double().t(), labels, 0.9)
    torch.testing.assert_close(out.log_probs.double(), lp_ref, rtol=1e-5, atol=1e-5)
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy.double(), ent_ref, rtol=1e-5, atol=1e-5)


def test_torch_kernel_chunking_choice() -> None:
    from underlay.backends.portable.logprob import TorchLogprobKernel

    device = registry.get_device("cpu")
    auto = TorchLogprobKernel(device)
    assert auto.chunk_for(torch.empty(152064, 8)) == (1 << 26) // 152064
    assert auto.chunk_for(torch.empty(10, 8)) == 16384
    fixed = TorchLogprobKernel(device, chunk_size=3)
    gen = torch.Generator().manual_seed(19)
    h, w = torch.randn(7, 4, generator=gen), torch.randn(9, 4, generator=gen)
    labels = torch.randint(0, 9, (7,), generator=gen)
    torch.testing.assert_close(fixed(h, w, labels).log_probs, auto(h, w, labels).log_probs)
    with pytest.raises(InvalidInput, match="chunk_size"):
        TorchLogprobKernel(device, chunk_size=0)


def test_nothing_of_size_n_by_v_is_saved_for_backward() -> None:
    """Between forward and backward only the inputs and per-token stats are kept (no [N, V] logits)."""
    gen = torch.Generator().manual_seed(23)
    n, hid, vocab = 64, 8, 97
    h = torch.randn(n, hid, generator=gen, requires_grad=True)
    w = torch.randn(vocab, hid, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = linear_logprobs(h, w, labels, chunk_size=16)
    assert saved and max(saved) <= max(h.numel(), w.numel()) < n * vocab
    (out.log_probs.sum() + out.entropy.sum()).backward()  # type: ignore[union-attr]
    assert h.grad is not None and w.grad is not None
