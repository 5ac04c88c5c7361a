"""Gemma 2 under the default settings (issue 35: the Gemma-2-2B shape ran out of memory with them).

- The soft-capped head: ``packed_forward`` hands the registry's log-prob kernel the final-logit cap, so
  forward and backward never hold ``[tokens, vocab]`` logits, and the values are transformers' capped ones.
- The attention softcap: no fused kernel of a CPU host (nor of the H200 image, which has no flash-attn)
  runs it, so Gemma 2's layers run the eager kernel, whose ``[heads, S, S]`` fp32 scores the memory
  estimate counts: the policy recomputes instead of keeping 26 layers of scores.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.unit.models._tiny import clone, padded_batch, reference_logprobs, tiny_model
from underlay.backends.portable.logprob import TorchLogprobKernel
from underlay.engines.fsdp2.defaults import (
    EAGER_ATTENTION_BACKWARD_BYTES,
    EAGER_ATTENTION_SAVED_BYTES,
    choose_memory_policy,
    estimate_memory,
)
from underlay.models import packed_forward, prepare_model
from underlay.ops.packing import pad, unpad

H200 = 143771 * (1 << 20)  # memory.total of the lent H200 (nvidia-smi), bytes


class _Largest(TorchDispatchMode):
    """The largest element count of any tensor an operator returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0
        self.op = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


def test_default_gemma2_head_is_capped_and_never_materialises_tokens_by_vocab(monkeypatch: Any) -> None:
    vocab, seqlens = 4096, [120, 70, 100]
    tokens = sum(seqlens)
    # 32-token chunks of the portable kernel (the cpu default), so a [tokens, vocab] tensor is no chunk
    monkeypatch.setattr(TorchLogprobKernel, "CHUNK_ELEMENTS", 32 * vocab)
    ref = tiny_model("gemma2", vocab_size=vocab)
    model = prepare_model(clone(ref))  # every setting its default: attention and log-prob kernels auto
    ids, mask = padded_batch(seqlens, max(seqlens))
    packed = unpad(ids, mask)
    largest = _Largest()
    with largest:
        out = packed_forward(model, packed)
        assert out.log_probs is not None and out.entropy is not None
        (out.log_probs.sum() + out.entropy.sum()).backward()
    # the embedding [vocab, hidden] and one 32-token chunk are the largest tensors; never [tokens, vocab]
    assert largest.numel < tokens * vocab // 4, (largest.numel, largest.op)
    ref_lp, ref_ent = reference_logprobs(ref, ids, mask)  # transformers' own logits, capped
    torch.testing.assert_close(pad(out.log_probs, packed).double(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(pad(out.entropy, packed).double(), ref_ent, atol=2e-5, rtol=0)


def _gemma2_2b_shape() -> Any:
    from transformers import Gemma2Config

    from underlay.engines.fsdp2 import _build
    from underlay.engines.fsdp2._auto import model_shape
    from underlay.interfaces import ModelConfig

    cfg = Gemma2Config(attention_dropout=0.0)  # its defaults are the 2B shape: 26 layers, vocab 256000
    model = _build.build_model(ModelConfig(hf_config=cfg), cfg, meta=True)
    return model_shape(model, cfg, device_type="cpu")


def test_gemma2_eager_attention_scores_make_the_policy_recompute() -> None:
    g = _gemma2_2b_shape()
    assert g.eager_attention_layers == 26 and g.heads == 8 and g.vocab == 256000
    tokens = 16384
    policy = choose_memory_policy(
        g, device_total=H200, tokens=tokens, compiled=True, compile_memory_budget=0.85
    )
    assert (policy.recompute, policy.keep_unsharded, policy.optimizer_offload) == ("full", True, False)
    assert policy.fits, policy.reason
    scores = g.heads * tokens * tokens
    assert policy.estimate.attention == scores * (
        EAGER_ATTENTION_SAVED_BYTES + EAGER_ATTENTION_BACKWARD_BYTES
    )
    # without recomputation the saved scores of every layer alone exceed the device
    kept = estimate_memory(
        g,
        tokens=tokens,
        recompute="none",
        keep_unsharded=True,
        optimizer_offload=False,
        compiled=True,
        compile_memory_budget=0.85,
    )
    assert kept.attention > H200
    # with a fused kernel for its attention (flash-attn >= 2.6) nothing is counted and no recompute is needed
    fused = replace(g, eager_attention_layers=0)
    policy = choose_memory_policy(
        fused, device_total=H200, tokens=tokens, compiled=True, compile_memory_budget=0.85
    )
    assert policy.recompute == "none" and policy.estimate.attention == 0, policy.reason
