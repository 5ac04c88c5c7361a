"""Collective success: operations that some ranks do alone (rank 0 writing files) fail on every rank.

A rank-0-only file write that fails must not leave the other ranks waiting in the next collective
until the process-group timeout. The pattern is::

    error = None
    if rank == 0:
        try:
            write()
        except Exception as exc:
            error = exc
    agree(error is None, describe(error), what="export_hf", error_type=CheckpointError, cause=error)

``agree`` is one small all-reduce on success and one gather of the reasons on failure.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from underlay.interfaces import UnderlayError

__all__ = ["agree", "agreed", "collective_device", "describe", "shared_failure"]


def describe(error: BaseException | None) -> str:
    """``"Type: message"`` of ``error`` (``""`` for ``None``): the reason ``agree`` reports (``repr``
    of an ``OSError`` drops the file name its message carries)."""
    return "" if error is None else f"{type(error).__name__}: {error}"


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor must live for a collective on ``group`` (default: the world): host memory for
    gloo, the current accelerator otherwise (nccl/hccl only move device tensors). Needs an
    initialised process group."""
    backend = str(dist.get_backend(group))
    if backend == "gloo" or "gloo" in backend.split(","):
        return torch.device("cpu")
    from underlay.registry import get_device

    dev = get_device()
    return dev.torch_device(dev.current_index())


def agree(
    ok: bool,
    reason: str = "",
    *,
    what: str = "collective operation",
    group: Any = None,
    error_type: type[UnderlayError] = UnderlayError,
    cause: BaseException | None = None,
) -> None:
    """Agree across the ranks of ``group`` (default: the world) that ``what`` succeeded everywhere.

    Every rank calls it with its own ``ok``. When all are ``True`` it returns (one all-reduce of one
    int). When any is ``False``, EVERY rank raises ``error_type`` with the failing ranks and the first
    failing rank's ``reason`` (rank 0's when it failed), chained to this rank's ``cause`` when given.
    Without a process group it raises (or returns) on this rank alone. Collective: every rank of
    ``group`` must call it, in the same order as its other collectives.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if not ok:
            raise error_type(f"{what} failed: {reason or 'no reason given'}") from cause
        return
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
    failed = int(flag.item())
    if failed == 0:
        return
    reasons: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, None if ok else (dist.get_rank(), reason), group=group)
    bad = [r for r in reasons if r is not None]
    first_rank, first_reason = bad[0]
    others = f" (and ranks {[r for r, _ in bad[1:]]})" if len(bad) > 1 else ""
    raise error_type(
        f"{what} failed on rank {first_rank}{others}: {first_reason or 'no reason given'}"
    ) from cause


@contextlib.contextmanager
def agreed(
    what: str, *, group: Any = None, error_type: type[UnderlayError] = UnderlayError
) -> Iterator[None]:
    """Run the block on every rank, hold any ``Exception`` it raises, then ``agree`` on the outcome:
    every rank leaves together, all normally or all raising ``error_type`` with the failing ranks'
    reasons (the local exception as the cause). For blocks only some ranks act in, put the rank test
    inside the ``with``."""
    error: BaseException | None = None
    try:
        yield
    except Exception as exc:
        error = exc
    agree(error is None, describe(error), what=what, group=group, error_type=error_type, cause=error)


def shared_failure(
    error: Exception | None, *, what: str, where: str = "", group: Any = None
) -> Exception | None:
    """After a phase that every rank of ``group`` (default: the world) ran to its end while holding any
    ``Exception`` it caught (``error``, ``None`` when it had none): ``None`` when no rank failed (one
    all-reduce of one int), else the exception this rank must raise, the same on every rank.

    A failing rank gets its own ``error`` back (its traceback intact). Every other rank gets the first
    failing rank's (lowest rank number) exception, sent pickled and rebuilt here, with a note naming
    that rank and ``where`` it was (e.g. ``"pipeline stage 1 of 2"``, that rank's own value); if the
    exception cannot be pickled or rebuilt (arguments its class cannot take back), an ``UnderlayError``
    whose message holds its type and text. So ``except SomeType`` catches on every rank alike.

    Collective over ``group`` (the same order as the ranks' other collectives); without an initialised
    process group (or a group of one) it returns ``error``. The caller raises the result after
    restoring its state (``raise result``)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return error
    none = 1 << 62
    first = torch.tensor(
        [none if error is None else dist.get_rank()], dtype=torch.int64, device=collective_device(group)
    )
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    src = int(first.item())
    if src == none:
        return None
    box: list[Any] = [None]
    if dist.get_rank() == src:
        assert error is not None
        try:
            payload: bytes | None = pickle.dumps(error)
        except Exception:  # an argument that does not pickle: the peers get the text
            payload = None
        box = [(payload, describe(error), where)]
    dist.broadcast_object_list(box, src=src, group=group)
    if error is not None:
        return error
    payload, text, there = box[0]
    place = f"rank {src}" + (f" ({there})" if there else "")
    rebuilt: Exception | None = None
    if payload is not None:
        try:
            got = pickle.loads(payload)
            rebuilt = got if isinstance(got, Exception) else None
        except Exception:  # a class whose __init__ does not take its args back
            rebuilt = None
    if rebuilt is None:
        return UnderlayError(f"{what} failed on {place}: {text}; this rank raises it too")
    # ``add_note`` (Python >= 3.11) shows in the traceback; the same list on 3.10
    notes = list(getattr(rebuilt, "__notes__", []))
    notes.append(f"{what}: raised on {place}, not on this rank; every rank raises it")
    setattr(rebuilt, "__notes__", notes)  # noqa: B010 (no attribute of Exception on 3.10)
    return rebuilt
