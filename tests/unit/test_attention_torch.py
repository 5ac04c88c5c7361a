"""``TorchAttention``: path selection (varlen_attn vs per-sequence SDPA), what it reports as unsupported,
and the SDPA paths against eager where masks are subtle (S_q != S_k, queries that see no key)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from underlay import registry
from underlay.backends.portable.attention import EagerAttention, TorchAttention
from underlay.interfaces import AttentionSpec, UnsupportedOperation


@pytest.fixture
def kernels() -> tuple[TorchAttention, EagerAttention]:
    dev = registry.get_device()
    return TorchAttention(dev), EagerAttention(dev)


def _spec(**kw: object) -> AttentionSpec:
    base: dict[str, object] = {
        "dtype": torch.bfloat16,
        "head_dim": 128,
        "num_heads": 32,
        "num_kv_heads": 8,
        "device_type": "cuda",
    }
    base.update(kw)
    return AttentionSpec(**base)  # type: ignore[arg-type]


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def test_varlen_path_choice() -> None:
    kernel = TorchAttention(registry.get_device())
    has_varlen = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    path, why = kernel.varlen_path(_spec())
    assert (path == "varlen_attn") == has_varlen and bool(why) != has_varlen
    for spec, reason in (
        (_spec(device_type="cpu"), "needs cuda"),
        (_spec(dtype=torch.float32), "bf16/fp16"),
        (_spec(head_dim=100), "head_dim % 8"),
        (_spec(head_dim_v=192), "Dv <= D"),
        (_spec(sinks=True), "no softcap or sinks"),
    ):
        path, why = kernel.varlen_path(spec)
        assert path == "sdpa_per_sequence" and any(reason in w for w in why), (spec, why)
    # latent attention (Dv < D) takes varlen_attn, V zero-padded (see the test below)
    assert kernel.varlen_path(_spec(head_dim_v=64))[0] == kernel.varlen_path(_spec())[0]


def test_supports_reports_softcap_and_device() -> None:
    kernel = TorchAttention(registry.get_device())
    assert kernel.supports(_spec()) == ()
    assert kernel.supports(_spec(device_type="cpu", dtype=torch.float64, window=(8, 0))) == ()
    assert any("softcap" in r for r in kernel.supports(_spec(softcap=30.0)))
    assert any("sinks" in r for r in kernel.supports(_spec(sinks=True)))
    assert any("npu" in r for r in kernel.supports(_spec(device_type="npu")))


def test_softcap_raises_unsupported(kernels: tuple[TorchAttention, EagerAttention]) -> None:
    torch_k, _ = kernels
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cu = _cu([5])
    with pytest.raises(UnsupportedOperation, match="softcap"):
        torch_k.varlen(q, k, v, cu, cu, 5, 5, softcap=10.0)
    with pytest.raises(UnsupportedOperation, match="softcap"):
        torch_k.padded(q[None], k[None], v[None], softcap=10.0)


@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, (2, 3)), (True, (4, 0))])
def test_padded_cross_lengths_match_eager(
    kernels: tuple[TorchAttention, EagerAttention], causal: bool, window: tuple[int, int] | None
) -> None:
    """S_q != S_k uses the bottom-right aligned mask, not SDPA's top-left ``is_causal``."""
    torch_k, eager = kernels
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 5, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 12, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 12, 2, 8, generator=gen, dtype=torch.float64)
    out = torch_k.padded(q, k, v, causal=causal, window=window, scale=0.4)
    ref = eager.padded(q, k, v, causal=causal, window=window, scale=0.4)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_padded_queries_without_keys_are_zero(kernels: tuple[TorchAttention, EagerAttention]) -> None:
    """Left padding + causal: padded queries see no key; both kernels give 0 there, and equal values
    elsewhere, with finite gradients."""
    torch_k, eager = kernels
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 7, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 7, 1, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 7, 1, 8, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    out = torch_k.padded(q, k, v, attention_mask=mask, causal=True)
    ref = eager.padded(q, k, v, attention_mask=mask, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert (out[0, :3] == 0).all()
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_varlen_cross_lengths_match_eager(kernels: tuple[TorchAttention, EagerAttention]) -> None:
    torch_k, eager = kernels
    gen = torch.Generator().manual_seed(9)
    lens_q, lens_k = [3, 1, 8], [6, 4, 8]
    q = torch.randn(12, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(18, 1, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(18, 1, 16, generator=gen, dtype=torch.float64)
    for causal in (True, False):
        args = (q, k, v, _cu(lens_q), _cu(lens_k), 8, 8)
        out = torch_k.varlen(*args, causal=causal)
        torch.testing.assert_close(out, eager.varlen(*args, causal=causal), rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
def test_cuda_bf16_uses_varlen_attn() -> None:
    """On the GPU host the packed bf16 path is torch's varlen_attn (flash), not the per-sequence loop."""
    kernel = TorchAttention(registry.get_device())
    path, why = kernel.varlen_path(_spec())
    assert path == "varlen_attn", why


def test_traceable_varlen_is_offered_only_for_the_varlen_attn_path() -> None:
    """The per-sequence SDPA path needs host lengths, so it has no in-graph form."""
    kernel = TorchAttention(registry.get_device("cpu"))
    assert kernel.traceable_varlen(_spec(device_type="cpu", dtype=torch.float32)) is None


@pytest.mark.gpu
def test_cuda_traceable_varlen_compiles_without_graph_breaks_and_matches_varlen() -> None:
    """``traceable_varlen`` runs inside one ``torch.compile(fullgraph=True)`` graph with dynamic token
    counts (new lengths: no recompilation) and gives the eager kernel's output and gradients."""
    dev = registry.get_device()
    kernel = TorchAttention(dev)
    spec = _spec(num_heads=12, num_kv_heads=2, requires_grad=True)
    fn = kernel.traceable_varlen(spec)
    assert fn is not None

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, m: int) -> torch.Tensor:
        return fn(q * 1.5, k, v, cu, m, True, None, None).sum(-1)

    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for lens in ([5, 300, 77], [1000, 24], [64, 64, 64, 9]):
        t = sum(lens)
        q = torch.randn(t, 12, 128, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        k = torch.randn(t, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        v = torch.randn(t, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        cu = _cu(lens).cuda()
        out = compiled(q, k, v, cu, max(lens))
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        ref = kernel.varlen(q * 1.5, k, v, cu, cu, max(lens), max(lens), causal=True).sum(-1)
        ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=2e-2, atol=5e-2)


def test_varlen_attn_call_zero_pads_a_smaller_value_head_dim() -> None:
    """Latent attention (Dv < D) through varlen_attn: v is zero-padded to D for the kernel and the output
    sliced back; output and gradients equal eager's. The flash kernel is stood in for by eager here
    (varlen_attn itself needs a GPU); the padding and slicing are what is checked."""
    from underlay.backends.portable.attention import EagerAttention, _call_varlen_attn
    from underlay.registry import get_device

    eager = EagerAttention(get_device("cpu"))
    seen: list[int] = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, **kw):  # type: ignore[no-untyped-def]
        seen.append(int(v.shape[-1]))
        return eager.varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, window=None, scale=kw["scale"])

    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(9, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 4, 12, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = _call_varlen_attn(stand_in, True, True, q, k, v, cu, cu, 5, 5, True, None, 0.3)
    want = eager.varlen(q, k, v, cu, cu, 5, 5, causal=True, scale=0.3)
    assert seen == [16] and out.shape == (9, 4, 12)
    torch.testing.assert_close(out, want)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), (q, k, v))
    ):
        torch.testing.assert_close(a, b)
