"""Loss aggregation over the global batch (loss contract v3): verl's ``loss_agg_mode`` as a contribution.

A ``loss_fn`` returns its micro-batch's *contribution*; the engine sums the contributions' gradients
over micro-batches and data-parallel ranks. :func:`aggregate_loss` turns per-token values into the
contribution whose sum over the global batch is verl 0.9.1's ``agg_loss`` of the whole global batch
(``core_algos.agg_loss`` with the global token count / sequence count, without its ``dp_size`` factor,
which compensates the gradient averaging that underlay's engines undo themselves).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from underlay.interfaces import InvalidInput, LossContext

__all__ = ["AGGREGATION_MODES", "AggregationMode", "aggregate_loss"]

AggregationMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "sum"
]
AGGREGATION_MODES: tuple[str, ...] = (*get_args(AggregationMode), "token-sum")
"""The accepted modes; ``"token-sum"`` is verl's name for ``"sum"``."""

_SEQ_EPS = 1e-8  # verl adds it to each sequence's token count in seq-mean-token-mean


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    ctx: LossContext,
    *,
    norm: float | None = None,
) -> torch.Tensor:
    """This micro-batch's contribution to the global aggregate of per-token ``values``.

    ``values``: ``[b, S]`` floating (e.g. per-token policy loss); ``mask``: ``[b, S]`` 0/1 (bool or
    numeric), the micro-batch's ``batch.loss_mask`` (the counts of ``ctx`` come from it); ``ctx``: the
    :class:`LossContext` the engine passed. ``G_tok``/``G_seq`` are ``ctx.global_loss_tokens`` /
    ``ctx.global_sequences`` (a sequence is a row with at least one loss token); sums run over this
    micro-batch, masked-out positions never reach the result (NaN there is ignored):

    - ``"token-mean"``: ``sum(values * mask) / G_tok``.
    - ``"seq-mean-token-mean"``: ``sum_rows(sum_t(values * mask) / (n_row + 1e-8)) / G_seq`` over rows
      with ``n_row >= 1`` loss tokens (verl's epsilon included).
    - ``"seq-mean-token-sum"``: ``sum_rows(sum_t(values * mask)) / G_seq``.
    - ``"seq-mean-token-sum-norm"`` (Dr. GRPO): the same divided by ``norm`` (verl's
      ``loss_scale_factor``; required here: verl's default is its response length, which an underlay
      ``[b, S]`` mask over prompt + response does not give).
    - ``"sum"`` (verl: ``"token-sum"``): ``sum(values * mask)``.

    Summed over every micro-batch of every data-parallel rank this is verl's ``agg_loss`` over the
    whole global batch, whatever the micro-batching. Returns a 0-dim tensor of ``values``' dtype,
    differentiable in ``values``; a global batch without loss tokens gives 0.

    Raises ``InvalidInput`` (naming the value) for an unknown ``mode``, a shape mismatch, a mask with
    values other than 0/1, a mask whose counts disagree with ``ctx``, a non-``LossContext`` ``ctx``,
    or a ``norm`` that is missing, non-finite, not positive, or given to a mode that ignores it.
    When ``mask`` is ``ctx.loss_mask`` (the micro-batch's ``batch.loss_mask`` as the engine passed
    it, already checked) nothing is read back from the device; any other mask is checked against
    ``ctx`` with one host synchronisation.
    """
    if mode not in AGGREGATION_MODES:
        raise InvalidInput(f"aggregate_loss: unknown mode {mode!r}; use one of {list(AGGREGATION_MODES)}")
    if not isinstance(ctx, LossContext):
        raise InvalidInput(
            f"aggregate_loss: ctx is {type(ctx).__name__}; pass the LossContext the engine gave the loss_fn"
        )
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise InvalidInput(
            f"aggregate_loss: values must be a floating tensor, got "
            f"{type(values).__name__ if not isinstance(values, torch.Tensor) else values.dtype}"
        )
    if not isinstance(mask, torch.Tensor) or mask.shape != values.shape or values.dim() != 2:
        raise InvalidInput(
            f"aggregate_loss: values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__} must both be "
            "[b, S] of the same shape"
        )
    if mask.device != values.device:
        raise InvalidInput(f"aggregate_loss: mask on {mask.device}, values on {values.device}")
    if mode == "seq-mean-token-sum-norm":
        ok = isinstance(norm, (int, float)) and not isinstance(norm, bool)
        if norm is None or not (ok and math.isfinite(norm) and norm > 0):
            raise InvalidInput(
                f"aggregate_loss: mode 'seq-mean-token-sum-norm' needs norm > 0 (verl's loss_scale_factor, "
                f"e.g. the max response length), got norm={norm!r}"
            )
    elif norm is not None:
        raise InvalidInput(
            f"aggregate_loss: norm={norm!r} applies only to 'seq-mean-token-sum-norm', not {mode!r}"
        )

    keep = mask if mask.dtype == torch.bool else mask != 0
    per_row = keep.sum(dim=1)
    if mask is not ctx.loss_mask:
        _check_mask(mask, per_row, ctx)

    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    kept = torch.where(keep, values, zero)
    if mode in ("token-mean", "sum", "token-sum"):
        total = kept.sum()
        return total / max(ctx.global_loss_tokens, 1) if mode == "token-mean" else total
    row_sum = kept.sum(dim=1)
    if mode == "seq-mean-token-mean":
        row_sum = row_sum / (per_row.to(values.dtype) + _SEQ_EPS)
    seq = torch.where(per_row > 0, row_sum, zero).sum() / max(ctx.global_sequences, 1)
    if mode == "seq-mean-token-sum-norm":
        assert norm is not None
        seq = seq / norm
    return seq


def _check_mask(mask: torch.Tensor, per_row: torch.Tensor, ctx: LossContext) -> None:
    """``InvalidInput`` unless ``mask`` is 0/1 with the loss tokens and sequences ``ctx`` counts
    (one read back to the host)."""
    nonbinary = ((mask != 0) & (mask != 1)).sum() if mask.dtype != torch.bool else per_row.new_zeros(())
    bad, tokens, rows = (
        int(x) for x in torch.stack([nonbinary, per_row.sum(), (per_row > 0).sum()]).tolist()
    )
    if bad:
        raise InvalidInput(
            f"aggregate_loss: mask holds {bad} values other than 0/1; weight values instead of the mask"
        )
    if (tokens, rows) != (ctx.local_loss_tokens, ctx.local_sequences):
        raise InvalidInput(
            f"aggregate_loss: mask has {tokens} loss tokens in {rows} sequences but ctx counts "
            f"{ctx.local_loss_tokens} in {ctx.local_sequences}; pass the micro-batch's batch.loss_mask "
            "(mask tokens out of the loss in TokenBatch.loss_mask before forward_backward)"
        )
