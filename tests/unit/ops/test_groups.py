"""Group statistics for GRPO advantages against a float64 per-group reference."""

from __future__ import annotations

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from underlay.interfaces import InvalidInput
from underlay.ops import group_mean_std, group_normalize


def _reference(
    scores: list[float], ids: list[object]
) -> tuple[list[object], list[float], list[float], list[int]]:
    order: list[object] = []
    members: dict[object, list[float]] = {}
    for s, g in zip(scores, ids):
        if g not in members:
            order.append(g)
            members[g] = []
        members[g].append(s)
    mean = [statistics.fmean(members[g]) if len(members[g]) > 1 else 0.0 for g in order]
    std = [statistics.stdev(members[g]) if len(members[g]) > 1 else 1.0 for g in order]
    return order, mean, std, [len(members[g]) for g in order]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-100, 100), st.one_of(st.integers(0, 4), st.sampled_from(["a", "0042", "b"]))),
        min_size=1,
        max_size=40,
    )
)
def test_group_stats_match_reference(items: list[tuple[float, object]]) -> None:
    scores = [s for s, _ in items]
    ids = [g for _, g in items]
    _, mean_ref, std_ref, count_ref = _reference(scores, ids)
    x = torch.tensor(scores, dtype=torch.float64)
    mean, std, count = group_mean_std(x, ids)
    assert count.tolist() == count_ref
    torch.testing.assert_close(mean, torch.tensor(mean_ref, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(std, torch.tensor(std_ref, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    adv = group_normalize(x, ids, eps=1e-6)
    index = {g: i for i, g in enumerate(dict.fromkeys(ids))}
    expect = [(s - mean_ref[index[g]]) / (std_ref[index[g]] + 1e-6) for s, g in items]
    torch.testing.assert_close(adv, torch.tensor(expect, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    unscaled = group_normalize(x, ids, scale=False)
    torch.testing.assert_close(
        unscaled, torch.tensor([s - mean_ref[index[g]] for s, g in items], dtype=torch.float64)
    )


def test_string_and_int_labels_are_distinct_and_order_is_first_appearance() -> None:
    scores = torch.tensor([1.0, 5.0, 3.0, 9.0, 7.0])
    mean, std, count = group_mean_std(scores, ["0042", 42, "0042", 42, "x"])
    assert count.tolist() == [2, 2, 1]
    assert mean.tolist() == [2.0, 7.0, 0.0]
    assert std.tolist()[2] == 1.0 and std.dtype == torch.float32
    mean2, std2, _ = group_mean_std(scores[4:], ["x"], single_mean=float("nan"), single_std=0.0)
    assert torch.isnan(mean2).all() and std2.tolist() == [0.0]


def test_tensor_ids_match_list_ids() -> None:
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(64, generator=gen)
    ids = torch.randint(0, 9, (64,), generator=gen) * 7 - 20
    a = group_mean_std(scores, ids)
    b = group_mean_std(scores, ids.tolist())
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_empty_and_errors() -> None:
    mean, std, count = group_mean_std(torch.zeros(0), [])
    assert mean.numel() == std.numel() == count.numel() == 0
    assert group_normalize(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0
    with pytest.raises(InvalidInput, match="one id per score"):
        group_mean_std(torch.ones(3), [1, 2])
    with pytest.raises(InvalidInput, match="(?i)hashable"):
        group_mean_std(torch.ones(2), [[1], [2]])
    with pytest.raises(InvalidInput, match="eps"):
        group_normalize(torch.ones(2), [1, 1], eps=-1.0)
