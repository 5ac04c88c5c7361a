"""The ``AttentionKernel`` contract, checked on every attention kernel available on this host against the
``eager`` reference (itself checked against a dense reference in ``tests/unit/test_attention_eager.py``).

Fresh random packed batches of mixed lengths (cpu: 1..200 tokens, ~600 in all; cuda: 1..2048, ~12k),
GQA/MQA, causal and bidirectional, sliding windows; output and gradients of q, k and v, in float64
where the kernel allows it and in bf16 (the accelerator path) where it supports that.
On a GPU host: ``UNDERLAY_DEVICE=cuda pytest tests/conformance`` runs the cuda kernels.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from underlay import registry
from underlay.backends.portable.attention import EagerAttention
from underlay.interfaces import AttentionKernel, AttentionSpec, BackendUnavailable
from underlay.ops.attention import attention_spec


def _available_kernels() -> list[str]:
    device = registry.resolve("device").name
    names = [
        s.name
        for s in registry.backends("attention")
        if registry.probe("attention", s.name).available and s.works_with(device)
    ]
    registry.reset()
    # eager is the oracle; fa4 last: its first call routes torch's flash ops to FA4 for the whole
    # process, so the torch kernel's cases run before that
    return sorted((n for n in names if n != "eager"), key=lambda n: n == "fa4")


KERNELS = _available_kernels()
DTYPES = [torch.float64, torch.bfloat16]
# Per dtype: (max |err| / max |ref|, ||err|| / ||ref||) for outputs and gradients.
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-10),
    torch.float32: (2e-4, 1e-4),
    torch.bfloat16: (4e-2, 2e-2),
    torch.float16: (1e-2, 5e-3),
}


@dataclass(frozen=True)
class Case:
    """One attention configuration of the conformance grid."""

    id: str
    causal: bool
    window: tuple[int, int] | None
    heads: int
    kv_heads: int
    softcap: float | None = None
    dv: int | None = None  # value head dim when it differs from the q/k one (64)


CASES = [
    Case("causal-gqa", True, None, 4, 2),
    Case("bidirectional-mqa", False, None, 4, 1),
    Case("causal-window", True, (48, 0), 4, 2),
    Case("bidirectional-window", False, (24, 12), 2, 2),
    Case("causal-mha", True, None, 2, 2),
    Case("causal-softcap", True, None, 4, 2, softcap=5.0),  # only kernels with a softcap (flash-attn >= 2.6)
    Case("causal-mla-dv48", True, None, 4, 4, dv=48),  # latent attention: Dv < D (DeepSeek-V3)
]


def _device() -> torch.device:
    return registry.get_device().torch_device()


def _lengths(gen: torch.Generator, device: torch.device) -> list[int]:
    """Mixed lengths including both extremes (1 and the maximum)."""
    longest, total = (2048, 12_000) if device.type != "cpu" else (200, 600)
    lens = [1, longest]
    while sum(lens) < total:
        lens.append(int(torch.randint(1, longest + 1, (1,), generator=gen)))
    perm = torch.randperm(len(lens), generator=gen).tolist()
    return [lens[i] for i in perm]


def _close(name: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    g, r = got.double(), ref.double()
    assert torch.isfinite(g).all(), f"{name}: non-finite values"
    max_tol, l2_tol = TOL[dtype]
    err = (g - r).abs().max().item() / max(r.abs().max().item(), 1e-30)
    l2 = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
    assert err <= max_tol and l2 <= l2_tol, (
        f"{name}: max rel err {err:.3g} (tol {max_tol}), l2 {l2:.3g} (tol {l2_tol})"
    )


def _kernel(name: str) -> AttentionKernel:
    return registry.get_attention(name)


def _skip_unless_supported(kernel: AttentionKernel, spec: AttentionSpec) -> None:
    if reasons := kernel.supports(spec):
        pytest.skip(f"{kernel.name} does not support this case: {'; '.join(reasons)}")


def _inputs(
    gen: torch.Generator, shape_q: tuple[int, ...], shape_k: tuple[int, ...], dv: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    dev = _device()
    q = torch.randn(shape_q, generator=gen, dtype=torch.float64).to(dev, dtype)
    k = torch.randn(shape_k, generator=gen, dtype=torch.float64).to(dev, dtype)
    v = torch.randn((*shape_k[:-1], dv), generator=gen, dtype=torch.float64).to(dev, dtype)
    return q, k, v


def _grads(out: torch.Tensor, dout: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((out.double() * dout).sum(), xs)


@pytest.mark.skipif(not KERNELS, reason="no attention kernel besides eager is available on this host")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", KERNELS or ["none"])
def test_varlen_matches_eager(name: str, case: Case, dtype: torch.dtype) -> None:
    """Packed output and q/k/v gradients agree with the fp64 eager reference on mixed lengths."""
    kernel = _kernel(name)
    dev = _device()
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{case.id}/{dtype}".encode()))
    lens = _lengths(gen, dev)
    total, d = sum(lens), 64
    dv = case.dv or d
    q, k, v = _inputs(gen, (total, case.heads, d), (total, case.kv_heads, d), dv, dtype)
    spec = attention_spec(q, k, v, "varlen", case.causal, case.window, case.softcap)
    _skip_unless_supported(kernel, spec)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    scale = 0.7 * d**-0.5

    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    opts = {"causal": case.causal, "window": case.window, "scale": scale, "softcap": case.softcap}
    out = kernel.varlen(q, k, v, cu, cu, max(lens), max(lens), **opts)  # type: ignore[arg-type]
    assert out.dtype == dtype and out.shape == (total, case.heads, dv)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dev)
    grads = _grads(out, dout, q, k, v)

    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    eager = EagerAttention(registry.get_device())
    ref = eager.varlen(q64, k64, v64, cu, cu, max(lens), max(lens), **opts)  # type: ignore[arg-type]
    ref_grads = _grads(ref, dout, q64, k64, v64)
    _close("out", out, ref, dtype)
    for gname, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(gname, g, r, dtype)


@pytest.mark.skipif(not KERNELS, reason="no attention kernel besides eager is available on this host")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.id)
@pytest.mark.parametrize("name", KERNELS or ["none"])
def test_padded_matches_eager(name: str, case: Case, dtype: torch.dtype) -> None:
    """Padded output (rows of real queries) and gradients agree with eager, with left and right padding."""
    kernel = _kernel(name)
    dev = _device()
    gen = torch.Generator().manual_seed(zlib.crc32(f"padded/{name}/{case.id}/{dtype}".encode()))
    b, s, d = 3, (96 if dev.type == "cpu" else 1024), 64
    q, k, v = _inputs(gen, (b, s, case.heads, d), (b, s, case.kv_heads, d), d, dtype)
    spec = attention_spec(q, k, v, "padded", case.causal, case.window)
    _skip_unless_supported(kernel, spec)
    mask = torch.ones(b, s, dtype=torch.int64, device=dev)
    mask[0, : s // 3] = 0  # left padding
    mask[1, s - s // 4 :] = 0  # right padding
    real = (mask != 0)[..., None, None].to(torch.float64)

    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out = kernel.padded(q, k, v, attention_mask=mask, causal=case.causal, window=case.window)
    assert out.dtype == dtype and out.shape == (b, s, case.heads, d)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dev) * real
    grads = _grads(out, dout, q, k, v)

    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = EagerAttention(registry.get_device()).padded(
        q64, k64, v64, attention_mask=mask, causal=case.causal, window=case.window
    )
    ref_grads = _grads(ref, dout, q64, k64, v64)
    _close("out", out.double() * real, ref * real, dtype)
    for gname, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(gname, g, r, dtype)


def _spec(**over: object) -> AttentionSpec:
    base: dict[str, object] = {
        "dtype": torch.bfloat16 if _device().type != "cpu" else torch.float32,
        "head_dim": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "device_type": _device().type,
    }
    base.update(over)
    return AttentionSpec(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec_kw", [{}, {"softcap": 30.0}, {"window": (32, 0)}, {"layout": "padded", "causal": False}], ids=str
)
def test_auto_picks_highest_priority_kernel_that_supports_spec(spec_kw: dict[str, object]) -> None:
    """``get_attention(spec=...)`` returns the first kernel, by priority, whose ``supports`` is empty."""
    spec = _spec(**spec_kw)
    chosen = registry.get_attention(spec=spec)
    assert chosen.supports(spec) == ()
    device = registry.resolve("device").name
    for s in registry.backends("attention"):
        if s.name == chosen.name:
            break
        if registry.probe("attention", s.name).available and s.works_with(device):
            assert registry.get_attention(s.name).supports(spec), f"{s.name} supports {spec} but was skipped"
    else:
        pytest.fail(f"auto chose {chosen.name}, which is not registered")


@pytest.mark.parametrize("name", [*KERNELS, "eager"])
def test_explicit_kernel_that_cannot_run_spec_raises(name: str) -> None:
    """An explicitly named kernel that cannot run the spec raises ``BackendUnavailable`` with its reasons."""
    spec = _spec(dtype=torch.int32)
    reasons = registry.get_attention(name).supports(spec)
    assert reasons and all(isinstance(r, str) and r for r in reasons)
    with pytest.raises(BackendUnavailable, match="int32"):
        registry.get_attention(name, spec=spec)


def test_eager_auto_for_softcap_on_cpu() -> None:
    """On cpu only eager has a softcap, so auto picks it and it runs the case."""
    if _device().type != "cpu":
        pytest.skip("cpu-specific selection check")
    spec = _spec(softcap=20.0)
    assert registry.get_attention(spec=spec).name == "eager"
    with pytest.raises(BackendUnavailable, match="softcap"):
        registry.get_attention("torch", spec=spec)
