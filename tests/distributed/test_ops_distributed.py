"""ops over real gloo groups: vocab-parallel linear_logprobs, distributed statistics, micro-batch counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed
from underlay.interfaces import IGNORE_INDEX, InvalidInput
from underlay.ops import (
    distributed_masked_mean,
    distributed_mean_max_min_std,
    linear_logprobs,
    plan_micro_batches,
)

pytestmark = pytest.mark.distributed


def _vocab_parallel(rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(123)  # same full problem on every rank
    n, hid, v_local = 19, 8, 13
    vocab = v_local * world
    hidden = torch.randn(n, hid, generator=gen)
    weight = torch.randn(vocab, hid, generator=gen) * 0.8
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[[2, 7]] = IGNORE_INDEX
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    # float64 unsharded reference
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.t() / 0.8, -1)
    keep = labels != IGNORE_INDEX
    lp_ref = torch.where(keep, logp.gather(-1, labels.clamp_min(0)[:, None])[:, 0], 0.0)
    ent_ref = torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0)
    ((lp_ref * g_lp.double()).sum() + (ent_ref * g_ent.double()).sum()).backward()

    h = hidden.clone().requires_grad_()
    w_local = weight[rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
    out = linear_logprobs(h, w_local, labels, temperature=0.8, chunk_size=6, vocab_group=dist.group.WORLD)
    assert out.entropy is not None
    ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
    torch.testing.assert_close(out.log_probs.double(), lp_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy.double(), ent_ref.detach(), rtol=1e-5, atol=1e-5)
    assert h.grad is not None and w_local.grad is not None and h64.grad is not None and w64.grad is not None
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    local_ref = w64.grad[rank * v_local : (rank + 1) * v_local]
    torch.testing.assert_close(w_local.grad.double(), local_ref, rtol=1e-4, atol=1e-5)
    # labels are validated against the global vocabulary
    with pytest.raises(InvalidInput, match=f"outside \\[0, {vocab}\\)"):
        linear_logprobs(hidden, w_local.detach(), torch.full((n,), vocab), vocab_group=dist.group.WORLD)


def _stats(rank: int, world: int) -> None:
    # every rank builds all shards (same seed) and checks against the float64 union
    rng = np.random.default_rng(7)
    shards = [rng.normal(3.0, 2.0, size=(rng.integers(0, 4) if r == 1 else 3 + r, 5)) for r in range(world)]
    masks = [rng.random(s.shape) < 0.6 for s in shards]
    x = torch.tensor(shards[rank], dtype=torch.float32)
    m = torch.tensor(masks[rank])
    x = torch.where(m, x, torch.tensor(float("nan")))  # NaN at masked-out positions must not leak
    kept = np.concatenate([s[mk] for s, mk in zip(shards, masks)])
    mean = distributed_masked_mean(x, m, dist.group.WORLD)
    assert mean.item() == pytest.approx(kept.mean(), rel=1e-5)
    mu, mx, mn, sd = distributed_mean_max_min_std(x, dist.group.WORLD, mask=m)
    assert mu.item() == pytest.approx(kept.mean(), rel=1e-5)
    assert mx.item() == pytest.approx(kept.max(), rel=1e-6)
    assert mn.item() == pytest.approx(kept.min(), rel=1e-6)
    assert sd.item() == pytest.approx(kept.std(ddof=1), rel=1e-5)
    flat = np.concatenate([s.ravel() for s in shards])
    mu, mx, mn, sd = distributed_mean_max_min_std(torch.tensor(shards[rank], dtype=torch.float32))
    assert (mu.item(), mx.item(), mn.item()) == pytest.approx((flat.mean(), flat.max(), flat.min()), rel=1e-5)
    assert sd.item() == pytest.approx(flat.std(ddof=1), rel=1e-5)


def _micro_batches(rank: int, world: int) -> None:
    rng = np.random.default_rng(11 + rank)
    lens = rng.integers(10, 500, size=int(rng.integers(1, 40)) * (rank + 1)).tolist()
    mbs = plan_micro_batches(lens, 1000, group=dist.group.WORLD, multiple_of=2)
    count = torch.tensor([len(mbs)])
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, count)
    assert len({int(c) for c in counts}) == 1 and len(mbs) % 2 == 0
    assert all(sum(lens[i] for i in mb) <= 1000 for mb in mbs)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lens)))


def _two(rank: int, world: int) -> None:
    _vocab_parallel(rank, world)
    _stats(rank, world)
    _micro_batches(rank, world)


def _four(rank: int, world: int) -> None:
    _stats(rank, world)
    _micro_batches(rank, world)


def test_two_ranks() -> None:
    run_distributed(_two, 2)


def test_four_ranks() -> None:
    run_distributed(_four, 4)
