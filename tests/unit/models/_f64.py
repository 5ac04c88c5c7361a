"""Float64 tiny models with every parameter moved off its initial value, and transformers' own eager
forward per sequence as the reference (no padding, each sequence alone)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from underlay.interfaces import PackedBatch
from underlay.models import packed_forward, prepare_model
from underlay.ops.packing import pad, unpad
from underlay.registry import get_logprob_kernel

TINY: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)


def f64_model(arch: str, *, seed: int = 0, **overrides: Any) -> nn.Module:
    """A float64 causal LM of ``arch`` (tiny sizes, eager attention and experts) whose every parameter
    and floating buffer-free weight is perturbed off its init (norm weights and biases included)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").double()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.state_dict().items():  # persistent buffers (routing biases) too
            if b.is_floating_point() and name not in dict(model.named_parameters()):
                b.add_(torch.randn_like(b) * 0.2)
    return model.eval()


LISTED: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": dict(sliding_window=4),
    "qwen2": {},
    "qwen3": dict(head_dim=8),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
    ),
    "gemma2": dict(head_dim=8),
    "gemma3_text": dict(head_dim=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "glm4": dict(head_dim=8, pad_token_id=0),
    "glm4_moe": dict(
        head_dim=8,
        pad_token_id=0,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
    ),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
    ),
    "gpt_oss": dict(
        num_local_experts=4, num_experts_per_tok=2, head_dim=8, layer_types=["full_attention"] * 2
    ),
}
"""Tiny overrides (on top of :data:`TINY`) of the listed text architectures (plus qwen2_moe, glm4_moe)."""


def reference(model: nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per sequence ``[L]`` float64 log-probs of transformers' eager forward on that sequence alone
    (0 at position 0)."""
    out = []
    with torch.no_grad():
        for ids in seqs:
            lsm = model(input_ids=ids[None]).logits[0].double().log_softmax(-1)
            lp = torch.zeros(ids.shape, dtype=torch.float64)
            lp[1:] = lsm[:-1].gather(-1, ids[1:, None])[:, 0]
            out.append(lp)
    return out


def packed(seqs: list[torch.Tensor]) -> PackedBatch:
    """The sequences as one packed batch (in order)."""
    longest = max(int(s.numel()) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : s.numel()] = s
        mask[i, : s.numel()] = 1
    return unpad(ids, mask)


def underlay_logprobs(model: nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per sequence ``[L]`` log-probs of a prepared model's packed forward over all ``seqs`` at once."""
    batch = packed(seqs)
    with torch.no_grad():
        out = packed_forward(model, batch, logprob_kernel=get_logprob_kernel("torch"))
    assert out.log_probs is not None
    lp = pad(out.log_probs, batch).double()
    return [lp[i, : s.numel()] for i, s in enumerate(seqs)]


def prepared(model: nn.Module) -> nn.Module:
    """A prepared deep copy of ``model`` (eager attention kernel)."""
    import copy

    return prepare_model(copy.deepcopy(model), attention="eager")


def sequences(lengths: list[int], vocab: int = 96, seed: int = 1) -> list[torch.Tensor]:
    """Random token sequences of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
