"""Masked statistics against float64 numpy references; NaN handling; response masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from underlay.interfaces import InvalidInput
from underlay.ops import clip_by_value, masked_mean, masked_sum, masked_var, masked_whiten, response_mask


@st.composite
def _batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    b = draw(st.integers(1, 5))
    s = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = rng.normal(draw(st.floats(-5, 5)), draw(st.floats(0.1, 10)), size=(b, s))
    mask = rng.random((b, s)) < draw(st.floats(0.2, 1.0))
    mask.flat[rng.integers(0, b * s)] = True
    return x, mask


@settings(max_examples=40, deadline=None)
@given(_batches())
def test_masked_stats_match_numpy(batch: tuple[np.ndarray, np.ndarray]) -> None:
    x, mask = batch
    xt, mt = torch.tensor(x, dtype=torch.float32), torch.tensor(mask)
    kept = x[mask]
    assert masked_sum(xt, mt).item() == pytest.approx(kept.sum(), rel=1e-5, abs=1e-4)
    assert masked_mean(xt, mt).item() == pytest.approx(kept.mean(), rel=1e-5, abs=1e-5)
    var_ref = kept.var(ddof=1) if kept.size > 1 else 0.0
    assert masked_var(xt, mt).item() == pytest.approx(var_ref, rel=1e-4, abs=1e-5)
    assert masked_var(xt, mt, unbiased=False).item() == pytest.approx(kept.var(), rel=1e-4, abs=1e-5)
    # per-row (dim=1) against numpy row by row
    rows = masked_mean(xt, mt.float(), dim=1)
    for r in range(x.shape[0]):
        ref = x[r][mask[r]].mean() if mask[r].any() else 0.0
        assert rows[r].item() == pytest.approx(ref, rel=1e-5, abs=1e-5)
    white = masked_whiten(xt, mt)
    if kept.size > 1:
        expect = (kept - kept.mean()) / math.sqrt(kept.var(ddof=1) + 1e-8)
        np.testing.assert_allclose(white.numpy()[mask], expect, rtol=1e-4, atol=1e-4)
    assert torch.all(white[~mt] == 0)


def test_masked_var_per_row_multi_dim() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    m = torch.rand(3, 4, 5, generator=gen) > 0.3
    got = masked_var(x, m, dim=(1, 2))
    for i in range(3):
        assert got[i].item() == pytest.approx(x[i][m[i]].var().item(), rel=1e-10)


def test_nan_at_masked_position_does_not_leak_but_kept_nan_does() -> None:
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 2.0, 4.0]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    assert masked_sum(x, mask).item() == pytest.approx(10.0)
    assert masked_mean(x, mask).item() == pytest.approx(2.5)
    assert masked_var(x, mask).item() == pytest.approx(np.var([1, 3, 2, 4], ddof=1))
    assert torch.isfinite(masked_whiten(x, mask)).all()
    kept_nan = torch.tensor([1.0, float("nan")])
    assert math.isnan(masked_mean(kept_nan, torch.tensor([1, 1])).item())


def test_empty_mask_gives_zero_and_bad_shapes_raise() -> None:
    x = torch.randn(2, 3)
    assert masked_mean(x, torch.zeros(2, 3)).item() == 0.0
    assert masked_var(x, torch.tensor([[1, 0, 0], [0, 0, 0]])).item() == 0.0
    with pytest.raises(InvalidInput, match="broadcast"):
        masked_mean(x, torch.ones(4))
    with pytest.raises(InvalidInput, match="enlarge"):
        masked_sum(torch.ones(3), torch.ones(2, 3))


def test_response_mask_up_to_first_eos() -> None:
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 6, 7, 8, 9], [2, 4, 4, 4, 4], [1, 9, 3, 9, 9]])
    expect = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    got = response_mask(ids, [2, 3])
    assert got.dtype == torch.int64 and torch.equal(got[:3], expect[:3])
    assert torch.equal(response_mask(ids, 3)[3], expect[3])
    with pytest.raises(InvalidInput, match="empty"):
        response_mask(ids, [])
    with pytest.raises(InvalidInput, match="integer"):
        response_mask(ids.float(), 2)


def test_clip_by_value() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50, generator=gen, requires_grad=True)
    y = clip_by_value(x, -0.5, 0.5)
    assert torch.equal(y, x.detach().clamp(-0.5, 0.5))
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, ((x.detach() >= -0.5) & (x.detach() <= 0.5)).float())
    lo, hi = torch.full((50,), -0.1), torch.linspace(0, 1, 50)
    assert torch.equal(clip_by_value(x.detach(), lo, hi), torch.minimum(torch.maximum(x.detach(), lo), hi))
    with pytest.raises(InvalidInput, match="swap"):
        clip_by_value(x, 1.0, 0.0)
