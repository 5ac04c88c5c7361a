"""``EagerAttention`` (the oracle of the attention conformance suite) against an independent dense
float64 reference: one block-diagonal ``[H, T_q, T_k]`` score matrix over the whole packed batch,
with masks built from per-token sequence ids and positions."""

from __future__ import annotations

import math

import pytest
import torch

from underlay import registry
from underlay.backends.portable.attention import EagerAttention


def _dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens_q: list[int],
    lens_k: list[int],
    causal: bool,
    window: tuple[int, int] | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``[T_q, Hq, Dv]`` float64; a query that sees no key gives 0."""
    seq_q = torch.repeat_interleave(torch.arange(len(lens_q)), torch.tensor(lens_q))
    seq_k = torch.repeat_interleave(torch.arange(len(lens_k)), torch.tensor(lens_k))
    pos_q = torch.cat([torch.arange(n) for n in lens_q])
    pos_k = torch.cat([torch.arange(n) for n in lens_k])
    shift = torch.tensor(lens_k)[seq_q] - torch.tensor(lens_q)[seq_q]  # bottom-right alignment
    p = (pos_q + shift)[:, None]
    j = pos_k[None, :]
    ok = seq_q[:, None] == seq_k[None, :]
    if causal:
        ok &= j <= p
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= p - left
        if right >= 0:
            ok &= j <= p + right
    hq, hk = q.shape[1], k.shape[1]
    kv_head = torch.arange(hq) // (hq // hk)
    qd, kd, vd = q.double(), k.double()[:, kv_head], v.double()[:, kv_head]  # [T, Hq, D]
    s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~ok, -math.inf)
    w = torch.exp(s - s.amax(-1, keepdim=True).clamp_min(-1e300))
    w = torch.where(ok, w, torch.zeros_like(w))
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.einsum("hqk,khd->qhd", w, vd)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.fixture
def eager() -> EagerAttention:
    return EagerAttention(registry.get_device())


CASES = [
    # (lens_q, lens_k, hq, hk, causal, window, softcap, dv)
    ([5, 1, 17, 9, 33], None, 4, 2, True, None, None, 16),
    ([5, 1, 17, 9, 33], None, 4, 1, False, None, None, 16),
    ([12, 30, 7], None, 3, 3, True, (4, 0), None, 16),
    ([12, 30, 7], None, 2, 1, False, (5, 3), None, 8),
    ([12, 30, 7], None, 2, 2, True, None, 5.0, 16),
    ([3, 9, 6], [7, 9, 2], 4, 2, True, None, None, 16),  # S_q != S_k: bottom-right causal
    ([3, 9, 6], [7, 9, 2], 2, 2, False, (2, 1), 10.0, 16),
    ([4, 0, 6], [4, 3, 6], 2, 1, True, None, None, 16),  # an empty query sequence
]


@pytest.mark.parametrize(("lens_q", "lens_k", "hq", "hk", "causal", "window", "softcap", "dv"), CASES)
def test_eager_varlen_matches_dense_reference(
    eager: EagerAttention,
    lens_q: list[int],
    lens_k: list[int] | None,
    hq: int,
    hk: int,
    causal: bool,
    window: tuple[int, int] | None,
    softcap: float | None,
    dv: int,
) -> None:
    lens_k = lens_k or lens_q
    gen = torch.Generator().manual_seed(sum(lens_q) * 31 + hq)
    d = 16
    q = torch.randn(sum(lens_q), hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(lens_k), hk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(lens_k), hk, dv, generator=gen, dtype=torch.float64)
    scale = 0.3
    out = eager.varlen(
        q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), causal=causal, window=window, scale=scale,
        softcap=softcap,
    )  # fmt: skip
    ref = _dense_reference(q, k, v, lens_q, lens_k, causal, window, scale, softcap)
    assert out.shape == (sum(lens_q), hq, dv) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_eager_default_scale_and_dtype(eager: EagerAttention) -> None:
    """``scale=None`` is ``D ** -0.5``; bf16 in gives bf16 out computed in fp32."""
    lens = [6, 11]
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(17, 2, 32, generator=gen) for _ in range(3))
    out = eager.varlen(q.bfloat16(), k.bfloat16(), v.bfloat16(), _cu(lens), _cu(lens), 11, 11)
    assert out.dtype == torch.bfloat16
    ref = _dense_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), lens, lens, True, None, 32**-0.5, None)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_eager_gradients_gradcheck(eager: EagerAttention) -> None:
    """Autograd through eager is exact (finite-difference check in float64), GQA + window + softcap."""
    lens = [3, 5]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(8, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(8, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(8, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    cu = _cu(lens)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return eager.varlen(q, k, v, cu, cu, 5, 5, causal=True, window=(2, 0), softcap=3.0)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_eager_padded_matches_varlen_on_real_tokens(eager: EagerAttention) -> None:
    """Padded attention with left/right padding equals packed attention of the kept tokens."""
    gen = torch.Generator().manual_seed(11)
    b, s, hq, hk, d = 3, 10, 4, 2, 8
    q = torch.randn(b, s, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, s, hk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, s, hk, d, generator=gen, dtype=torch.float64)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, :4] = False
    mask[2, 7:] = False
    for causal, window in ((True, None), (False, None), (True, (3, 0))):
        out = eager.padded(q, k, v, attention_mask=mask, causal=causal, window=window)
        lens = mask.sum(1).tolist()
        packed = eager.varlen(
            q[mask],
            k[mask],
            v[mask],
            _cu(lens),
            _cu(lens),
            max(lens),
            max(lens),
            causal=causal,
            window=window,
        )
        torch.testing.assert_close(out[mask], packed, rtol=1e-12, atol=1e-12)
        assert torch.isfinite(out).all()


def test_eager_padded_unmasked_equals_dense(eager: EagerAttention) -> None:
    """Without a mask, padded is the dense reference per batch row (S_q != S_k, bottom-right causal)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 2, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 9, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 9, 2, 8, generator=gen, dtype=torch.float64)
    out = eager.padded(q, k, v, causal=True, scale=0.5)
    ref = _dense_reference(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), [4, 4], [9, 9], True, None, 0.5, None
    )
    torch.testing.assert_close(out.flatten(0, 1), ref, rtol=1e-12, atol=1e-12)


def test_eager_query_without_keys_is_zero(eager: EagerAttention) -> None:
    """Causal with more queries than keys: the first queries see nothing and give exactly 0."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(6, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 1, 4, generator=gen, dtype=torch.float64)
    out = eager.varlen(q, k, v, _cu([6]), _cu([2]), 6, 2, causal=True)
    assert (out[:4] == 0).all() and (out[4:] != 0).all()
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
