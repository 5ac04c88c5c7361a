"""Shared test helper for the torch attention kernel's dense-uniform path."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def count_dense_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap ``backends.portable.attention.dense_causal`` (the batched causal SDPA path of
    ``TorchAttention(dense_uniform=True)``) for the test: the returned list grows by one per call."""
    from underlay.backends.portable import attention as A

    calls: list[int] = []
    real = A.dense_causal

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(A, "dense_causal", counted)
    return calls
