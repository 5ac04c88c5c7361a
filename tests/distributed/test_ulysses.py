"""Ulysses sequence parallelism on 2 real gloo processes equals one process: the all-to-all primitives,
and packed_forward of tiny models (log-probs, entropy, values and parameter gradients, the latter summed
over the sp group)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed

pytestmark = pytest.mark.distributed

# (architecture, q heads, kv heads, value model): kv == sp, kv < sp (repeated kv heads), kv > sp, MoE
CASES = [
    ("llama", 4, 2, False),
    ("qwen2", 4, 1, False),
    ("mistral", 4, 4, False),
    ("qwen3_moe", 4, 2, False),
    ("llama", 4, 2, True),
]


def _check_primitives(rank: int, world: int) -> None:
    from underlay.parallel.ulysses import (
        gather_seq,
        head_to_seq,
        repeat_kv_for_sp,
        seq_to_head,
        slice_for_rank,
    )

    g = torch.Generator().manual_seed(7)
    full = torch.randn(6 * world, 4, 3, generator=g, dtype=torch.float64)
    scale = torch.randn(4, generator=g, dtype=torch.float64)
    upstream = torch.randn(6 * world, 4, 3, generator=g, dtype=torch.float64)
    local = slice_for_rank(full, dist.group.WORLD).clone().requires_grad_(True)
    heads = seq_to_head(local, dist.group.WORLD)
    hl = 4 // world
    torch.testing.assert_close(heads, full[:, rank * hl : (rank + 1) * hl], rtol=0, atol=0)
    back = head_to_seq(heads * scale[rank * hl : (rank + 1) * hl, None], dist.group.WORLD)
    torch.testing.assert_close(back, local * scale[:, None], rtol=0, atol=0)
    (back * slice_for_rank(upstream, dist.group.WORLD)).sum().backward()
    assert local.grad is not None
    torch.testing.assert_close(local.grad, slice_for_rank(upstream * scale[:, None], dist.group.WORLD))
    # gather: every rank gets the whole sequence; backward keeps this rank's slice
    x = local.detach().clone().requires_grad_(True)
    gathered = gather_seq(x, dist.group.WORLD)
    torch.testing.assert_close(gathered, full, rtol=0, atol=0)
    (gathered * upstream).sum().backward()
    torch.testing.assert_close(x.grad, slice_for_rank(upstream, dist.group.WORLD))
    # kv heads fewer than sp are repeated so that rank r gets the kv head its q heads use
    kv = torch.randn(5, 1, 3, generator=g)
    assert repeat_kv_for_sp(kv, world).shape == (5, world, 3)


def _check_model(arch: str, heads: int, kv_heads: int, value: bool) -> None:
    from tests.unit.models._tiny import clone, logprob_kernel, padded_batch, tiny_model
    from underlay.models import packed_forward, prepare_model
    from underlay.ops.packing import unpad

    ref = tiny_model(arch, heads=heads, kv_heads=kv_heads, value=value)
    ids, mask = padded_batch([6, 2, 3], 6, seed=5)  # 11 tokens: padded to 12 over 2 ranks
    packed = unpad(ids, mask)
    g = torch.Generator().manual_seed(11)
    w1 = torch.randn(packed.total_tokens, generator=g)
    w2 = torch.randn(packed.total_tokens, generator=g)

    def run(group: Any | None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        model = prepare_model(clone(ref), attention="eager", sp_group=group)
        out = packed_forward(model, packed, temperature=0.9, logprob_kernel=logprob_kernel())
        fields = [t for t in (out.log_probs, out.entropy, out.values) if t is not None]
        loss = sum((t * w).sum() for t, w in zip(fields, (w1, w2)))
        if out.aux_loss is not None:  # MoE router auxiliary loss: over the whole packed batch on every rank
            loss = loss + 3.0 * out.aux_loss
            fields.append(out.aux_loss.reshape(1).expand(packed.total_tokens))
        loss.backward()  # type: ignore[union-attr]
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return [t.detach() for t in fields], grads

    single, single_grads = run(None)
    sp_out, sp_grads = run(dist.group.WORLD)
    moe_aux = 1 if not value and arch in ("mixtral", "qwen3_moe", "gpt_oss") else 0
    assert len(single) == len(sp_out) == (1 if value else 2) + moe_aux
    for a, b in zip(sp_out, single):
        assert a.shape == (packed.total_tokens,)
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    assert sp_grads.keys() == single_grads.keys()
    for name, grad in sp_grads.items():
        dist.all_reduce(grad)  # each rank holds its share; the sum is the whole gradient
        torch.testing.assert_close(grad, single_grads[name], atol=2e-5, rtol=1e-4, msg=f"{arch}: {name}")


def _check_padded_input_is_refused_and_tiny_batches_work() -> None:
    from tests.unit.models._tiny import logprob_kernel, padded_batch, tiny_model
    from underlay.interfaces import UnsupportedOperation
    from underlay.models import packed_forward, prepare_model
    from underlay.ops.packing import unpad

    model = prepare_model(tiny_model("qwen3"), attention="eager", sp_group=dist.group.WORLD)
    model = copy.deepcopy(model)  # a copy (e.g. a reference policy) keeps routing over the same group
    ids, mask = padded_batch([5, 3], 5)
    with pytest.raises(UnsupportedOperation, match="packed input"):
        model(input_ids=ids, attention_mask=mask)
    # the model called directly on this rank's slice of packed input: boundaries come from the
    # position ids gathered over the group
    ref = prepare_model(tiny_model("qwen3"), attention="eager")  # one process, whole packed input
    packed = unpad(ids, mask)  # 8 tokens, 4 per rank
    rank = dist.get_rank()
    local = slice(4 * rank, 4 * rank + 4)
    got = model(input_ids=packed.input_ids[None, local], position_ids=packed.position_ids[None, local])
    want = ref(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None])
    torch.testing.assert_close(got.logits[0], want.logits[0, local], atol=1e-5, rtol=1e-5)
    one = unpad(ids[:1, :1], mask[:1, :1])  # a single token: padded to one per rank
    out = packed_forward(model, one, logprob_kernel=logprob_kernel())
    assert out.log_probs is not None and out.log_probs.tolist() == [0.0]
    out.log_probs.sum().backward()


def _check_long_rope() -> None:
    """Phi-3 long-rope under sp=2: a sequence split across the ranks gets its whole length's factor
    (rank 0 alone sees 11 of its 30 positions, below the original length 16), as in one process."""
    from tests.unit.models._f64 import f64_model, packed
    from tests.unit.models.test_model_fixes import LONGROPE
    from underlay.models import packed_forward, prepare_model
    from underlay.registry import get_logprob_kernel

    ref = f64_model("phi3", **LONGROPE)
    g = torch.Generator().manual_seed(2)
    batch = packed([torch.randint(3, 96, (n,), generator=g) for n in (8, 30)])
    outs = []
    for group in (None, dist.group.WORLD):
        model = prepare_model(copy.deepcopy(ref), attention="eager", sp_group=group)
        with torch.no_grad():
            outs.append(packed_forward(model, batch, logprob_kernel=get_logprob_kernel("torch")).log_probs)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=0)


def _worker(rank: int, world: int) -> int:
    _check_primitives(rank, world)
    _check_long_rope()
    _check_padded_input_is_refused_and_tiny_batches_work()
    for case in CASES:
        _check_model(*case)
    return len(CASES)


def test_ulysses_two_processes_match_one() -> None:
    assert run_distributed(_worker, 2, timeout_s=300) == [len(CASES)] * 2
