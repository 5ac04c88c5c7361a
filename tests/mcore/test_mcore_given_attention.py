"""mcore's attention core with a kernel object (``ModelConfig.attention`` given as a built kernel, which
``block_spec`` passes to every ``CoreAttention``): the object runs, not the registry's choice, so a
kernel's constructor options (``TorchAttention(device, dense_uniform=True)``) reach the mcore engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests._attention import count_dense_calls

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.mcore


def test_core_attention_runs_the_given_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from underlay.backends.portable import attention as A
    from underlay.engines.mcore.layers import _core_attention_class
    from underlay.registry import get_device

    calls = count_dense_calls(monkeypatch)
    cls = _core_attention_class()
    config = SimpleNamespace(kv_channels=8, use_cpu_initialization=True, context_parallel_size=1)
    kernel = A.TorchAttention(get_device("cpu"), dense_uniform=True)
    given = cls(config, 1, None, "self", kernel=kernel)
    by_name = cls(config, 1, None, "self", kernel="torch")
    assert given._get_kernel() is kernel and given.kernel_name is None
    g = torch.Generator().manual_seed(0)
    s, b = 6, 3  # [s, b, h, d]: b sequences of one length, the kernel's dense case
    q = torch.randn(s, b, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(s, b, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ref = by_name(q, k, v, None)
    assert not calls, "the registry's torch kernel keeps the varlen path"
    out = given(q, k, v, None)
    assert len(calls) == 1, "the given kernel's dense path must run"
    assert out.shape == (s, b, 4 * 8) and float((out - ref).abs().max()) < 1e-12
