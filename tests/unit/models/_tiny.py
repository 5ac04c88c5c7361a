"""Tiny random-initialised Hugging Face models of every supported architecture, built from configs.

Nothing is downloaded. Shapes are small (hidden 64, 2 layers, vocab 160) so a CPU forward+backward takes
milliseconds. ``mistral`` and ``qwen2`` use a short sliding window (4 tokens, on every / the second
layer) so the window routing is exercised by sequences longer than it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from underlay.interfaces import LogprobKernel
from underlay.registry import get_logprob_kernel

VOCAB = 160
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
NEW_ARCHS = ("gemma2", "gemma3_text", "mixtral", "phi3", "glm4", "deepseek_v3", "gpt_oss")
"""Architectures added through capability inspection: softcaps and alternating sliding windows (Gemma),
MoE (Mixtral, DeepSeek-V3, gpt-oss), fused q/k/v and gate/up projections (Phi-3, GLM-4), partial rotary
(GLM-4), multi-head latent attention with a value head dim != the query/key one (DeepSeek-V3) and
attention sinks (gpt-oss)."""
ALL_ARCHS = ARCHS + NEW_ARCHS


def tiny_config(arch: str, *, heads: int = 4, kv_heads: int = 2, **overrides: Any) -> Any:
    """A transformers config of ``arch`` with tiny sizes (eager attention, fp32)."""
    from transformers import AutoConfig

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    if arch == "mistral":
        common.update(sliding_window=4, head_dim=16)
    elif arch == "qwen2":
        common.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    elif arch == "qwen3":
        common.update(head_dim=16)
    elif arch == "qwen3_moe":
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    elif arch == "gemma2":
        common.update(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=4,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=5.0,
            layer_types=["sliding_attention", "full_attention"],
        )
    elif arch == "gemma3_text":
        common.update(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=4,
            final_logit_softcapping=5.0,
            layer_types=["sliding_attention", "full_attention"],
        )
    elif arch == "mixtral":
        common.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=4, head_dim=16)
    elif arch == "phi3":
        common.update(sliding_window=5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif arch == "glm4":
        common.update(head_dim=16, partial_rotary_factor=0.5, pad_token_id=0)
    elif arch == "deepseek_v3":
        common.update(
            num_key_value_heads=heads,
            q_lora_rank=32,
            kv_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
        )
    elif arch == "gpt_oss":
        common.update(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    common.update(overrides)
    cfg = AutoConfig.for_model(arch, **common)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(arch: str, *, value: bool = False, seed: int = 0, **overrides: Any) -> nn.Module:
    """A random fp32 causal LM (or, with ``value``, a token-classification model with one label)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    if value:
        cfg.num_labels = 1
        model = AutoModelForTokenClassification.from_config(cfg, attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.float()
    with torch.no_grad():  # larger weights than HF's init so the log-probs are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model.eval()


def clone(model: nn.Module) -> nn.Module:
    """An independent copy (same weights)."""
    return copy.deepcopy(model)


def logprob_kernel() -> LogprobKernel:
    """The portable ``torch`` LogprobKernel (what cpu hosts use)."""
    return get_logprob_kernel("torch")


def padded_batch(
    seqlens: list[int], seqlen: int, *, left: bool = False, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``input_ids [B, S]`` and a 0/1 ``attention_mask`` with the given real lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(seqlens), seqlen), generator=g)
    mask = torch.zeros(len(seqlens), seqlen, dtype=torch.long)
    for i, n in enumerate(seqlens):
        if left:
            mask[i, seqlen - n :] = 1
        else:
            mask[i, :n] = 1
    return ids, mask


def reference_logprobs(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log-probs and entropy ``[B, S]`` from the unpatched model's padded forward:
    ``logits.log_softmax`` with position ``t`` scoring ``ids[:, t]``; 0 at position 0 of every
    sequence and at padding."""
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.double() / temperature
    lsm = logits.log_softmax(-1)
    lp = torch.zeros(ids.shape, dtype=torch.float64)
    ent = torch.zeros(ids.shape, dtype=torch.float64)
    lp[:, 1:] = lsm[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ent[:, 1:] = -(lsm.exp() * lsm).sum(-1)[:, :-1]
    # a token scores only when it and its predecessor are real tokens of the same row
    scored = torch.zeros_like(mask, dtype=torch.bool)
    scored[:, 1:] = (mask[:, 1:] > 0) & (mask[:, :-1] > 0)
    return lp * scored, ent * scored


def reference_values(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 values ``[B, S]`` of an unpatched value model's padded forward (0 at padding)."""
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    values = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0].double()
    return values * mask


IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 150, 151, 152, 153


VL_ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def tiny_vl_model(arch: str = "qwen2_5_vl", seed: int = 0, moe_intermediate: int = 32) -> nn.Module:
    """A random fp32 Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE (2 text layers, 2 vision blocks; 2x2 patches
    merged 2x2, so a 4x4-patch image is 4 placeholder tokens). Token ids 150-153 are the image/video/
    vision-start/vision-end tokens. Qwen2.5-VL has a window block and a full one; Qwen3-VL(-MoE) a
    deepstack merger; Qwen3-VL-MoE 4 experts (top 2, ``moe_intermediate`` wide) in every text layer."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        bos_token_id=0,
        eos_token_id=1,
    )
    vision: dict[str, Any] = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=1,
    )
    if arch == "qwen2_5_vl":
        vision.update(window_size=8, fullatt_block_indexes=[1])
    else:
        text.update(head_dim=16)
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True)
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
        if arch == "qwen3_vl_moe":
            text.update(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=moe_intermediate,
                decoder_sparse_step=1,
            )
    cfg = AutoConfig.for_model(
        arch,
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg).float()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or (p.dim() == 3 and ".experts." in name):  # the MoE's fused experts are 3-D
                p.normal_(0, 0.15)
    return model.eval()


def vl_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Three right-padded sequences: two with one 4x4-patch image each (one of them at the start),
    one text-only; ``(input_ids [3, S], attention_mask, {pixel_values, image_grid_thw})``."""
    g = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(0, 140, (n,), generator=g).tolist()

    image = [VISION_START] + [IMAGE_TOKEN] * 4 + [VISION_END]
    seqs = [text(3) + image + text(4), image + text(5), text(7)]
    s = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask = torch.zeros(len(seqs), s, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    grid = torch.tensor([[1, 4, 4], [1, 4, 4]])
    pixels = torch.randn(32, 3 * 2 * 2, generator=g)
    return ids, mask, {"pixel_values": pixels, "image_grid_thw": grid}


def save_vl_source(src: Path) -> Path:
    """Save the tiny Qwen2.5-VL with transformers (flat checkpoint names) into ``src``, with an image
    processor (the PIL one: no torchvision needed) and a word-level tokenizer that knows the vision
    tokens, all built here. Returns ``src``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tiny_vl_model("qwen2_5_vl").save_pretrained(str(src))
    vocab = {f"t{i}": i for i in range(150)}
    for i, tok in enumerate(("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")):
        vocab[tok] = IMAGE_TOKEN + i
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", pad_token="t1", eos_token="t1")
    # the vision tokens stay whole in text (as in the released tokenizers), so a processor's expanded
    # placeholders tokenize to IMAGE_TOKEN
    tok.add_tokens([t for t in vocab if t.startswith("<|")], special_tokens=True)
    tok.save_pretrained(str(src))
    Qwen2VLImageProcessorPil(
        patch_size=2, merge_size=2, temporal_patch_size=1, min_pixels=16, max_pixels=4096
    ).save_pretrained(str(src))
    return src
