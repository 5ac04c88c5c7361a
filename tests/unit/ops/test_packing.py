"""unpad/pad round trips for left and right padding, position ids, pad_to_multiple."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from underlay.interfaces import InvalidInput
from underlay.ops import pad, pad_to_multiple, position_ids_from_mask, unpad


def _mask(lengths: list[int], seqlen: int, left: bool) -> torch.Tensor:
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.int64)
    for i, n in enumerate(lengths):
        if left:
            mask[i, seqlen - n :] = 1
        else:
            mask[i, :n] = 1
    return mask


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 8).flatmap(
        lambda s: st.tuples(st.just(s), st.lists(st.integers(0, s), min_size=1, max_size=5))
    ),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_unpad_pad_round_trip(shape: tuple[int, list[int]], left: bool, seed: int) -> None:
    seqlen, lengths = shape
    gen = torch.Generator().manual_seed(seed)
    mask = _mask(lengths, seqlen, left)
    ids = torch.randint(1, 1000, (len(lengths), seqlen), generator=gen)
    packed = unpad(ids, mask)
    assert packed.cu_seqlens.dtype == torch.int32 and packed.indices.dtype == torch.int64
    assert packed.seqlens == lengths and packed.max_seqlen == max(lengths)
    assert packed.total_tokens == sum(lengths) == int(packed.cu_seqlens[-1])
    expect_tokens = torch.cat([ids[i][mask[i].bool()] for i in range(len(lengths))])
    assert torch.equal(packed.input_ids, expect_tokens)
    assert torch.equal(packed.position_ids, torch.cat([torch.arange(n) for n in lengths]))
    restored = pad(packed.input_ids, packed, pad_value=-1)
    assert torch.equal(restored, torch.where(mask.bool(), ids, torch.full_like(ids, -1)))
    # trailing dims and gradients
    feats = torch.randn(packed.total_tokens, 3, generator=gen, requires_grad=True)
    padded = pad(feats, packed)
    assert padded.shape == (len(lengths), seqlen, 3)
    padded.sum().backward()
    assert feats.grad is not None and torch.all(feats.grad == 1)
    pos = position_ids_from_mask(mask)
    assert torch.equal(pos[mask.bool()], packed.position_ids)
    assert torch.all(pos[~mask.bool()] == 0)


def test_position_ids_left_and_right() -> None:
    right = torch.tensor([[1, 1, 1, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1, 1]])
    assert position_ids_from_mask(right).tolist() == [[0, 1, 2, 0, 0]]
    assert position_ids_from_mask(left).tolist() == [[0, 0, 0, 1, 2]]


def test_unpad_validation() -> None:
    with pytest.raises(InvalidInput, match="start with"):
        unpad(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(InvalidInput, match=r"\[B, S\]"):
        unpad(torch.ones(3, dtype=torch.long), torch.ones(3))
    packed = unpad(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3))
    with pytest.raises(InvalidInput, match="6 rows"):
        pad(torch.ones(5), packed)


def test_pad_to_multiple() -> None:
    x = torch.arange(10).view(2, 5)
    y = pad_to_multiple(x, 4, dim=1, value=-1)
    assert y.shape == (2, 8) and torch.equal(y[:, :5], x) and torch.all(y[:, 5:] == -1)
    z = pad_to_multiple(x, 3, dim=0)
    assert z.shape == (3, 5) and torch.all(z[2] == 0)
    assert pad_to_multiple(x, 5, dim=-1) is x
    with pytest.raises(InvalidInput, match="multiple"):
        pad_to_multiple(x, 0)
    with pytest.raises(InvalidInput, match="dim"):
        pad_to_multiple(x, 2, dim=2)
