"""Statistics reduced over a ``torch.distributed`` process group (every rank gets the same result)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from underlay.interfaces import InvalidInput
from underlay.ops._checks import checked

__all__ = ["collective_device", "distributed_masked_mean", "distributed_mean_max_min_std"]


def collective_device(group: Any | None = None) -> torch.device:
    """Device on which tensors for collectives over ``group`` must live.

    ``cpu`` for gloo groups; otherwise the current accelerator device (``torch.accelerator``), which
    the caller selected with ``Device.set_device``. Raises ``InvalidInput`` when torch.distributed is
    not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInput(
            "a process group was given but torch.distributed is not initialised; call "
            "init_process_group first or pass group=None"
        )
    if str(dist.get_backend(group)).lower() == "gloo":
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    if acc is None:
        return torch.device("cpu")
    return torch.device(acc.type, torch.accelerator.current_device_index())


def _keep(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return torch.ones_like(x, dtype=torch.bool)
    if mask.shape != x.shape:
        raise InvalidInput(f"mask shape {tuple(mask.shape)} must equal x shape {tuple(x.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """Result dtype of the summaries: fp64 for fp64 input (no silent downcast), fp32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _reduce(t: torch.Tensor, op: Any, group: Any | None) -> torch.Tensor:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return t
    dev = collective_device(group)
    moved = t.to(dev)
    dist.all_reduce(moved, op=op, group=group)
    return moved.to(t.device)


@checked
def distributed_masked_mean(x: torch.Tensor, mask: torch.Tensor, group: Any | None = None) -> torch.Tensor:
    """Mean of the kept elements of ``x`` over all ranks of ``group`` (a 0-d fp32 tensor on x's device,
    fp64 when ``x`` is fp64).

    Each rank contributes its masked sum and count (one all-reduce of two fp64 numbers); masked-out
    NaNs do not leak. ``group=None`` uses the default group when torch.distributed is initialised and
    is a plain ``masked_mean`` otherwise. 0 when no rank keeps an element.
    """
    keep = _keep(x, mask)
    xf = x.to(torch.float64)
    local = torch.stack([torch.where(keep, xf, torch.zeros_like(xf)).sum(), keep.sum().to(torch.float64)])
    total = _reduce(local, dist.ReduceOp.SUM, group)
    mean = torch.where(total[1] > 0, total[0] / total[1].clamp_min(1), torch.zeros_like(total[0]))
    return mean.to(_out_dtype(x))


@checked
def distributed_mean_max_min_std(
    x: torch.Tensor, group: Any | None = None, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, max, min, std)`` of all (kept) elements of ``x`` on every rank of ``group``.

    0-d fp32 tensors on x's device (fp64 when ``x`` is fp64); ``std`` is unbiased (``n - 1``; 0 when ``n < 2``). Three
    all-reduces (sums, extremes, squared deviations from the global mean) in fp64. A rank may hold no
    elements. Raises ``InvalidInput`` (on every rank) when no rank holds an element.
    """
    keep = _keep(x, mask)
    xf = x.to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=x.device)
    sums = _reduce(
        torch.stack([torch.where(keep, xf, zero).sum(), keep.sum().to(torch.float64)]),
        dist.ReduceOp.SUM,
        group,
    )
    n = sums[1]
    if float(n.item()) == 0:
        raise InvalidInput("distributed_mean_max_min_std: no rank holds an element; nothing to summarise")
    mean = sums[0] / n
    ext = torch.stack(
        [
            torch.where(keep, xf, -inf).max() if x.numel() else -inf,
            (-torch.where(keep, xf, inf)).max() if x.numel() else -inf,
        ]
    )
    ext = _reduce(ext, dist.ReduceOp.MAX, group)
    dev = torch.where(keep, xf - mean, zero)
    ss = _reduce((dev * dev).sum().reshape(1), dist.ReduceOp.SUM, group)[0]
    std = torch.where(n > 1, torch.sqrt(ss / (n - 1).clamp_min(1)), zero)
    f = _out_dtype(x)
    return mean.to(f), ext[0].to(f), (-ext[1]).to(f), std.to(f)
