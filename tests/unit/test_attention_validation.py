"""Bad attention input raises ``InvalidInput`` with a message naming the problem, on every portable kernel
and through the shared helpers of ``underlay.ops.attention``, before any kernel runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from underlay import registry
from underlay.backends.portable.attention import EagerAttention, TorchAttention
from underlay.interfaces import AttentionKernel, InvalidInput
from underlay.ops.attention import (
    allowed_mask,
    attention_spec,
    check_options,
    normalize_window,
)

T, H, HK, D = 10, 4, 2, 8
LENS = [3, 7]


def _good() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(T, H, D, generator=gen),
        "k": torch.randn(T, HK, D, generator=gen),
        "v": torch.randn(T, HK, D, generator=gen),
        "cu_seqlens_q": torch.tensor([0, 3, 10], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, 3, 10], dtype=torch.int32),
        "max_seqlen_q": 7,
        "max_seqlen_k": 7,
    }


def _set(**kw: Any) -> Callable[[dict[str, Any]], None]:
    def edit(a: dict[str, Any]) -> None:
        a.update(kw)

    return edit


def _tensor(key: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, Any]], None]:
    def edit(a: dict[str, Any]) -> None:
        a[key] = fn(a[key])

    return edit


def _both_cu(values: list[int], dtype: torch.dtype = torch.int32) -> Callable[[dict[str, Any]], None]:
    return _set(
        cu_seqlens_q=torch.tensor(values, dtype=dtype), cu_seqlens_k=torch.tensor(values, dtype=dtype)
    )


VARLEN_BAD = [
    (
        "heads-not-multiple",
        lambda a: a.update(k=torch.randn(T, 3, D), v=torch.randn(T, 3, D)),
        "multiple of kv",
    ),
    ("k-v-heads-differ", _tensor("v", lambda t: torch.randn(T, 1, D)), "heads"),
    ("q-rank", _tensor("q", lambda t: t[None]), "rank 3"),
    ("v-rank", _tensor("v", lambda t: t[0]), "rank 3"),
    ("dtype-mix", _tensor("k", lambda t: t.double()), "dtypes differ"),
    ("int-dtype", lambda a: a.update({n: a[n].to(torch.int64) for n in ("q", "k", "v")}), "not supported"),
    ("device-mix", _tensor("v", lambda t: t.to("meta")), "devices differ"),
    ("head-dim-mix", _tensor("k", lambda t: torch.randn(T, HK, D + 1)), "head_dim"),
    ("kv-tokens-mix", _tensor("v", lambda t: t[:-1]), "leading"),
    ("cu-int64", _both_cu([0, 3, 10], torch.int64), "int32"),
    ("cu-not-from-0", _both_cu([1, 3, 10]), "start at 0"),
    ("cu-not-monotonic", _both_cu([0, 8, 3, 10]), "not monotonic"),
    ("cu-wrong-end", _both_cu([0, 3, 9]), "token count"),
    ("cu-2d", _both_cu([[0, 3, 10]]), "1-D"),
    ("cu-one-entry", _both_cu([0]), "1-D"),
    ("max-too-small", _set(max_seqlen_q=6), "smaller than the longest"),
    ("max-k-too-small", _set(max_seqlen_k=5), "smaller than the longest"),
    ("max-not-int", _set(max_seqlen_q=7.0), "must be an int"),
    (
        "max-k-not-int-shared-cu",
        lambda a: a.update(cu_seqlens_k=a["cu_seqlens_q"], max_seqlen_k="7"),
        "an int",
    ),
    ("max-k-small-shared-cu", lambda a: a.update(cu_seqlens_k=a["cu_seqlens_q"], max_seqlen_k=2), "smaller"),
    ("batch-mismatch", _set(cu_seqlens_k=torch.tensor([0, 3, 5, 10], dtype=torch.int32)), "sequences"),
]


def _kernels() -> list[AttentionKernel]:
    dev = registry.get_device()
    return [EagerAttention(dev), TorchAttention(dev)]


@pytest.mark.parametrize("kernel", _kernels(), ids=lambda k: k.name)
@pytest.mark.parametrize(("edit", "match"), [c[1:] for c in VARLEN_BAD], ids=[c[0] for c in VARLEN_BAD])
def test_varlen_rejects_bad_input(
    kernel: AttentionKernel, edit: Callable[[dict[str, Any]], None], match: str
) -> None:
    args = _good()
    kernel.varlen(**args)  # the unedited call is valid
    edit(args)
    with pytest.raises(InvalidInput, match=match):
        kernel.varlen(**args)


OPTIONS_BAD = [
    ({"window": (3,)}, "window"),
    ({"window": (-2, 0)}, "window"),
    ({"window": (1.5, 0)}, "window"),
    ({"scale": 0.0}, "scale"),
    ({"scale": float("nan")}, "scale"),
    ({"softcap": -1.0}, "softcap"),
    ({"causal": 1}, "causal"),
]


@pytest.mark.parametrize("kernel", _kernels(), ids=lambda k: k.name)
@pytest.mark.parametrize(("kw", "match"), OPTIONS_BAD, ids=[str(c[0]) for c in OPTIONS_BAD])
def test_options_rejected_in_varlen_and_padded(
    kernel: AttentionKernel, kw: dict[str, Any], match: str
) -> None:
    args = _good()
    with pytest.raises(InvalidInput, match=match):
        kernel.varlen(**args, **kw)
    q, k, v = (args[n].view(2, 5, *args[n].shape[1:]) for n in ("q", "k", "v"))
    with pytest.raises(InvalidInput, match=match):
        kernel.padded(q, k, v, **kw)


def _padded() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(2, 5, H, D, generator=gen),
        torch.randn(2, 6, HK, D, generator=gen),
        torch.randn(2, 6, HK, D, generator=gen),
    )


PADDED_BAD: list[tuple[str, Callable[[], tuple[Any, ...]], str]] = [
    ("mask-shape", lambda: (*_padded(), torch.ones(2, 5, dtype=torch.bool)), r"\[B, S_k\]"),
    ("mask-float", lambda: (*_padded(), torch.ones(2, 6)), "bool or an integer"),
    ("q-rank", lambda: (_padded()[0][0], *_padded()[1:], None), "rank 4"),
    ("batch-mismatch", lambda: (_padded()[0][:1], *_padded()[1:], None), "batch sizes differ"),
    ("heads", lambda: (torch.randn(2, 5, 3, D), *_padded()[1:], None), "multiple of kv heads"),
    ("dtype", lambda: (_padded()[0].half(), *_padded()[1:], None), "dtypes differ"),
    (
        "mask-device",
        lambda: (*_padded(), torch.ones(2, 6, dtype=torch.bool, device="meta")),
        "attention_mask is on",
    ),
]


@pytest.mark.parametrize("kernel", _kernels(), ids=lambda k: k.name)
@pytest.mark.parametrize(("make", "match"), [c[1:] for c in PADDED_BAD], ids=[c[0] for c in PADDED_BAD])
def test_padded_rejects_bad_input(
    kernel: AttentionKernel, make: Callable[[], tuple[Any, ...]], match: str
) -> None:
    q, k, v, mask = make()
    with pytest.raises(InvalidInput, match=match):
        kernel.padded(q, k, v, attention_mask=mask)


def test_attention_spec_from_tensors() -> None:
    args = _good()
    q, k = args["q"].requires_grad_(True), args["k"]
    v = torch.randn(T, HK, 5)
    spec = attention_spec(q, k, v, "varlen", causal=False, window=(-1, -1), softcap=2.0)
    assert (spec.dtype, spec.head_dim, spec.head_dim_v, spec.num_heads, spec.num_kv_heads) == (
        torch.float32, D, 5, H, HK,
    )  # fmt: skip
    assert spec.window is None and spec.softcap == 2.0 and spec.requires_grad and not spec.causal
    assert spec.device_type == "cpu" and spec.layout == "varlen"
    with pytest.raises(InvalidInput, match="layout"):
        attention_spec(q, k, v, "thd")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="rank 4"):
        attention_spec(q, k, v, "padded")


def test_window_helpers() -> None:
    assert normalize_window(None) is None and normalize_window((-1, -1)) is None
    assert normalize_window((4, -1)) == (4, -1)
    assert check_options(True, [2, 0], 0.5, None) == (2, 0)  # type: ignore[arg-type]
    keep = allowed_mask(3, 5, causal=True, window=(1, -1), device=torch.device("cpu"))
    assert keep is not None
    # query i sits at key position i + 2; causal and at most one key to the left
    expected = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(keep, expected)
    assert allowed_mask(4, 4, causal=False, window=None, device=torch.device("cpu")) is None


def test_cu_seqlens_is_read_once_per_tensor_and_again_after_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder layers of one packed forward pass the same ``cu_seqlens``: only the first call reads
    it on the host (one device sync per forward, not per layer); an in-place change or another tensor
    is read (and validated) again."""
    import underlay.ops.attention as att

    reads: list[int] = []
    real = att._read_lengths

    def counting(cu: torch.Tensor, total: int, name: str) -> list[int]:
        reads.append(int(cu.numel()))
        return real(cu, total, name)

    monkeypatch.setattr(att, "_read_lengths", counting)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    for _ in range(3):
        assert att.seqlens_from_cu(cu, 10, 7, "cu_seqlens_q") == LENS
    assert len(reads) == 1
    with pytest.raises(InvalidInput, match="max_seqlen 6 is smaller"):
        att.seqlens_from_cu(cu, 10, 6, "cu_seqlens_q")  # max_seqlen is still checked on a hit
    with pytest.raises(InvalidInput, match="ends at 10 but the tensor has 11"):
        att.seqlens_from_cu(cu, 11, 7, "cu_seqlens_q")  # another total is read again
    cu[1] = 11  # in place: no longer monotonic, and must not pass on the remembered lengths
    with pytest.raises(InvalidInput, match="not monotonic"):
        att.seqlens_from_cu(cu, 10, 7, "cu_seqlens_q")
    other = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert att.seqlens_from_cu(other, 10, 7, "cu_seqlens_q") == LENS
    assert len(reads) == 4


def test_one_validated_entry_normalises_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """varlen_call / padded_call: the entry every kernel takes; lengths are cached on each cu_seqlens
    tensor (no process-wide cache), so distinct q and k boundaries are each read once."""
    import underlay.ops.attention as att

    reads: list[int] = []
    real = att._read_lengths

    def counting(cu: torch.Tensor, total: int, name: str) -> list[int]:
        reads.append(int(cu.numel()))
        return real(cu, total, name)

    monkeypatch.setattr(att, "_read_lengths", counting)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 6)
    cu_q = torch.tensor([0, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 10], dtype=torch.int32)
    sinks = torch.zeros(4)
    for _ in range(3):
        call = att.varlen_call(
            q, k, v, cu_q, cu_k, 7, 7, causal=True, window=(-1, -1), scale=None, softcap=2.0, sinks=sinks
        )
    assert len(reads) == 2 and not hasattr(att, "_LENGTHS")
    assert call.lens_q == call.lens_k == tuple(LENS) and call.window is None
    assert call.scale == pytest.approx(8**-0.5) and call.spec.head_dim_v == 6
    assert call.spec.sinks and call.spec.softcap == 2.0 and call.spec.layout == "varlen"
    padded = att.padded_call(
        q[None], k[None], v[None], None, causal=False, window=(2, 1), scale=0.5, softcap=None, sinks=None
    )
    assert padded.window == (2, 1) and padded.scale == 0.5 and padded.lens_q == () and not padded.spec.sinks
    with pytest.raises(InvalidInput, match="sinks has shape"):
        att.padded_call(
            q[None],
            k[None],
            v[None],
            None,
            causal=True,
            window=None,
            scale=None,
            softcap=None,
            sinks=torch.zeros(3),
        )


def test_attached_host_lengths_are_used_without_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """``attach_seqlens`` (the mcore engine packs on the host and attaches the lengths it built
    ``cu_seqlens`` from): the checks take them with no read of the tensor, ``max_seqlen`` is still
    checked, an in-place change drops them (read again), negative lengths are refused."""
    import underlay.ops.attention as att

    reads: list[int] = []
    real = att._read_lengths

    def counting(cu: torch.Tensor, total: int, name: str) -> list[int]:
        reads.append(int(cu.numel()))
        return real(cu, total, name)

    monkeypatch.setattr(att, "_read_lengths", counting)
    cu = att.attach_seqlens(torch.tensor([0, 3, 10], dtype=torch.int32), LENS)
    assert att.seqlens_from_cu(cu, 10, 7, "cu_seqlens_q") == LENS and not reads
    with pytest.raises(InvalidInput, match="max_seqlen 6 is smaller"):
        att.seqlens_from_cu(cu, 10, 6, "cu_seqlens_q")
    cu[2] = 9
    assert att.seqlens_from_cu(cu, 9, 6, "cu_seqlens_q") == [3, 6] and len(reads) == 1
    with pytest.raises(InvalidInput, match="must be >= 0"):
        att.attach_seqlens(torch.tensor([0, 3], dtype=torch.int32), [-1])
