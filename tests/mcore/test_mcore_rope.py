"""The mcore attention core's vectorized RoPE (``engines.mcore.rope``) against megatron-core's own
unfused per-sequence THD / BSHD RoPE, and its op count independent of the number of packed sequences.
Single process, no fixture: megatron's RoPE helpers run on the CPU as they are."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("megatron.core")

from underlay.engines.mcore.rope import apply_rope, packed_positions, rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.mcore

HEAD_DIM = 16
BASE = 1_000_000


class _Group:
    """What megatron's THD RoPE reads of a CP process group: ``size()`` and ``rank()``."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _config() -> Any:
    return SimpleNamespace(kv_channels=HEAD_DIM, rotary_interleaved=False, use_cpu_initialization=True)


def _megatron_freqs(max_len: int) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` (``[max_len, 1, 1, d]`` angles) without its move to CUDA."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotary = RotaryEmbedding(HEAD_DIM, 1.0, rotary_base=BASE, use_cpu_initialization=True)
    freqs = rotary.get_freqs_non_repeated(max_len)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("cp", "lengths"), [(1, [1, 7, 3, 12, 5, 9]), (2, [4, 8, 12, 4]), (4, [8, 16, 24])])
def test_vectorized_rope_equals_megatron_thd(cp: int, lengths: list[int], dtype: torch.dtype) -> None:
    """Random packed q/k (odd lengths without CP; lengths multiples of 2*cp, the padded ones, with
    CP): ``apply_rope`` with ``packed_positions`` on every CP rank is bit-identical to megatron's
    ``_apply_rotary_pos_emb_thd`` (it loops over the sequences), in float64 and bf16."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    torch.manual_seed(cp)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    freqs = _megatron_freqs(max(lengths))
    inv = rope_inv_freq(_config(), BASE)
    for rank in range(cp):
        local = int(cu[-1]) // cp
        for heads in (4, 2):  # q and k (GQA)
            x = torch.randn(local, heads, HEAD_DIM, dtype=torch.float64).to(dtype)
            want = _apply_rotary_pos_emb_thd(x, cu, freqs, cp_group=_Group(cp, rank))
            cos, sin = rope_cos_sin(packed_positions(cu, local, cp, rank), inv, dtype)
            got = apply_rope(x, cos, sin)
            assert got.dtype == dtype and torch.equal(got, want), (cp, rank, (got - want).abs().max())


def test_vectorized_rope_equals_megatron_bshd() -> None:
    """``[s, b, h, d]`` input with positions ``0 .. s-1``: equal to ``_apply_rotary_pos_emb_bshd``."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    torch.manual_seed(1)
    x = torch.randn(11, 3, 4, HEAD_DIM, dtype=torch.float64)
    want = _apply_rotary_pos_emb_bshd(x, _megatron_freqs(11))
    cos, sin = rope_cos_sin(torch.arange(11), rope_inv_freq(_config(), BASE), x.dtype)
    assert torch.equal(apply_rope(x, cos.unsqueeze(1), sin.unsqueeze(1)), want)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_attention_rope_op_count_independent_of_sequence_count() -> None:
    """The attention core's RoPE issues the same aten ops for 2 and 20 packed sequences, computes
    cos/sin once per micro-batch (the second layer reuses them) and never syncs with the host
    (no ``_local_scalar_dense``, i.e. no ``.item()``/``.tolist()``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from underlay.engines.mcore.layers import _core_attention_class

    cls = _core_attention_class()
    config = SimpleNamespace(**vars(_config()), context_parallel_size=1)
    attn = cls(config, 1, None, "self", rotary_base=BASE)

    def count(n: int) -> tuple[list[str], list[str]]:
        lengths = torch.randint(1, 9, (n,))
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
        total = int(cu[-1])
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8, max_seqlen_kv=8
        )
        q, k = torch.randn(total, 4, HEAD_DIM), torch.randn(total, 2, HEAD_DIM)
        first, second = _CountOps(), _CountOps()
        with first:
            attn._rotate(q, k, params)
        with second:  # the next layer of the same micro-batch
            attn._rotate(q, k, params)
        return first.ops, second.ops

    torch.manual_seed(2)
    few, many = count(2), count(20)
    assert few == many
    first, second = few
    assert first.count("aten.cos") == 1 and first.count("aten.sin") == 1
    assert "aten.cos" not in second and "aten.searchsorted" not in second
    assert len(second) <= 12, second
    assert not any("_local_scalar_dense" in op for op in first + second)
