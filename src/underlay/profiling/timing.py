"""Wall-clock timers that synchronise the device, and their reduction across ranks."""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from underlay.interfaces import Device, InvalidInput
from underlay.ops import collective_device
from underlay.registry import get_device

__all__ = ["reduce_timings", "timer"]


def _resolve(device: Device | None) -> Device:
    return get_device() if device is None else device


@contextmanager
def timer(name: str, into: MutableMapping[str, float], device: Device | None = None) -> Iterator[None]:
    """Time the body in seconds and add it to ``into[name]`` (created at 0.0 when missing).

    The device (default: the registry-selected one) is synchronised before the clock starts and before
    it stops, so queued accelerator work is inside the measurement. The time is added even when the
    body raises. Raises ``InvalidInput`` for an empty ``name`` or an ``into`` that is not a mutable
    mapping.
    """
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"timer(name={name!r}): name must be a non-empty str")
    if not isinstance(into, MutableMapping):
        raise InvalidInput(
            f"timer({name!r}, into=...): into must be a mutable mapping, got {type(into).__name__}"
        )
    dev = _resolve(device)
    dev.synchronize()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dev.synchronize()
        into[name] = float(into.get(name, 0.0)) + (time.perf_counter() - t0)


def _values(metrics: Mapping[str, Any]) -> tuple[list[str], list[float]]:
    if not isinstance(metrics, Mapping):
        raise InvalidInput(
            f"reduce_timings: metrics must be a mapping of name -> seconds, got {type(metrics).__name__}"
        )
    keys = sorted(metrics)
    values: list[float] = []
    for k in keys:
        if not isinstance(k, str):
            raise InvalidInput(f"reduce_timings: metric name {k!r} is not a str")
        v = metrics[k]
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InvalidInput(f"reduce_timings: metrics[{k!r}]={v!r} must be a finite number of seconds")
        values.append(float(v))
    return keys, values


def reduce_timings(metrics: Mapping[str, Any], group: Any | None = None) -> dict[str, float]:
    """Max, mean and min of every timing across the ranks of ``group`` (default: the world).

    ``metrics`` maps a name to seconds (a number or a one-element tensor). Returns
    ``{f"{name}/max", f"{name}/mean", f"{name}/min"}`` for every name. Without an initialised process
    group the three equal the local value. Collective: every rank of ``group`` must call it with the same
    names; differing names raise ``InvalidInput`` on every rank (checked by one small collective before
    the values are reduced). Tensors live on ``underlay.ops.collective_device(group)``.
    """
    keys, values = _values(metrics)
    if not (dist.is_available() and dist.is_initialized()):
        return {f"{k}/{s}": v for k, v in zip(keys, values) for s in ("max", "mean", "min")}
    where = collective_device(group)
    size = dist.get_world_size(group)
    crc = float(zlib.crc32("\0".join(keys).encode()))
    header = torch.tensor([len(keys), crc, -len(keys), -crc], dtype=torch.float64, device=where)
    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group)
    h = header.tolist()
    if h[0] != -h[2] or h[1] != -h[3]:
        raise InvalidInput(
            f"reduce_timings: ranks hold different timing names (this rank: {keys}); time the same "
            "names on every rank of the group, or reduce over a group whose ranks do"
        )
    if not keys:
        return {}
    vals = torch.tensor(values, dtype=torch.float64, device=where)
    extremes = torch.cat([vals, -vals])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    total = vals.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    n = len(keys)
    mx, mn, mean = extremes[:n].tolist(), (-extremes[n:]).tolist(), (total / size).tolist()
    out: dict[str, float] = {}
    for i, k in enumerate(keys):
        out[f"{k}/max"], out[f"{k}/mean"], out[f"{k}/min"] = mx[i], mean[i], mn[i]
    return out
