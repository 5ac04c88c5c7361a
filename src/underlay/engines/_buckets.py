"""The ``iter_weights`` bucketing rule every engine shares (contract v2, item 4)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

import torch

from underlay.interfaces import InvalidInput
from underlay.parallel.rank import current_rank

__all__ = ["bucket_full_tensors", "check_bucket_args", "check_byte_count"]


def check_byte_count(value: object, what: str, minimum: int = 1) -> int:
    """``value`` when it is an int ``>= minimum`` (a bool is not); ``InvalidInput`` naming ``what``
    (e.g. ``"FSDP2WeightLoader: load_bucket_bytes"``) otherwise. For the byte sizes of buckets and
    buffers that every engine's loaders take."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInput(f"{what}={value!r} must be an int >= {minimum}")
    return value


def check_bucket_args(bucket_bytes: object, ranks: Collection[int] | None, world_size: int) -> bool:
    """Validate ``iter_weights``' arguments before any collective and say whether this rank receives
    tensors. ``InvalidInput`` for a ``bucket_bytes`` that is not an int >= 1 (a bool is not) or a rank
    outside ``[0, world_size)``."""
    check_byte_count(bucket_bytes, "iter_weights: bucket_bytes")
    if ranks is None:
        return True
    receivers = set(ranks)
    bad = sorted(
        r for r in receivers if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size
    )
    if bad:
        raise InvalidInput(
            f"iter_weights: ranks {bad} are not global ranks in [0, {world_size}); pass global ranks"
        )
    return current_rank() in receivers


def bucket_full_tensors(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype, receive: bool
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, full tensor)`` pairs, cast to ``dtype``, into buckets of about ``bucket_bytes`` (a
    larger tensor gets a bucket of its own). Boundaries depend on shapes only, so every rank yields the
    same number of buckets; a rank with ``receive=False`` yields empty lists and holds no tensor beyond
    the one being iterated. ``named`` is consumed to the end on every rank (it is usually collective)."""
    elem = torch.empty((), dtype=dtype).element_size()
    bucket: list[tuple[str, torch.Tensor]] = []
    size, count = 0, 0  # of the open bucket, counted alike on every rank
    for name, full in named:
        nbytes = full.numel() * elem
        if count and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size, count = [], 0, 0
        if receive:
            bucket.append((name, full.to(dtype)))
        del full
        size += nbytes
        count += 1
    if count:
        yield bucket
