"""``TorchAttention(device, dense_uniform=True)``: the torch attention backend's batched causal SDPA for
packed batches of equal-length sequences equals the varlen path (float64, outputs and gradients), only
runs when every sequence has the same length, and reaches a model (and so an engine) as
``ModelConfig.attention`` / ``prepare_model(attention=kernel)``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._attention import count_dense_calls
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
    dev = get_device("cpu")
    plain, dense = A.TorchAttention(dev), A.TorchAttention(dev, dense_uniform=True)
    assert not plain.dense_uniform and dense.dense_uniform
    calls = count_dense_calls(monkeypatch)
    for lens in ([7, 7, 7], [5], [9, 9]):
        args = _packed(lens, seed=len(lens))
        ref = _run(plain, *args)
        assert not calls, "the default kernel must keep the varlen path"
        got = _run(dense, *args)
        assert len(calls) == 1, "equal lengths must take the dense path"
        calls.clear()
        for a, b in zip(got, ref, strict=True):
            assert float((a - b).abs().max()) < 1e-12, lens


def test_unequal_lengths_keep_the_varlen_path(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = A.TorchAttention(get_device("cpu"), dense_uniform=True)
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
        assert float((out - ref).detach().abs().max()) < 1e-12
        assert (len(seen) == 0) == dense
        seen.clear()


def test_bad_option_and_config_values_are_refused() -> None:
    from transformers import LlamaConfig

    from underlay.interfaces import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="dense_uniform=1"):
        A.TorchAttention(get_device("cpu"), dense_uniform=1)  # type: ignore[arg-type]
    hf = LlamaConfig()
    kernel = A.TorchAttention(get_device("cpu"), dense_uniform=True)
    assert ModelConfig(hf_config=hf, attention=kernel).attention is kernel
    for bad in ("", object()):
        with pytest.raises(ConfigError, match="ModelConfig.attention"):
            ModelConfig(hf_config=hf, attention=bad)  # type: ignore[arg-type]


def test_given_kernel_routes_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model prepared with a built kernel (what the engines do with ``ModelConfig.attention``) runs it
    in every layer: equal-length rows take the dense path and give the log-probs of the registry's
    ``torch`` kernel (float64); a case the given kernel cannot run is refused by name."""
    import copy

    from tests.unit.models._f64 import f64_model
    from underlay.interfaces import AttentionSpec, BackendUnavailable
    from underlay.models import packed_forward, prepare_model
    from underlay.models.attention import ROUTE_ATTR
    from underlay.ops.packing import unpad

    base = f64_model("llama")
    kernel = A.TorchAttention(get_device("cpu"), dense_uniform=True)
    by_name = prepare_model(copy.deepcopy(base), attention="torch")
    given = prepare_model(copy.deepcopy(base), attention=kernel)
    ids = torch.randint(0, 96, (3, 8), generator=torch.Generator().manual_seed(2))
    batch = unpad(ids, torch.ones_like(ids, dtype=torch.bool))
    calls = count_dense_calls(monkeypatch)
    with torch.no_grad():
        ref = packed_forward(by_name, batch).log_probs
        assert not calls
        got = packed_forward(given, batch).log_probs
    assert len(calls) == base.config.num_hidden_layers, "every layer must run the given kernel's dense path"
    assert float((got - ref).abs().max()) < 1e-12
    route = getattr(given.model.layers[0].self_attn, ROUTE_ATTR)
    soft = AttentionSpec(torch.float64, 8, 4, 2, "cpu", "varlen", True, None, 30.0, 8, False, False)
    with pytest.raises(BackendUnavailable, match="softcap"):
        route.kernel(soft)
