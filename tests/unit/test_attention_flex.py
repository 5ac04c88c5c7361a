"""The ``flex`` attention kernel (``torch.nn.attention.flex_attention``) on the cpu: its outputs against
the ``eager`` reference over a generated matrix of packed lengths (``S_q != S_k`` included, so some
queries see no key), windows, softcaps, GQA/MQA and ``Dv != D`` in float64 and float32; the padded
route; the block-mask cache; ``supports``; and the ``auto`` selection (on cuda: the ``torch`` kernel
wherever it can run the case, else flex where it can, else eager; never flex on the cpu).

Flex has no cpu backward in torch, so gradients are checked on cuda by the conformance suite
(``tests/conformance/test_attention_contract.py``, which lists ``flex`` there) and
``tests/gpu/test_flex_attention_cuda.py``.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator

import pytest
import torch

from underlay import registry
from underlay.backends.portable.attention import EagerAttention
from underlay.backends.portable.flex_attention import FlexAttention
from underlay.interfaces import AttentionSpec, IncompatibleBackends, UnsupportedOperation

TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    registry.reset()
    yield
    registry.reset()


def _kernels() -> tuple[FlexAttention, EagerAttention]:
    device = registry.get_device("cpu")
    return FlexAttention(device), EagerAttention(device)


Case = tuple[
    str, tuple[int, ...], tuple[int, ...], bool, "tuple[int, int] | None", "float | None", int, int, int
]


def _matrix() -> list[Case]:
    """(id, lengths q, lengths k, causal, window, softcap, Hq, Hk, Dv): every (window, softcap) pair
    once, with GQA, MQA and MHA in turn and one Dv != D, over packed batches generated from the case
    number (mixed lengths, always both 1 and 100); one layout has fewer queries than keys (bottom-right
    aligned, a decode-like tail), one more queries than keys (its first queries see no key), and one
    windowed case is bidirectional."""
    cases: list[Case] = []
    windows: list[tuple[int, int] | None] = [None, (7, 0), (20, 3)]
    caps: list[float | None] = [None, 5.0]
    heads = [(4, 2, 16), (4, 1, 16), (2, 2, 8)]
    for n, (window, cap) in enumerate(itertools.product(windows, caps)):
        hq, hk, dv = heads[n % 3]
        gen = torch.Generator().manual_seed(n)
        lens = [1, 100, *(int(x) for x in torch.randint(1, 60, (2,), generator=gen))]
        lens_k = list(lens)
        if n == 1:
            lens_k = [x + int(torch.randint(0, 9, (1,), generator=gen)) for x in lens]
        elif n == 4:
            lens_k = [max(1, x - 4) for x in lens]  # S_q > S_k: leading queries see no key
        causal = n != 5
        cases.append((f"c{n}", tuple(lens), tuple(lens_k), causal, window, cap, hq, hk, dv))
    return cases


_PARAMS = [
    pytest.param(case, dtype, id=f"{case[0]}-{str(dtype)[6:]}")
    for case in _matrix()
    for dtype in (torch.float64, torch.float32)
    if dtype == torch.float64 or case[0] in ("c1", "c2")  # fp32: MQA with S_q < S_k; MHA with Dv != D
]


def _cu(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


@pytest.mark.parametrize(("case", "dtype"), _PARAMS)
def test_varlen_matches_eager(case: Case, dtype: torch.dtype) -> None:
    """Packed flex output equals eager's (same inputs, same options) to rounding."""
    cid, lens_q, lens_k, causal, window, cap, hq, hk, dv = case
    flex, eager = _kernels()
    gen = torch.Generator().manual_seed(zlib.crc32(f"{cid}/{dtype}".encode()))
    q = torch.randn(sum(lens_q), hq, 16, generator=gen, dtype=dtype)
    k = torch.randn(sum(lens_k), hk, 16, generator=gen, dtype=dtype)
    v = torch.randn(sum(lens_k), hk, dv, generator=gen, dtype=dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    opts = {"causal": causal, "window": window, "softcap": cap, "scale": 0.4}
    got = flex.varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **opts)  # type: ignore[arg-type]
    want = eager.varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **opts)  # type: ignore[arg-type]
    assert got.dtype == dtype and got.shape == (sum(lens_q), hq, dv)
    err = (got - want).abs().max().item()
    assert err <= TOL[dtype], f"{cid}: max |flex - eager| = {err:.3g}"


def test_comparison_can_fail() -> None:
    """The check above tells masks apart: a window one token wider, or no softcap, moves the output
    far beyond its tolerance (so a wrong mask or score_mod in flex could not pass)."""
    flex, eager = _kernels()
    gen = torch.Generator().manual_seed(5)
    lens = (40, 70)
    q, k, v = (torch.randn(110, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    cu = _cu(lens)
    got = flex.varlen(q, k, v, cu, cu, 70, 70, window=(7, 0), softcap=2.0)
    wider = eager.varlen(q, k, v, cu, cu, 70, 70, window=(8, 0), softcap=2.0)
    uncapped = eager.varlen(q, k, v, cu, cu, 70, 70, window=(7, 0))
    same = eager.varlen(q, k, v, cu, cu, 70, 70, window=(7, 0), softcap=2.0)
    assert (got - same).abs().max().item() <= TOL[torch.float64]
    assert (got - wider).abs().max().item() > 1e-3
    assert (got - uncapped).abs().max().item() > 1e-3


@pytest.mark.parametrize(("causal", "window", "cap"), [(True, (5, 0), 4.0), (False, (3, 2), None)], ids=str)
def test_padded_matches_eager(causal: bool, window: tuple[int, int] | None, cap: float | None) -> None:
    """Padded flex (left and right padding as a key mask in the block mask) equals eager on real rows."""
    flex, eager = _kernels()
    gen = torch.Generator().manual_seed(11)
    b, s = 3, 40
    q = torch.randn(b, s, 4, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, s, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(b, s, dtype=torch.int64)
    mask[0, :10] = 0
    mask[1, 30:] = 0
    real = (mask != 0)[..., None, None]
    for m in (mask, None):
        got = flex.padded(q, k, v, attention_mask=m, causal=causal, window=window, softcap=cap)
        want = eager.padded(q, k, v, attention_mask=m, causal=causal, window=window, softcap=cap)
        assert got.shape == want.shape
        assert ((got - want) * real).abs().max().item() <= TOL[torch.float64]


def test_block_mask_built_once_per_layout() -> None:
    """Every call with the same ``cu_seqlens`` tensor (the layers of one forward, their recomputation)
    reuses one block mask; another window gets its own; an in-place change of the tensor rebuilds."""
    from underlay.backends.portable import flex_attention as mod

    flex, _ = _kernels()
    q = torch.randn(30, 2, 16, dtype=torch.float64)
    cu = _cu((10, 20))
    flex.varlen(q, q, q, cu, cu, 20, 20)
    masks = getattr(cu, mod._MASKS_ATTR)
    first = dict(masks)
    flex.varlen(q, q, q, cu, cu, 20, 20)
    assert len(masks) == 1 and next(iter(masks.values())) is next(iter(first.values()))
    flex.varlen(q, q, q, cu, cu, 20, 20, window=(3, 0))
    assert len(masks) == 2
    other = _cu((10, 20))  # an equal but different tensor: its own cache
    flex.varlen(q, q, q, other, other, 20, 20)
    assert getattr(other, mod._MASKS_ATTR) is not masks
    cu[1] = 15  # in place: the lengths change, the version moves, the mask is rebuilt
    out = flex.varlen(q, q, q, cu, cu, 15, 15)
    want = EagerAttention(registry.get_device("cpu")).varlen(q, q, q, cu, cu, 15, 15)
    assert (out - want).abs().max().item() <= TOL[torch.float64]


def _spec(**kw: object) -> AttentionSpec:
    base: dict[str, object] = dict(
        dtype=torch.bfloat16, head_dim=256, num_heads=8, num_kv_heads=4, device_type="cuda"
    )
    base.update(kw)
    return AttentionSpec(**base)  # type: ignore[arg-type]


def test_supports_reasons() -> None:
    """What flex runs (Gemma 2's softcapped, windowed bf16 attention on cuda; cpu forward) and the
    reasons it names for what it cannot."""
    flex, _ = _kernels()
    assert flex.supports(_spec(softcap=50.0, window=(4095, 0))) == ()
    assert flex.supports(_spec(dtype=torch.float32, head_dim=64, head_dim_v=128)) == ()
    assert flex.supports(_spec(device_type="cpu", dtype=torch.float64, head_dim=96)) == ()
    for kw, word in [
        ({"sinks": True}, "sinks"),
        ({"dtype": torch.float64}, "float64"),
        ({"head_dim": 96}, "D=96"),
        ({"head_dim_v": 48}, "Dv=48"),
        ({"device_type": "cpu", "requires_grad": True}, "backward"),
        ({"device_type": "npu"}, "npu"),
        ({"device_type": "cpu", "dtype": torch.int32}, "int32"),
    ]:
        reasons = flex.supports(_spec(**kw))
        assert any(word in r for r in reasons), (kw, reasons)
    q = torch.randn(5, 2, 16, requires_grad=True)
    with pytest.raises(UnsupportedOperation, match="backward"):
        flex.varlen(q, q, q, _cu((5,)), _cu((5,)), 5, 5)


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({"softcap": 50.0}, "flex"),
        ({"softcap": 50.0, "window": (4095, 0)}, "flex"),
        ({}, "torch"),
        ({"window": (4095, 0)}, "torch"),
        ({"sinks": True}, "eager"),
        ({"softcap": 50.0, "head_dim": 96}, "eager"),
    ],
    ids=str,
)
def test_auto_on_cuda_picks_flex_only_where_eager_was_the_alternative(
    kw: dict[str, object], want: str
) -> None:
    """The registry's ``auto`` rule run for the cuda device (on this cpu host; the fused packages are
    not installed here, as on the GPU image): a softcap (which the ``torch`` kernel does not take) goes to
    flex, the ``torch`` kernel keeps the cases it runs, and what flex cannot run (sinks, a head dim
    its kernel does not take) ends at eager."""
    assert registry._auto("attention", "cuda", _spec(**kw)).name == want


def test_cpu_keeps_eager_and_refuses_flex_by_name() -> None:
    """On a cpu host ``auto`` never picks flex (no cpu backward); naming it says which devices it needs."""
    assert (
        registry.get_attention(spec=_spec(device_type="cpu", dtype=torch.float32, softcap=30.0)).name
        == "eager"
    )
    with pytest.raises(IncompatibleBackends, match="flex.*cuda"):
        registry.get_attention("flex")
