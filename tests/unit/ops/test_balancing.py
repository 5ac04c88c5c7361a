"""Karmarkar-Karp balancing, micro-batch planning and order restoration."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from underlay.interfaces import InvalidInput
from underlay.ops import (
    ATTENTION_WORKLOAD_A,
    balanced_group_partitions,
    balanced_partitions,
    greedy_lpt,
    karmarkar_karp,
    partition_loads,
    plan_micro_batches,
    restore_order,
)


def _grpo_lengths(n: int, seed: int) -> list[int]:
    """GRPO-like mix: prompt + lognormal response lengths, clipped to a max response length."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(64, 512, size=n)
    responses = np.clip(rng.lognormal(6.0, 1.0, size=n), 8, 8192)
    return (prompts + responses).astype(int).tolist()


def _is_partition(parts: list[list[int]], n: int, k: int) -> bool:
    flat = sorted(i for p in parts for i in p)
    return len(parts) == k and flat == list(range(n))


@pytest.mark.parametrize("equal_size", [False, True])
@pytest.mark.parametrize(("n", "k"), [(512, 8), (2048, 32)])
def test_quality_on_grpo_lengths(n: int, k: int, equal_size: bool) -> None:
    w = _grpo_lengths(n, seed=n + k)
    parts = karmarkar_karp(w, k, equal_size)
    assert _is_partition(parts, n, k)
    if equal_size:
        assert {len(p) for p in parts} == {n // k}
    ideal = sum(w) / k
    kk, lpt = max(partition_loads(w, parts)), max(partition_loads(w, greedy_lpt(w, k, equal_size)))
    assert kk <= lpt
    assert kk / ideal - 1 < 1e-3  # exact balance is reachable: many small items


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=60), st.integers(1, 8), st.booleans())
def test_never_worse_than_greedy(w: list[int], k: int, equal_size: bool) -> None:
    k = min(k, len(w))
    if equal_size:
        w = w[: len(w) - len(w) % k]
    parts = karmarkar_karp(w, k, equal_size)
    assert _is_partition(parts, len(w), k)
    assert max(partition_loads(w, parts)) <= max(partition_loads(w, greedy_lpt(w, k, equal_size)))


def test_known_optimum_small() -> None:
    # {8, 7, 6, 5, 4} into 2: KK reaches the optimum 15/15, LPT gets 13/17
    w = [8, 7, 6, 5, 4]
    assert sorted(partition_loads(w, karmarkar_karp(w, 2))) == [15, 15]
    assert sorted(partition_loads(w, greedy_lpt(w, 2))) == [13, 17]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: karmarkar_karp([1, 2], 3), "only 2 items"),
        (lambda: karmarkar_karp([1, 2, 3], 2, equal_size=True), "divide"),
        (lambda: karmarkar_karp([1, -2], 1), "negative"),
        (lambda: greedy_lpt([1, 2], 0), "k=0"),
        (lambda: plan_micro_batches([5, 100], 64), "sequence 1 has 100 tokens"),
        (lambda: plan_micro_batches([5], 64, multiple_of=0), "multiple_of"),
        (lambda: balanced_partitions([3, 4], 2, workload="cubic"), "workload"),
        (lambda: balanced_group_partitions([0, 0, 1], [1, 2, 3], 3), "only 2 groups"),
        (lambda: restore_order([[0, 2], [2]]), "repeated"),
    ],
)
def test_errors(call: object, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        call()  # type: ignore[operator]


def test_balanced_partitions_workloads() -> None:
    lens = [4000, 100, 100, 100, 100, 3000, 2000, 50]
    for workload in ("linear", "attention", lambda s: float(s) ** 1.5):
        parts = balanced_partitions(lens, 3, workload=workload)
        assert _is_partition(parts, len(lens), 3)
    cost = [ATTENTION_WORKLOAD_A * s + s * s for s in lens]
    parts = balanced_partitions(lens, 3)
    assert max(partition_loads(cost, parts)) <= max(partition_loads(cost, greedy_lpt(cost, 3)))


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=0, max_size=40),
    st.integers(300, 1000),
    st.integers(1, 6),
    st.integers(1, 4),
)
def test_plan_micro_batches_invariants(
    lens: list[int], max_tokens: int, min_count: int, multiple_of: int
) -> None:
    mbs = plan_micro_batches(lens, max_tokens, min_count=min_count, multiple_of=multiple_of)
    assert len(mbs) % multiple_of == 0 and len(mbs) >= min_count
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lens)))
    assert all(sum(lens[i] for i in mb) <= max_tokens for mb in mbs)
    flat = [i for mb in mbs for i in mb]
    inv = restore_order(mbs)
    assert [flat[inv[i]] for i in range(len(lens))] == list(range(len(lens)))
    # the count is minimal up to bin-packing slack: never more than twice the lower bound
    if lens:
        lower = max(min_count, -(-sum(lens) // max_tokens))
        assert len(mbs) <= -(-max(2 * lower, 1) // multiple_of) * multiple_of


def test_plan_micro_batches_balanced() -> None:
    lens = _grpo_lengths(256, seed=3)
    lens = [min(s, 4096) for s in lens]
    mbs = plan_micro_batches(lens, 16384)
    loads = [sum(lens[i] for i in mb) for mb in mbs]
    assert max(loads) <= 16384
    assert max(loads) - min(loads) < 0.05 * max(loads)


def test_balanced_group_partitions_keeps_groups_together() -> None:
    rng = np.random.default_rng(4)
    ids = [f"p{g}" for g in range(32) for _ in range(4)]
    lens = rng.integers(50, 4000, size=len(ids)).tolist()
    parts = balanced_group_partitions(ids, lens, 4, workload="linear")
    assert _is_partition(parts, len(ids), 4)
    where = {i: j for j, p in enumerate(parts) for i in p}
    for g in set(ids):
        assert len({where[i] for i, x in enumerate(ids) if x == g}) == 1
    group_cost = [sum(lens[i * 4 : i * 4 + 4]) for i in range(32)]
    loads = partition_loads(lens, parts)
    assert max(loads) <= max(partition_loads(group_cost, greedy_lpt(group_cost, 4)))
