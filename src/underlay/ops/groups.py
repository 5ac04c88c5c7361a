"""Per-group statistics of scalar scores, for GRPO-style group-relative advantages."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from underlay.interfaces import InvalidInput
from underlay.ops._checks import checked

__all__ = ["group_ids_to_index", "group_mean_std", "group_normalize"]

GroupIds = Sequence[Hashable] | torch.Tensor


@checked
def group_ids_to_index(group_ids: GroupIds, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map labels to dense int64 indices ``[N]`` numbered by first appearance; returns ``(index, G)``.

    Labels are compared as Python values (``"0042"`` and ``42`` differ; note ``1 == 1.0 == True``
    in Python). An integer tensor is mapped without a Python loop (``torch.unique``).
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise InvalidInput(f"group ids tensor must be 1-d, got shape {tuple(group_ids.shape)}")
        ids = group_ids.to(device) if device is not None else group_ids
        if ids.numel() == 0:
            return torch.zeros(0, dtype=torch.int64, device=ids.device), 0
        uniq, inverse = torch.unique(ids, return_inverse=True)
        n = ids.numel()
        first = torch.full((uniq.numel(),), n, dtype=torch.int64, device=ids.device)
        first.scatter_reduce_(0, inverse, torch.arange(n, device=ids.device), reduce="amin")
        order = torch.argsort(first)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=ids.device)
        return rank[inverse], int(uniq.numel())
    table: dict[Hashable, int] = {}
    try:
        index = [table.setdefault(g, len(table)) for g in group_ids]
    except TypeError as exc:
        raise InvalidInput(f"group ids must be hashable: {exc}") from exc
    return torch.tensor(index, dtype=torch.int64, device=device), len(table)


def _check(scores: torch.Tensor, n_ids: int, what: str) -> None:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        raise InvalidInput(
            f"{what}: scores must be a 1-d tensor, got shape {tuple(getattr(scores, 'shape', ()))}"
        )
    if scores.shape[0] != n_ids:
        raise InvalidInput(f"{what}: {scores.shape[0]} scores but {n_ids} group ids; give one id per score")


def _stats(
    scores: torch.Tensor, index: torch.Tensor, groups: int, single_mean: float, single_std: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = scores.to(torch.float64)
    count = torch.bincount(index, minlength=groups)
    cf = count.to(torch.float64)
    mean = torch.zeros(groups, dtype=torch.float64, device=x.device).index_add_(0, index, x) / cf.clamp_min(1)
    dev = x - mean[index]
    ss = torch.zeros(groups, dtype=torch.float64, device=x.device).index_add_(0, index, dev * dev)
    std = torch.sqrt(ss / (cf - 1).clamp_min(1))
    single = count == 1
    mean = torch.where(single, torch.full_like(mean, single_mean), mean)
    std = torch.where(single, torch.full_like(std, single_std), std)
    return mean, std, count


def _out_dtype(scores: torch.Tensor) -> torch.dtype:
    return scores.dtype if scores.is_floating_point() else torch.float32


def _finite(what: str, **values: float) -> None:
    """``InvalidInput`` for a NaN/inf setting of an advantage (it would poison the loss silently;
    ``group_mean_std`` itself accepts NaN fill values as markers of single-member groups)."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InvalidInput(f"{what}: {name}={v!r} must be a finite number")


@checked
def group_mean_std(
    scores: torch.Tensor, group_ids: GroupIds, *, single_mean: float = 0.0, single_std: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, Bessel-corrected std and size of each group, groups in order of first appearance.

    ``scores [N]``; ``group_ids``: ``N`` hashable labels (ints, strings, tuples, ...) or a 1-d integer
    tensor. Returns ``(mean [G], std [G], count [G] int64)``; mean/std have the float dtype of
    ``scores`` (fp32 for integer scores) and are computed in float64. A single-member group gets
    ``single_mean``/``single_std`` (0 and 1). Empty input gives empty outputs. Raises ``InvalidInput``
    when the lengths differ or a label is unhashable.
    """
    _check(scores, len(group_ids), "group_mean_std")
    index, groups = group_ids_to_index(group_ids, scores.device)
    mean, std, count = _stats(scores, index, groups, single_mean, single_std)
    return mean.to(_out_dtype(scores)), std.to(_out_dtype(scores)), count


@checked
def group_normalize(
    scores: torch.Tensor,
    group_ids: GroupIds,
    eps: float = 1e-6,
    scale: bool = True,
    *,
    single_mean: float = 0.0,
    single_std: float = 1.0,
) -> torch.Tensor:
    """Per-item group-relative advantage ``(score - mean_g) / (std_g + eps)`` (``score - mean_g`` when
    ``scale=False``), ``[N]`` in the float dtype of ``scores``; stats as in ``group_mean_std``.

    Raises ``InvalidInput`` for ``eps < 0`` or mismatched lengths.
    """
    _finite("group_normalize", eps=eps, single_mean=single_mean, single_std=single_std)
    if eps < 0:
        raise InvalidInput(f"group_normalize: eps={eps} must be >= 0")
    _check(scores, len(group_ids), "group_normalize")
    index, groups = group_ids_to_index(group_ids, scores.device)
    mean, std, _ = _stats(scores, index, groups, single_mean, single_std)
    adv = scores.to(torch.float64) - mean[index]
    if scale:
        adv = adv / (std[index] + eps)
    return adv.to(_out_dtype(scores))
