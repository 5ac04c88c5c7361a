"""Sequence-length balancing: k-way number partitioning for data-parallel ranks and micro-batches.

``karmarkar_karp`` is the largest differencing method (LDM) generalised to k ways: every item starts as
a k-tuple of subsets, the two tuples with the largest spread (max - min sum) are merged by pairing the
heaviest subset of one with the lightest of the other, until one tuple is left. Subsets are kept sparse
(a tuple of fewer than k non-empty subsets is padded with empty ones only when needed) and member lists
are trees flattened once at the end, so 8192 items into 64 ways take milliseconds.
"""

from __future__ import annotations

import bisect
import heapq
import math
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from underlay.interfaces import InvalidInput
from underlay.ops._checks import checked

__all__ = [
    "ATTENTION_WORKLOAD_A",
    "balanced_group_partitions",
    "balanced_partitions",
    "greedy_lpt",
    "karmarkar_karp",
    "partition_loads",
    "plan_micro_batches",
    "restore_order",
]

# ``a`` of the workload model ``a * s + s**2``: the ratio of the per-token linear FLOPs (6 N) to the
# per-token-pair causal attention FLOPs (6 L H D, see ops.flops) of a Llama-2-7B-class model
# (N = 6.74e9 parameters, L = 32 layers, H * D = 4096).
ATTENTION_WORKLOAD_A = 6.74e9 / (32 * 4096)

Workload = str | Callable[[float], float]


def _validate(weights: Sequence[float], k: int, equal_size: bool, what: str) -> list[float]:
    if not isinstance(k, int) or k < 1:
        raise InvalidInput(f"{what}: k={k!r} must be an int >= 1")
    w = [float(x) for x in weights]
    n = len(w)
    if k > n:
        raise InvalidInput(f"{what}: k={k} partitions but only {n} items; lower k or add items")
    if equal_size and n % k:
        raise InvalidInput(
            f"{what}: equal_size=True needs k to divide the item count, but {n} % {k} = {n % k}; "
            "pad the batch or use equal_size=False"
        )
    if min(w) < 0 or not math.isfinite(sum(w)):  # a sum of values >= 0 is finite iff all are
        bad = next(x for x in w if not math.isfinite(x) or x < 0)
        raise InvalidInput(f"{what}: weight {bad} is negative or not finite; weights are sizes >= 0")
    return w


_CHUNKED_INIT = 16  # above n = 16 k items, tuples start as runs of k consecutive sorted items
_REFINE_ROUNDS = 8  # improvement rounds per partition after differencing


def _ldm(w: list[float], k: int, equal_size: bool) -> list[list[int]]:
    """Largest differencing method.

    With ``equal_size`` (or more than ``16 k`` items) the initial tuples are runs of ``k`` consecutive
    items in sorted order, one item per subset; this is what item-wise differencing builds first when
    items dominate the differences, and it bounds the merges to ``n / k``. Counts then stay equal.

    A k-tuple is two parallel lists, subset sums ascending and their nodes. Node ``i < n`` is item
    ``i``, node ``n + j`` is the pair ``(left[j], right[j])`` and ``-1`` is an empty subset; absent
    entries of a sparse tuple are empty subsets of sum 0 (lighter than any other).
    """
    n = len(w)
    left: list[int] = []
    right: list[int] = []
    heap: list[tuple[float, int, list[float], list[int]]] = []
    if equal_size or n > _CHUNKED_INIT * k:
        order = sorted(range(n), key=w.__getitem__)
        for start in range(0, n, k):
            nodes = order[start : start + k]
            sums = [w[i] for i in nodes]
            low = sums[0] if len(sums) == k else 0.0
            heap.append((low - sums[-1], start, sums, nodes))
    else:
        heap = [(-x, i, [x], [i]) for i, x in enumerate(w)]
    heapq.heapify(heap)
    counter = n
    zeros = [0.0] * k
    empties = [-1] * k
    while len(heap) > 1:
        _, _, sa, na = heapq.heappop(heap)
        _, _, sb, nb = heapq.heappop(heap)
        if len(sa) + len(sb) <= k:
            # no pairing needed: the union, kept sorted
            if len(sb) > len(sa):
                sa, na, sb, nb = sb, nb, sa, na
            if len(sb) <= 2:
                sums, nodes = sa[:], na[:]
                for x, node in zip(sb, nb):
                    pos = bisect.bisect_right(sums, x)
                    sums.insert(pos, x)
                    nodes.insert(pos, node)
            else:
                cat_s, cat_n = sa + sb, na + nb
                order = sorted(range(len(cat_s)), key=cat_s.__getitem__)
                sums = list(map(cat_s.__getitem__, order))
                nodes = list(map(cat_n.__getitem__, order))
        else:
            # lightest subset of one tuple with the heaviest of the other
            fa, fna = zeros[: k - len(sa)] + sa, empties[: k - len(na)] + na
            fb, fnb = zeros[: k - len(sb)] + sb, empties[: k - len(nb)] + nb
            fb.reverse()
            fnb.reverse()
            paired = list(map(operator.add, fa, fb))
            order = sorted(range(k), key=paired.__getitem__)
            sums = list(map(paired.__getitem__, order))
            base = n + len(left)
            left.extend(fna)
            right.extend(fnb)
            nodes = list(map(base.__add__, order))
        low = sums[0] if len(sums) == k else 0.0
        heapq.heappush(heap, (low - sums[-1], counter, sums, nodes))
        counter += 1
    final_nodes = heap[0][3]
    parts: list[list[int]] = []
    for root in final_nodes:
        members: list[int] = []
        stack = [root]
        while stack:
            cur = stack.pop()
            if cur < 0:
                continue
            if cur < n:
                members.append(cur)
            else:
                stack.append(left[cur - n])
                stack.append(right[cur - n])
        parts.append(sorted(members))
    parts.extend([] for _ in range(k - len(parts)))
    return parts


def _refine(w: list[float], parts: list[list[int]], allow_moves: bool) -> list[list[int]]:
    """Local improvement: repeatedly move one item (``allow_moves``) or swap two between the heaviest
    and the lightest partition, choosing the transfer closest to half their difference."""
    import numpy as np

    k = len(parts)
    if k < 2:
        return parts
    weights = np.asarray(w, dtype=np.float64)
    members = [np.asarray(p, dtype=np.int64) for p in parts]
    loads = np.array([weights[m].sum() for m in members])
    for _ in range(_REFINE_ROUNDS * k):
        hi, lo = int(loads.argmax()), int(loads.argmin())
        diff = loads[hi] - loads[lo]
        if diff <= 0:
            break
        wh, wl = weights[members[hi]], weights[members[lo]]
        best, best_gap, move = None, diff, None  # gap = |diff - 2 * delta| must drop below diff
        if allow_moves and wh.size > 1:
            gaps = np.abs(diff - 2 * wh)
            j = int(gaps.argmin())
            if 0 < wh[j] < diff and gaps[j] < best_gap:
                best, best_gap, move = (j, -1), float(gaps[j]), wh[j]
        if wl.size:
            order = np.argsort(wl)
            sl = wl[order]
            target = wh - diff / 2  # want wl close to wh - diff / 2
            pos = (
                np.clip(np.searchsorted(sl, target), 1, sl.size - 1)
                if sl.size > 1
                else np.zeros_like(target, dtype=np.int64)
            )
            for cand in (pos - 1, pos) if sl.size > 1 else (pos,):
                delta = wh - sl[cand]
                gaps = np.where((delta > 0) & (delta < diff), np.abs(diff - 2 * delta), np.inf)
                j = int(gaps.argmin())
                if gaps[j] < best_gap:
                    best, best_gap, move = (j, int(order[cand[j]])), float(gaps[j]), delta[j]
        if best is None or move is None:
            break
        j, i_lo = best
        a = members[hi][j]
        members[hi] = np.delete(members[hi], j)
        if i_lo >= 0:
            b = members[lo][i_lo]
            members[lo] = np.delete(members[lo], i_lo)
            members[hi] = np.append(members[hi], b)
        members[lo] = np.append(members[lo], a)
        loads[hi] -= move
        loads[lo] += move
    return [sorted(m.tolist()) for m in members]


def _lpt(w: list[float], k: int, equal_size: bool) -> list[list[int]]:
    cap = len(w) // k if equal_size else len(w)
    heap = [(0.0, j) for j in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    order = sorted(range(len(w)), key=w.__getitem__, reverse=True)
    if cap == len(w):  # unbounded bins: the lightest bin always takes the next item
        for i in order:
            load, j = heap[0]
            parts[j].append(i)
            heapq.heapreplace(heap, (load + w[i], j))
    else:
        for i in order:
            load, j = heapq.heappop(heap)
            parts[j].append(i)
            if len(parts[j]) < cap:
                heapq.heappush(heap, (load + w[i], j))
    return [sorted(p) for p in parts]


@checked
def partition_loads(weights: Sequence[float], partitions: Sequence[Sequence[int]]) -> list[float]:
    """Sum of ``weights`` in each partition (for quality checks and logging); ``InvalidInput`` for an
    index outside ``[0, len(weights))``."""
    n = len(weights)
    bad = [i for p in partitions for i in p if not 0 <= int(i) < n]
    if bad:
        raise InvalidInput(f"partition_loads: indices {bad[:5]} outside [0, {n}) of weights")
    get = weights.__getitem__
    return [float(sum(map(get, p))) for p in partitions]


def _max_load(w: list[float], parts: list[list[int]]) -> float:
    return max(partition_loads(w, parts)) if parts else 0.0


@checked
def greedy_lpt(weights: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Longest-processing-time greedy: heaviest item first into the lightest partition.

    ``weights`` are sizes >= 0; returns ``k`` index lists (each sorted ascending) that together hold
    every index once. With ``equal_size`` every partition gets ``n / k`` items. Raises
    ``InvalidInput`` when ``k < 1``, ``k > n``, ``equal_size`` and ``k`` does not divide ``n``, or a
    weight is negative/non-finite.
    """
    w = _validate(weights, k, equal_size, "greedy_lpt")
    return _lpt(w, k, equal_size)


@checked
def karmarkar_karp(weights: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """k-way Karmarkar-Karp (largest differencing method) partition of ``weights`` into ``k`` parts.

    Returns ``k`` index lists (sorted ascending, in no particular order among themselves) covering
    every index once; with ``equal_size`` each holds ``n / k`` items. The greedy LPT partition is also
    computed and returned instead when its maximum load is lower, so the result is never worse than
    ``greedy_lpt``. Errors as in ``greedy_lpt``.
    """
    w = _validate(weights, k, equal_size, "karmarkar_karp")
    ldm = _refine(w, _ldm(w, k, equal_size), allow_moves=not equal_size)
    lpt = _lpt(w, k, equal_size)
    return lpt if _max_load(w, lpt) < _max_load(w, ldm) else ldm


def _workload_fn(workload: Workload) -> Callable[[float], float]:
    if callable(workload):
        return workload
    if workload == "linear":
        return lambda s: float(s)
    if workload == "attention":
        return lambda s: ATTENTION_WORKLOAD_A * s + float(s) * s
    raise InvalidInput(f"workload={workload!r}: use 'linear', 'attention' or a callable seqlen -> cost")


def _seqlens(seqlens: Sequence[int] | torch.Tensor, what: str) -> list[int]:
    values = seqlens.tolist() if isinstance(seqlens, torch.Tensor) else list(seqlens)
    out = []
    for s in values:
        # int(1.5) would silently plan 1 token for a 1.5-token "length": lengths are whole counts
        if isinstance(s, bool) or not (isinstance(s, int) or (isinstance(s, float) and s.is_integer())):
            raise InvalidInput(
                f"{what}: sequence length {s!r} is not a whole number; pass token counts (ints), e.g. "
                "attention_mask.sum(dim=1)"
            )
        out.append(int(s))
    if any(s < 0 for s in out):
        raise InvalidInput(f"{what}: sequence lengths must be >= 0, got {min(out)}")
    return out


@checked
def balanced_partitions(
    seqlens: Sequence[int] | torch.Tensor,
    k: int,
    equal_size: bool = False,
    workload: Workload = "attention",
) -> list[list[int]]:
    """Split sequences into ``k`` partitions (e.g. data-parallel ranks) of balanced compute.

    The cost of a sequence of length ``s`` is ``workload(s)``: ``"linear"`` = ``s``, ``"attention"`` =
    ``ATTENTION_WORKLOAD_A * s + s**2`` (7B-class linear + causal attention FLOPs), or a callable.
    Returns ``karmarkar_karp`` of the costs. Errors as in ``karmarkar_karp``.
    """
    fn = _workload_fn(workload)
    return karmarkar_karp([fn(s) for s in _seqlens(seqlens, "balanced_partitions")], k, equal_size)


def _split(parts: list[list[int]], lens: list[int], count: int) -> list[list[int]]:
    """Grow a valid partition to ``count`` parts by halving the fullest splittable part."""
    parts = [list(p) for p in parts]
    while len(parts) < count:
        splittable = [j for j, p in enumerate(parts) if len(p) > 1]
        if not splittable:
            parts.append([])
            continue
        j = max(splittable, key=lambda j: sum(lens[i] for i in parts[j]))
        halves = _lpt([float(lens[i]) for i in parts[j]], 2, False)
        parts[j : j + 1] = [[parts[j][i] for i in h] for h in halves]
    return parts


def _group_max(value: int, group: Any) -> int:
    import torch.distributed as dist

    from underlay.ops.distributed import collective_device

    t = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


@checked
def plan_micro_batches(
    seqlens: Sequence[int] | torch.Tensor,
    max_tokens: int,
    min_count: int = 1,
    group: Any | None = None,
    multiple_of: int = 1,
) -> list[list[int]]:
    """Group sequences into micro-batches of at most ``max_tokens`` real tokens each, balanced.

    The count is the smallest that fits (at least ``min_count`` and ``ceil(total / max_tokens)``),
    then the maximum over the ranks of ``group`` (a ``torch.distributed`` group; one all-reduce) so
    every rank runs the same number of micro-batches, then rounded up to a multiple of
    ``multiple_of``. Micro-batches are Karmarkar-Karp balanced by tokens, heaviest first, indices
    ascending inside each. When the count exceeds the number of sequences some micro-batches are
    empty. Raises ``InvalidInput`` when a sequence is longer than ``max_tokens`` or an argument is
    < 1.
    """
    lens = _seqlens(seqlens, "plan_micro_batches")
    for name, v in (("max_tokens", max_tokens), ("min_count", min_count), ("multiple_of", multiple_of)):
        if not isinstance(v, int) or v < 1:
            raise InvalidInput(f"plan_micro_batches: {name}={v!r} must be an int >= 1")
    if lens and max(lens) > max_tokens:
        longest = max(lens)
        raise InvalidInput(
            f"plan_micro_batches: sequence {lens.index(longest)} has {longest} tokens > max_tokens="
            f"{max_tokens}; raise max_tokens (micro_batch_max_tokens) or truncate the sequence"
        )
    n = len(lens)
    count = max(min_count, -(-sum(lens) // max_tokens), 1)
    local: list[list[int]] | None = None
    while True:
        local = _partition_tokens(lens, count)
        if _max_load([float(s) for s in lens], local) <= max_tokens:
            break
        count += 1
    if group is not None:
        count = _group_max(count, group)
    count = -(-count // multiple_of) * multiple_of
    final = _partition_tokens(lens, count) if count <= n else None
    if final is None or _max_load([float(s) for s in lens], final) > max_tokens:
        final = _split(local, lens, count)
    final.sort(key=lambda p: (-sum(lens[i] for i in p), p[:1]))
    return [sorted(p) for p in final]


def _partition_tokens(lens: list[int], count: int) -> list[list[int]]:
    n = len(lens)
    if count >= n:
        return [[i] for i in range(n)] + [[] for _ in range(count - n)]
    return karmarkar_karp([float(s) for s in lens], count)


@checked
def restore_order(micro_batches: Sequence[Sequence[int]]) -> list[int]:
    """Inverse permutation of the concatenated micro-batches.

    If ``flat = sum(micro_batches, [])`` then ``outputs_in_flat_order[restore_order(...)]`` is in the
    original order, i.e. ``result[flat[j]] = j``. Raises ``InvalidInput`` unless ``flat`` is a
    permutation of ``range(len(flat))``.
    """
    flat = [int(i) for mb in micro_batches for i in mb]
    n = len(flat)
    inverse = [-1] * n
    for pos, i in enumerate(flat):
        if not 0 <= i < n or inverse[i] != -1:
            raise InvalidInput(
                f"restore_order: index {i} is out of range or repeated; micro-batches must hold each of "
                f"0..{n - 1} exactly once"
            )
        inverse[i] = pos
    return inverse


@checked
def balanced_group_partitions(
    group_ids: Sequence[Hashable] | torch.Tensor,
    seqlens: Sequence[int] | torch.Tensor,
    k: int,
    workload: Workload = "attention",
) -> list[list[int]]:
    """Balance items into ``k`` partitions keeping every group (all responses of one prompt) together.

    ``group_ids`` and ``seqlens`` have one entry per item; a group's cost is the sum of
    ``workload(s)`` over its members. Returns ``k`` index lists of items (ascending). Raises
    ``InvalidInput`` when the lengths differ or ``k`` exceeds the number of groups.
    """
    lens = _seqlens(seqlens, "balanced_group_partitions")
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != len(lens):
        raise InvalidInput(
            f"balanced_group_partitions: {len(ids)} group ids but {len(lens)} seqlens; give one id per item"
        )
    fn = _workload_fn(workload)
    table: dict[Hashable, int] = {}
    members: list[list[int]] = []
    cost: list[float] = []
    for i, (g, s) in enumerate(zip(ids, lens)):
        j = table.setdefault(g, len(table))
        if j == len(members):
            members.append([])
            cost.append(0.0)
        members[j].append(i)
        cost[j] += fn(s)
    if k > len(members):
        raise InvalidInput(
            f"balanced_group_partitions: k={k} partitions but only {len(members)} groups; lower k"
        )
    parts = karmarkar_karp(cost, k)
    return [sorted(i for j in p for i in members[j]) for p in parts]
