"""docs/porting-from-verl.md's actor loss, run as written: for every aggregation mode, with the KL loss
and the entropy bonus, its contributions over any split of a batch into ranks and micro-batches sum to
verl 0.9.1's formulas applied to the whole batch in float64 (loss and gradient), and its "mean" metrics
are the unweighted means of verl's per-micro-batch masked means."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._loss_reference import MODES, NORM, reference_agg
from underlay.engines._loss import LossCounts, MetricReducer, checked_loss
from underlay.interfaces import TokenBatch, TokenOutputs

DOC = Path(__file__).resolve().parents[2] / "docs" / "porting-from-verl.md"


def _doc_namespace() -> dict[str, Any]:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "the page has one python block, the actor loss"
    ns: dict[str, Any] = {}
    exec(compile(blocks[0], str(DOC), "exec"), ns)
    return ns


def _reference(b: TokenBatch, lp: torch.Tensor, ent: torch.Tensor, mode: str) -> torch.Tensor:
    """verl's vanilla PPO loss with dual clip, entropy bonus (0.01) and k3 KL loss (0.05), float64."""
    x = {k: v.double() for k, v in b.extras.items()}
    ratio = torch.exp(torch.clamp(lp - x["old_log_probs"], -20, 20))
    a = x["advantages"]
    l1, l2 = -a * ratio, -a * torch.clamp(ratio, 0.8, 1.28)
    c = torch.maximum(l1, l2)
    pg = torch.where(a < 0, torch.minimum(-a * 3.0, c), c)
    k = torch.clamp(x["ref_log_prob"] - lp, -20, 20)
    kl = torch.clamp(torch.exp(k) - k - 1, -10, 10)
    m = b.loss_mask
    return reference_agg(pg, m, mode) - 0.01 * reference_agg(ent, m, mode) + 0.05 * reference_agg(kl, m, mode)


def _batch(seed: int) -> tuple[TokenBatch, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows, seq = 7, 9
    mask = (torch.rand(rows, seq, generator=g) < 0.7).long()
    mask[2] = 0
    lp = -torch.rand(rows, seq, generator=g, dtype=torch.float64) * 2
    extras = {
        "old_log_probs": lp + (torch.rand(rows, seq, generator=g, dtype=torch.float64) - 0.5) * 5.0,
        "ref_log_prob": lp + (torch.rand(rows, seq, generator=g, dtype=torch.float64) - 0.5) * 0.5,
        "advantages": torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, seq).clone(),
    }
    ids = torch.ones(rows, seq, dtype=torch.long)
    ent = torch.rand(rows, seq, generator=g, dtype=torch.float64)
    return TokenBatch(ids, torch.ones_like(ids), mask, extras), lp, ent


@pytest.mark.parametrize("mode", MODES)
def test_doc_actor_loss_is_verl_over_any_split(mode: str) -> None:
    make = _doc_namespace()["verl_actor_loss"]
    loss_fn = make(
        loss_agg_mode=mode,
        clip_ratio_high=0.28,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.05,
        loss_scale_factor=NORM,
    )
    batch, lp, ent = _batch(3)
    per_row = tuple(int(t) for t in batch.loss_mask.sum(1))
    tokens, seqs = sum(per_row), sum(1 for t in per_row if t)
    shards = [[0, 2, 4, 6], [1, 3, 5]]  # 2 ranks; micro-batches of uneven sizes
    cuts = [[[0], [2, 4], [6]], [[1, 3], [5]]]
    leaf = lp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    reducer = MetricReducer(torch.device("cpu"))
    verl_means: dict[str, list[float]] = {"pg_clipfrac": [], "pg_clipfrac_lower": [], "ppo_kl": []}
    for shard, pieces in zip(shards, cuts):
        counts = LossCounts(tokens, seqs, 2, tuple(per_row[r] for r in shard))
        for i, piece in enumerate(pieces):
            ctx = counts.context(i, len(pieces), [shard.index(r) for r in piece])
            sub = batch.select(piece)
            loss, metrics = checked_loss(loss_fn(TokenOutputs(leaf[piece], ent[piece]), sub, ctx))
            total = total + loss
            reducer.add(loss, metrics)
            old, a, m = sub.extras["old_log_probs"], sub.extras["advantages"], sub.loss_mask.bool()
            r = torch.exp(lp[piece] - old)
            clipped = torch.maximum(-a * r, -a * torch.clamp(r, 0.8, 1.28))
            per_token = {
                "pg_clipfrac": (-a * torch.clamp(r, 0.8, 1.28) > -a * r).double(),
                "pg_clipfrac_lower": ((clipped > -a * 3.0) & (a < 0)).double(),
                "ppo_kl": old - lp[piece],
            }
            for key, v in per_token.items():  # verl: a masked mean per micro-batch
                verl_means[key].append(float(v[m].mean()) if m.any() else 0.0)
    ref_leaf = lp.clone().requires_grad_(True)
    ref = _reference(batch, ref_leaf, ent, mode)
    (g,) = torch.autograd.grad(total, leaf)
    (ref_g,) = torch.autograd.grad(ref, ref_leaf)
    assert torch.allclose(total, ref, rtol=1e-12, atol=1e-12), (
        mode,
        float(total.detach()),
        float(ref.detach()),
    )
    assert torch.allclose(g, ref_g, rtol=1e-10, atol=1e-12), mode
    got = reducer.reduce(None, 1)
    assert abs(got["loss"] - float(ref.detach())) < 1e-12
    for key, values in verl_means.items():  # fp32 fractions
        assert abs(got[f"actor/{key}"] - sum(values) / len(values)) < 1e-6, key


def test_doc_kl_penalty_refuses_unknown_kinds() -> None:
    kl = _doc_namespace()["kl_penalty"]
    with pytest.raises(ValueError, match="'k9'"):
        kl(torch.zeros(1), torch.zeros(1), "k9")
