"""Float64 reference of verl 0.9.1's ``agg_loss`` over a whole global batch (written from verl's
definition, independent of ``underlay.ops.aggregate_loss``), and a loss function that exercises every
aggregation mode and metric reduction, shared by the unit and the engine tests of loss contract v3."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from underlay.interfaces import LossContext, Metric, TokenBatch, TokenOutputs
from underlay.ops import aggregate_loss

VOCAB, SEQ = 128, 12

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "sum")
NORM = 7.0  # loss_scale_factor of seq-mean-token-sum-norm


def reference_agg(values: torch.Tensor, mask: torch.Tensor, mode: str, norm: float = NORM) -> torch.Tensor:
    """verl's ``agg_loss(values, mask, mode)`` of one process holding the whole batch, in float64:
    token-mean = sum / tokens; sum = sum; seq-mean-* = mean over rows with >= 1 loss token of the
    row's token sum (token-mean: divided by ``count + 1e-8``), -norm divided by ``norm``."""
    v, m = values.double(), mask.double()
    if mode == "token-mean":
        return (v * m).sum() / m.sum()
    if mode in ("sum", "token-sum"):
        return (v * m).sum()
    count = m.sum(-1)
    row = (v * m).sum(-1)
    if mode == "seq-mean-token-mean":
        row = row / (count + 1e-8)
    has = count > 0
    out = row[has].sum() / has.sum()
    return out / norm if mode == "seq-mean-token-sum-norm" else out


def global_batch() -> TokenBatch:
    """10 right-padded rows of lengths 4..12 (tokens < 128): uneven loss-token counts, two rows
    without any; ``extras["advantages"]``."""
    g = torch.Generator().manual_seed(11)
    lens = torch.tensor([12, 5, 9, 4, 11, 7, 12, 6, 10, 8])
    pos = torch.arange(SEQ)[None, :]
    attn = (pos < lens[:, None]).long()
    ids = torch.randint(0, VOCAB, (10, SEQ), generator=g) * attn
    prompt = torch.tensor([1, 2, 3, 1, 9, 2, 5, 1, 3, 2])
    loss_mask = ((pos >= prompt[:, None]) & (attn == 1)).long()
    loss_mask[[3, 7]] = 0
    return TokenBatch(ids, attn, loss_mask, {"advantages": torch.randn(10, generator=g)})


def per_token(log_probs: torch.Tensor, batch: TokenBatch, adv_key: str = "advantages") -> torch.Tensor:
    """A non-linear per-token loss ``-A * logp + 0.1 * logp^2`` (``A`` per row)."""
    adv = batch.extras[adv_key].to(log_probs.dtype)[:, None]
    return -adv * log_probs + 0.1 * log_probs**2


class ModeLoss:
    """``loss_fn`` aggregating :func:`per_token` with ``mode``; metrics of every reduction: the max and
    min log-prob over loss tokens, the per-call sum of loss-token log-probs as a mean, and the
    sequence count as a sum."""

    def __init__(self, mode: str, adv_key: str = "advantages") -> None:
        self.mode, self.adv_key = mode, adv_key

    def __call__(
        self, outputs: TokenOutputs, batch: TokenBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, Mapping[str, Any]]:
        lp = outputs.log_probs
        assert lp is not None
        keep = batch.loss_mask != 0
        norm = NORM if self.mode == "seq-mean-token-sum-norm" else None
        loss = aggregate_loss(per_token(lp, batch, self.adv_key), batch.loss_mask, self.mode, ctx, norm=norm)
        d = lp.detach()
        inf = torch.tensor(float("inf"), dtype=d.dtype)
        return loss, {
            "lp_max": Metric(torch.where(keep, d, -inf).max(), "max"),
            "lp_min": Metric(torch.where(keep, d, inf).min(), "min"),
            "lp_mean": Metric(torch.where(keep, d, 0.0).sum(), "mean"),
            "seqs": float(ctx.local_sequences),
        }


def reference_metrics(log_probs: torch.Tensor, mask: torch.Tensor, calls: int) -> dict[str, float]:
    """What :class:`ModeLoss`'s metrics reduce to over the global batch run in ``calls`` loss_fn calls."""
    keep = mask != 0
    lp = log_probs.double()[keep]
    return {
        "lp_max": float(lp.max()),
        "lp_min": float(lp.min()),
        "lp_mean": float(lp.sum()) / calls,
        "seqs": float((keep.sum(-1) > 0).sum()),
    }
