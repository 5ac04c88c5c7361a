"""Vocabulary padding for tensor parallelism: padded rows never receive probability.

Megatron splits the embedding and the output layer into ``tp`` equal vocabulary shards, so a
vocabulary that ``tp`` does not divide is padded with zero rows at its end (``config.with_padded_vocab``,
``MCoreArch.vocab_rows``). A zero row would still get the logit 0 and thus probability; here the
log-prob kernel sees one extra input feature, constant 1 on the hidden side, whose weight column is
0 on real rows and ``PAD_LOGIT`` on padded ones. Real rows' logits are unchanged (the extra product is
``1 * 0``), padded rows' logits are ``PAD_LOGIT``, whose ``exp`` underflows to exactly 0 next to any
real logit: the softmax, the log-probs, the entropy and every gradient are those of the real
vocabulary alone. The padded rows' weight gradient is then exactly 0, so they stay 0 through
training (the optimizer updates nothing from zero gradients and zero weights).

The kernel must run without a final-logit softcap (``softcap * tanh(z / softcap)`` would map the
padded logit to ``-softcap``, a finite value); the mcore engine converts no soft-capped model.

The extra feature is a block of ``_EXTRA`` columns (the first carries the bias, the rest are 0) so
that rows stay 16-byte aligned for the fused kernels.
"""

from __future__ import annotations

import torch

__all__ = ["PAD_LOGIT", "mask_padded_rows"]

PAD_LOGIT = -1.0e30
"""The logit of a padded vocabulary row (before the temperature): ``exp`` of it is exactly 0 in
float32/float64/bfloat16 arithmetic. float16 cannot hold it; there ``finfo(float16).min / 4`` is used."""

_EXTRA = 8


def _pad_logit(dtype: torch.dtype) -> float:
    return float(torch.finfo(torch.float16).min) / 4 if dtype == torch.float16 else PAD_LOGIT


def mask_padded_rows(
    hidden: torch.Tensor, weight: torch.Tensor, *, vocab: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden', weight')`` for the log-prob kernel such that ``hidden' @ weight'.T`` equals
    ``hidden @ weight.T`` on the real vocabulary rows and ``PAD_LOGIT`` on padded ones.

    ``hidden [N, H]``; ``weight [V_local, H]`` this TP rank's shard (rank ``rank`` holds global rows
    ``[rank * V_local, (rank + 1) * V_local)``; rows ``>= vocab`` are padding); both of one dtype and
    device. Returns ``[N, H + 8]`` and ``[V_local, H + 8]`` (differentiable in ``hidden`` and
    ``weight``; the gradients of the added columns are discarded)."""
    rows = weight.shape[0]
    first = rank * rows
    real = max(0, min(rows, vocab - first))
    extra_w = weight.new_zeros(rows, _EXTRA)
    extra_w[real:, 0] = _pad_logit(weight.dtype)
    extra_h = hidden.new_zeros(hidden.shape[0], _EXTRA)
    extra_h[:, 0] = 1.0
    return torch.cat([hidden, extra_h], 1), torch.cat([weight, extra_w], 1)
