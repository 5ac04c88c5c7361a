"""The engine side of loss contract v3, shared by every engine: ``loss_fn`` signature check, global
loss-token / sequence counts and the per-micro-batch ``LossContext``, validation of what a ``loss_fn``
returns, and the reduction of its metrics over micro-batches and data-parallel ranks.

An engine calls, in ``forward_backward``: :func:`check_loss_fn` before any compute; :func:`count_loss`
once (one all-reduce over the data-parallel group); per micro-batch ``counts.context(...)``,
``loss_fn(outputs, micro_batch, ctx)``, :func:`checked_loss` and ``reducer.add``; and at the end
``reducer.reduce`` (identical results on every rank of the group). It backpropagates the contribution
so that gradients *sum* over micro-batches and data-parallel ranks (compensating its own averaging).
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from underlay.interfaces import InvalidInput, LossContext, Metric

__all__ = ["LossCounts", "MetricReducer", "check_loss_fn", "checked_loss", "count_loss"]

V3_SIGNATURE = (
    "loss_fn(outputs: TokenOutputs, batch: TokenBatch, ctx: LossContext) -> "
    "tuple[torch.Tensor, Mapping[str, Metric | torch.Tensor | float]]"
)


def check_loss_fn(loss_fn: Callable[..., Any]) -> None:
    """``InvalidInput`` naming the v3 signature unless ``loss_fn`` is callable with three positional
    arguments ``(outputs, batch, ctx)``. Callables whose signature cannot be inspected pass."""
    if not callable(loss_fn):
        raise InvalidInput(f"loss_fn is {type(loss_fn).__name__}, not callable; give {V3_SIGNATURE}")
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, None, None)
    except TypeError as exc:
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        raise InvalidInput(
            f"loss_fn {name}{sig} does not take (outputs, batch, ctx): loss contract v3 is {V3_SIGNATURE}, "
            "returning this micro-batch's contribution (e.g. ops.aggregate_loss(per_token, "
            "batch.loss_mask, 'token-mean', ctx) for the old 'token sum' loss_fn)"
        ) from exc


@dataclass(frozen=True)
class LossCounts:
    """Loss-token and sequence counts of one ``forward_backward``: the global ones (every rank's
    shard) and this rank's per row (``row_tokens[i]``: loss tokens of row ``i`` of its shard)."""

    global_tokens: int
    global_sequences: int
    dp_size: int
    row_tokens: tuple[int, ...]

    def context(
        self,
        micro_batch: int,
        num_micro_batches: int,
        rows: Sequence[int],
        loss_mask: torch.Tensor | None = None,
    ) -> LossContext:
        """The ``LossContext`` of micro-batch ``micro_batch`` (of ``num_micro_batches`` on this rank),
        made of the rows ``rows`` of this rank's shard; ``loss_mask``: the micro-batch's
        ``batch.loss_mask`` tensor handed to the ``loss_fn`` (checked by the engine)."""
        tokens = [self.row_tokens[r] for r in rows]
        return LossContext(
            global_loss_tokens=self.global_tokens,
            global_sequences=self.global_sequences,
            dp_size=self.dp_size,
            micro_batch=micro_batch,
            num_micro_batches=num_micro_batches,
            local_loss_tokens=sum(tokens),
            local_sequences=sum(1 for t in tokens if t > 0),
            loss_mask=loss_mask,
        )


def count_loss(loss_mask: torch.Tensor, group: Any, dp_size: int, device: torch.device) -> LossCounts:
    """Count this rank's loss tokens per row and the global loss tokens and sequences (rows with at
    least one loss token) over ``group`` (the data-parallel group, one rank per data shard; ``None``
    or ``dp_size == 1``: this rank alone). One all-reduce and one read back to the host."""
    per_row = (loss_mask != 0).sum(dim=1).to(device=device, dtype=torch.float64)
    totals = torch.stack([per_row.sum(), (per_row > 0).sum().to(torch.float64)])
    if group is not None and dp_size > 1:
        dist.all_reduce(totals, group=group)
    values = torch.cat([totals, per_row]).tolist()
    return LossCounts(int(values[0]), int(values[1]), dp_size, tuple(int(v) for v in values[2:]))


def checked_loss(result: Any) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Validate what a ``loss_fn`` returned, before backward: ``(contribution, metrics)`` with
    ``contribution`` a floating 0-dim tensor attached to the graph and every metric a ``Metric`` or a
    number / one-element tensor (taken as ``Metric(value, "sum")``), not named ``"loss"`` (the engine
    reports the sum of the contributions under it). ``InvalidInput`` naming the problem."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise InvalidInput(
            f"loss_fn returned {type(result).__name__}; return a tuple (contribution, metrics)"
        )
    loss, metrics = result
    if not isinstance(loss, torch.Tensor):
        raise InvalidInput(
            f"loss_fn returned the loss as {type(loss).__name__} ({loss!r}); return a scalar "
            "tensor computed from outputs so that it has a gradient"
        )
    if loss.dim() != 0:
        raise InvalidInput(f"loss_fn returned a loss of shape {tuple(loss.shape)}; return a scalar")
    if not loss.is_floating_point():
        raise InvalidInput(f"loss_fn returned a loss of dtype {loss.dtype}; return a float tensor")
    if not loss.requires_grad:
        raise InvalidInput(
            "loss_fn returned a loss without a graph (requires_grad=False: detached, computed "
            "under no_grad, or not from outputs); compute it from the outputs tensors"
        )
    if not isinstance(metrics, Mapping):
        raise InvalidInput(f"loss_fn returned metrics as {type(metrics).__name__}; return a dict")
    out: dict[str, Metric] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or key == "loss":
            raise InvalidInput(
                f"loss_fn metric name {key!r}: use a str other than 'loss' (the engine reports the loss)"
            )
        if isinstance(value, Metric):
            out[key] = value
            continue
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise InvalidInput(
                    f"loss_fn metric {key!r} has shape {tuple(value.shape)}; metrics are scalars"
                )
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInput(
                f"loss_fn metric {key!r} is {type(value).__name__}; give a Metric, a number or a "
                "one-element tensor"
            )
        out[key] = Metric(value, "sum")
    return loss, out


class MetricReducer:
    """Accumulates ``"loss"`` (the contributions, a sum) and the metrics of every ``loss_fn`` call on
    this rank, and reduces them over the data-parallel group as each was declared: ``"sum"``,
    ``"mean"`` (unweighted over every call of every rank), ``"max"``, ``"min"``."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._values: dict[str, torch.Tensor] = {}
        self._reduce: dict[str, str] = {}
        self._calls: dict[str, int] = {}

    def add(self, loss: torch.Tensor, metrics: Mapping[str, Metric]) -> None:
        """Record one call's contribution and metrics; ``InvalidInput`` when a metric changes its
        ``reduce`` between calls."""
        self._add("loss", Metric(loss.detach(), "sum"))
        for key, metric in metrics.items():
            self._add(key, metric)

    def _add(self, key: str, metric: Metric) -> None:
        value = metric.value
        if isinstance(value, torch.Tensor):
            v = value.detach().to(device=self._device, dtype=torch.float64).reshape(())
        else:  # a device fill, not a host->device copy that would wait
            v = torch.full((), float(value), dtype=torch.float64, device=self._device)
        if key not in self._values:
            self._values[key], self._reduce[key], self._calls[key] = v, metric.reduce, 1
            return
        if self._reduce[key] != metric.reduce:
            raise InvalidInput(
                f"loss_fn metric {key!r} changed its reduce from {self._reduce[key]!r} to "
                f"{metric.reduce!r} between micro-batches; declare one"
            )
        old = self._values[key]
        reduce = metric.reduce
        self._values[key] = (
            torch.maximum(old, v)
            if reduce == "max"
            else torch.minimum(old, v)
            if reduce == "min"
            else old + v
        )
        self._calls[key] += 1

    def local(self) -> dict[str, torch.Tensor]:
        """This rank's accumulated values before the reduction (device scalars, by metric name)."""
        return dict(self._values)

    def reduce(self, group: Any, dp_size: int) -> dict[str, float]:
        """The reduced metrics over ``group`` (``None`` or ``dp_size == 1``: this rank alone), as
        Python floats, identical on every rank of the group. Collective: every rank of ``group`` calls
        it with the same metric names and reductions, else ``InvalidInput`` on every rank (names
        compared through a checksum, one small all-reduce first)."""
        keys = sorted(self._values)
        spread = group is not None and dp_size > 1
        if spread:
            sig = ";".join(f"{k}:{self._reduce[k]}" for k in keys)
            crc = float(zlib.crc32(sig.encode()))
            check = torch.tensor([crc, -crc], dtype=torch.float64, device=self._device)
            dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
            if check[0].item() != -check[1].item():
                raise InvalidInput(
                    f"loss_fn metrics differ between data-parallel ranks (this rank: "
                    f"{[(k, self._reduce[k]) for k in keys]}); return the same names and reduces on "
                    "every rank and micro-batch"
                )
        summed = [k for k in keys if self._reduce[k] in ("sum", "mean")]
        extreme = [k for k in keys if self._reduce[k] in ("max", "min")]
        zero = torch.zeros((), dtype=torch.float64, device=self._device)
        sums = [self._values[k] for k in summed]
        sums += [zero + self._calls[k] for k in summed if self._reduce[k] == "mean"]
        sum_t = torch.stack(sums) if sums else zero.reshape(1)[:0]
        max_t = (
            torch.stack([self._values[k] if self._reduce[k] == "max" else -self._values[k] for k in extreme])
            if extreme
            else zero.reshape(1)[:0]
        )
        if spread:
            if sums:
                dist.all_reduce(sum_t, group=group)
            if extreme:
                dist.all_reduce(max_t, op=dist.ReduceOp.MAX, group=group)
        flat = torch.cat([sum_t, max_t]).tolist()
        n_sum = len(summed)
        means = iter(flat[n_sum : len(sums)])
        out: dict[str, float] = {}
        for k, v in zip(summed, flat[:n_sum]):
            out[k] = v / next(means) if self._reduce[k] == "mean" else v
        for k, v in zip(extreme, flat[len(sums) :]):
            out[k] = v if self._reduce[k] == "max" else -v
        return {k: out[k] for k in keys}
