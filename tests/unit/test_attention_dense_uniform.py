"""``UNDERLAY_ATTENTION_DENSE_UNIFORM``: the torch attention backend's batched causal SDPA for packed
batches of equal-length sequences equals the varlen path (float64, outputs and gradients), and only
runs when every sequence has the same length."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from underlay.backends.portable import attention as A
from underlay.registry import get_device


def _packed(lens: list[int], hq: int = 4, hk: int = 2, d: int = 8, seed: int = 0) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hk, hk))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, max(lens)


def _run(kernel: Any, q: Any, k: Any, v: Any, cu: Any, mx: int) -> tuple[torch.Tensor, ...]:
    out = kernel.varlen(q, k, v, cu, cu, mx, mx, causal=True)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return (out.detach(), *grads)


def test_dense_equals_varlen_on_equal_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = A.TorchAttention(get_device("cpu"))
    calls: list[int] = []
    real = A.dense_causal

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(A, "dense_causal", counted)
    for lens in ([7, 7, 7], [5], [9, 9]):
        args = _packed(lens, seed=len(lens))
        monkeypatch.setenv("UNDERLAY_ATTENTION_DENSE_UNIFORM", "0")
        ref = _run(kernel, *args)
        monkeypatch.setenv("UNDERLAY_ATTENTION_DENSE_UNIFORM", "1")
        n = len(calls)
        got = _run(kernel, *args)
        assert len(calls) == n + 1, "equal lengths must take the dense path"
        for a, b in zip(got, ref, strict=True):
            assert float((a - b).abs().max()) < 1e-12, lens


def test_unequal_lengths_keep_the_varlen_path(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = A.TorchAttention(get_device("cpu"))
    monkeypatch.setenv("UNDERLAY_ATTENTION_DENSE_UNIFORM", "1")
    monkeypatch.setattr(A, "dense_causal", lambda *a, **k: pytest.fail("dense path on unequal lengths"))
    q, k, v, cu, mx = _packed([7, 3, 7])
    kernel.varlen(q, k, v, cu, cu, mx, mx, causal=True)
    assert A.uniform_rows(17, cu, 7) is None and A.uniform_rows(21, cu, 7) == 3


def test_traced_function_dispatches_on_shapes() -> None:
    """The compiled-layer function: equal lengths -> dense (the varlen function is not called);
    otherwise the varlen function (here the float64 per-sequence reference)."""
    kernel = A.TorchAttention(get_device("cpu"))
    seen: list[int] = []

    def varlen_ref(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, mq: int, mk: int, **kw: Any) -> Any:
        seen.append(1)
        return kernel.varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True)

    for lens, dense in (([6, 6], True), ([6, 2], False)):
        q, k, v, cu, mx = _packed(lens)
        out = A._traced_dense_or_varlen(varlen_ref, False, True, q, k, v, cu, mx, True, None, None)
        ref = kernel.varlen(q, k, v, cu, cu, mx, mx, causal=True)
        assert float((out - ref).abs().max()) < 1e-12
        assert (len(seen) == 0) == dense
        seen.clear()
