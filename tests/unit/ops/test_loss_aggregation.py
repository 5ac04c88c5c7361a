"""``ops.aggregate_loss`` (loss contract v3): every mode's contributions, summed over any split of the
global batch into ranks and micro-batches, equal verl's ``agg_loss`` of the whole batch in float64 (value
and gradient); bad input is ``InvalidInput`` naming the value; the engine-side pieces
(``engines._loss``) check signatures and returns and reduce metrics as declared."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._loss_reference import MODES, NORM, reference_agg
from underlay.engines._loss import LossCounts, MetricReducer, check_loss_fn, checked_loss, count_loss
from underlay.interfaces import InvalidInput, LossContext, Metric
from underlay.ops import aggregate_loss


def _global_batch(seed: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, seq, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, seq, generator=g) < 0.6).long()
    mask[torch.rand(rows, generator=g) < 0.25] = 0  # some rows without any loss token
    mask[0, 0] = 1  # at least one loss token in the batch
    return values, mask


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 9),
    ranks=st.integers(1, 3),
    cuts=st.lists(st.integers(0, 8), max_size=4),
)
def test_contributions_sum_to_verl_agg_loss_over_the_global_batch(
    seed: int, rows: int, ranks: int, cuts: list[int]
) -> None:
    """Any split: rows dealt round-robin to ``ranks``, each rank's rows cut into micro-batches."""
    values, mask = _global_batch(seed, rows, 6)
    shards = [list(range(r, rows, ranks)) for r in range(ranks)]
    per_row = [int(x) for x in (mask != 0).sum(1)]
    tokens, seqs = sum(per_row), sum(1 for t in per_row if t)
    for mode in MODES:
        norm = NORM if mode == "seq-mean-token-sum-norm" else None
        leaf = values.clone().requires_grad_(True)
        total = torch.zeros((), dtype=torch.float64)
        for shard in shards:
            bounds = sorted({0, len(shard), *(c for c in cuts if c < len(shard))})
            pieces = [shard[a:b] for a, b in itertools.pairwise(bounds)] or [[]]
            counts = LossCounts(tokens, seqs, ranks, tuple(per_row[i] for i in shard))
            for i, piece in enumerate(pieces):
                ctx = counts.context(i, len(pieces), [shard.index(r) for r in piece])
                total = total + aggregate_loss(leaf[piece], mask[piece], mode, ctx, norm=norm)
        ref_leaf = values.clone().requires_grad_(True)
        ref = reference_agg(ref_leaf, mask, mode)
        (g,) = torch.autograd.grad(total, leaf)
        (ref_g,) = torch.autograd.grad(ref, ref_leaf)
        assert torch.allclose(total, ref, rtol=1e-12, atol=1e-12), (mode, float(total), float(ref))
        assert torch.allclose(g, ref_g, rtol=1e-12, atol=1e-12), mode


def test_token_sum_is_verl_spelling_of_sum_and_no_loss_tokens_gives_zero() -> None:
    values, mask = _global_batch(3, 4, 5)
    ctx = LossContext.single(mask)
    assert torch.equal(
        aggregate_loss(values, mask, "token-sum", ctx), aggregate_loss(values, mask, "sum", ctx)
    )
    empty = torch.zeros_like(mask)
    for mode in MODES:
        norm = NORM if mode == "seq-mean-token-sum-norm" else None
        assert float(aggregate_loss(values, empty, mode, LossContext.single(empty), norm=norm)) == 0.0
    nan_outside = values.masked_fill(mask == 0, math.nan)  # NaN where the mask is 0 never reaches the sum
    assert math.isfinite(float(aggregate_loss(nan_outside, mask, "seq-mean-token-mean", ctx)))


def _bad_cases() -> dict[str, tuple[Any, ...]]:
    values, mask = _global_batch(5, 3, 4)
    ctx = LossContext.single(mask)
    return {
        "unknown mode 'token_mean'": (values, mask, "token_mean", ctx, None),
        "same shape": (values, mask[:, :3], "sum", ctx, None),
        "[b, S]": (values[0], mask[0], "sum", ctx, None),
        "floating tensor": (mask, mask, "sum", ctx, None),
        "other than 0/1": (values, mask * 2, "sum", ctx, None),
        "batch.loss_mask": (values, torch.ones_like(mask), "sum", ctx, None),
        "LossContext": (values, mask, "sum", {"global_loss_tokens": 3}, None),
        "norm=None": (values, mask, "seq-mean-token-sum-norm", ctx, None),
        "norm=nan": (values, mask, "seq-mean-token-sum-norm", ctx, math.nan),
        "norm=0": (values, mask, "seq-mean-token-sum-norm", ctx, 0),
        "norm=2.0 applies only": (values, mask, "token-mean", ctx, 2.0),
    }


@pytest.mark.parametrize("what", list(_bad_cases()))
def test_bad_input_is_invalid_input_naming_it(what: str) -> None:
    values, mask, mode, ctx, norm = _bad_cases()[what]
    with pytest.raises(InvalidInput, match="aggregate_loss") as err:
        aggregate_loss(values, mask, mode, ctx, norm=norm)
    assert what in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        (dict(global_loss_tokens=-1), "global_loss_tokens=-1"),
        (dict(dp_size=0), "dp_size=0"),
        (dict(micro_batch=2), "micro_batch=2 out of range"),
        (dict(local_loss_tokens=11), "exceed the global"),
        (dict(local_sequences=3, local_loss_tokens=2), "more sequences than loss tokens"),
        (dict(global_sequences=1.5), "global_sequences=1.5"),
    ],
)
def test_loss_context_refuses_inconsistent_counts(kwargs: dict[str, Any], what: str) -> None:
    base = dict(
        global_loss_tokens=10,
        global_sequences=3,
        dp_size=2,
        micro_batch=1,
        num_micro_batches=2,
        local_loss_tokens=4,
        local_sequences=1,
    )
    ctx = LossContext(**base)  # type: ignore[arg-type]
    assert (ctx.token_share, ctx.sequence_share) == (0.4, 1 / 3)
    with pytest.raises(InvalidInput, match=what.replace("[", r"\[")):
        LossContext(**{**base, **kwargs})  # type: ignore[arg-type]


def test_metric_refuses_unknown_reduce_and_non_scalars() -> None:
    with pytest.raises(InvalidInput, match="reduce='avg'"):
        Metric(1.0, "avg")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"shape \(2,\)"):
        Metric(torch.ones(2), "max")
    with pytest.raises(InvalidInput, match="str"):
        Metric("1", "sum")  # type: ignore[arg-type]


def _two(outputs: Any, batch: Any) -> Any:
    return outputs, batch


class _Three:
    def __call__(self, outputs: Any, batch: Any, ctx: Any) -> Any:
        return outputs


def test_two_parameter_loss_fn_is_refused_naming_the_v3_signature() -> None:
    for fn in (_two, lambda o, b: o, lambda o: o):
        with pytest.raises(InvalidInput, match=r"ctx: LossContext"):
            check_loss_fn(fn)
    for fn in (_Three(), lambda o, b, c: o, lambda *a: a, lambda o, b, c, extra=1: o):
        check_loss_fn(fn)
    with pytest.raises(InvalidInput, match="not callable"):
        check_loss_fn(3)  # type: ignore[arg-type]


def test_checked_loss_normalises_plain_metrics_to_sums() -> None:
    loss = torch.ones((), requires_grad=True) * 2
    got, metrics = checked_loss((loss, {"a": 1.5, "b": torch.tensor([2.0]), "c": Metric(3.0, "max")}))
    assert got is loss
    assert {k: (float(m.value), m.reduce) for k, m in metrics.items()} == {
        "a": (1.5, "sum"),
        "b": (2.0, "sum"),
        "c": (3.0, "max"),
    }
    with pytest.raises(InvalidInput, match="'loss'"):
        checked_loss((loss, {"loss": 1.0}))
    with pytest.raises(InvalidInput, match="is str"):
        checked_loss((loss, {"m": "x"}))


def test_metric_reducer_on_one_rank_reduces_each_as_declared() -> None:
    red = MetricReducer(torch.device("cpu"))
    loss = torch.zeros((), requires_grad=True)
    for i, v in enumerate((3.0, -1.0, 5.0)):
        metrics = {
            "s": v,
            "m": Metric(v, "mean"),
            "hi": Metric(torch.tensor(v), "max"),
            "lo": Metric(v, "min"),
        }
        red.add(*checked_loss((loss + i, metrics)))
    assert red.reduce(None, 1) == {"hi": 5.0, "lo": -1.0, "loss": 3.0, "m": 7.0 / 3, "s": 7.0}
    with pytest.raises(InvalidInput, match="changed its reduce"):
        red.add(loss, {"s": Metric(1.0, "max")})  # the engine passes checked_loss's Metrics


def test_count_loss_on_one_rank() -> None:
    mask = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 0, 0]])
    counts = count_loss(mask, None, 1, torch.device("cpu"))
    assert (counts.global_tokens, counts.global_sequences, counts.row_tokens) == (3, 2, (2, 0, 1))
    ctx = counts.context(1, 2, [1, 2])
    assert (ctx.local_loss_tokens, ctx.local_sequences, ctx.micro_batch) == (1, 1, 1)
    assert LossContext.single(mask) == LossContext(3, 2, 1, 0, 1, 3, 2)
