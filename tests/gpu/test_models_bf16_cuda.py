"""bf16 equivalence of the Hugging Face integration on a CUDA GPU.

For tiny random models of every verified architecture (``ARCHS``: the original five plus Gemma 2/3,
Mixtral, Phi-3, GLM-4, DeepSeek-V3 and gpt-oss), on cuda in bf16 with the kernels the registry
picks there (attention: ``torch`` = varlen_attn/SDPA unless flash_attn is installed; log-prob:
``triton``), compares against an fp32 eager padded forward of the *unpatched* model (ground truth):

- ``ours``: ``prepare_model`` + ``packed_forward`` (packed THD, fused head), bf16;
- ``hf``:   the unpatched model in bf16 with transformers' own ``sdpa`` padded forward (``eager``
            where the architecture has no sdpa path) and ``logits.log_softmax`` -- the error a bf16
            run has anyway.

Vision-language models (``VL_ARCHS``: Qwen2.5-VL, Qwen3-VL) are checked the same way with images in two of
three sequences (the vision tower inside the packed forward; ``hf`` is their sdpa padded forward).

A row passes when our log-prob/entropy errors are within 1.5x (+ a small floor) of the ``hf`` bf16
errors and the cosine of our parameter gradient (of a weighted log-prob loss) to the fp32 gradient is
>= 0.99. Value models (token classification, ``num_labels=1``), the padded route (an attention mask
through ``kernel.padded``) and TiledMLP (vs the plain MLP in bf16) are checked the same way.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from underlay.models import SUPPORTED_ARCHITECTURES, TiledMLP, packed_forward, prepare_model
from underlay.ops.packing import pad, unpad
from underlay.registry import get_logprob_kernel

pytestmark = pytest.mark.gpu

_CUDA = torch.device("cuda")

# the text architectures the library lists as verified (the vision-language ones: VL_ARCHS below)
ARCHS = tuple(a for a in SUPPORTED_ARCHITECTURES if not a.endswith(("_vl", "_vl_moe")))
VALUE_ARCHS = ("llama", "qwen3_moe", "gemma2", "deepseek_v3", "gpt_oss")
ALTERNATING = ["sliding_attention", "full_attention"]


def _overrides(arch: str, heads: int) -> dict[str, Any]:
    """Per-architecture config keys: short sliding windows (16 tokens) so the windows matter, softcaps,
    small MoE and MLA shapes."""
    if arch == "mistral":
        return dict(sliding_window=16)
    if arch == "qwen2":
        return dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    if arch == "qwen3_moe":
        return dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    if arch == "gemma2":
        return dict(
            sliding_window=16,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            layer_types=ALTERNATING,
        )
    if arch == "gemma3_text":
        return dict(sliding_window=16, query_pre_attn_scalar=16, layer_types=ALTERNATING)
    if arch == "mixtral":
        return dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=16)
    if arch == "phi3":
        return dict(sliding_window=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "glm4":
        return dict(partial_rotary_factor=0.5, pad_token_id=0)
    if arch == "deepseek_v3":
        # head_dim is the rotary part of the query/key head (transformers < 5.20 does not derive it)
        return dict(
            head_dim=16,
            num_key_value_heads=heads,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=24,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
        )
    if arch == "gpt_oss":
        return dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=ALTERNATING,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    return {}


def hf_bf16_attention(model: nn.Module) -> str:
    """Switch the unpatched bf16 model to transformers' ``sdpa``, or ``eager`` where the architecture
    has no sdpa path (gpt-oss's sinks); returns the implementation used."""
    try:
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
        return "sdpa"
    except (ValueError, ImportError):
        model.set_attn_implementation("eager")  # type: ignore[operator]
        return "eager"


def tiny_config(arch: str, quick: bool) -> Any:
    from transformers import AutoConfig

    kw: dict[str, Any] = dict(
        vocab_size=512 if quick else 4096,
        hidden_size=64 if quick else 256,
        intermediate_size=128 if quick else 688,
        num_hidden_layers=2,
        num_attention_heads=4 if quick else 8,
        num_key_value_heads=2,
        head_dim=16 if quick else 32,
        max_position_embeddings=1024,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    kw.update(_overrides(arch, int(kw["num_attention_heads"])))
    cfg = AutoConfig.for_model(arch, **kw)
    return cfg


def build(arch: str, quick: bool, value: bool, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cfg = tiny_config(arch, quick)
    torch.manual_seed(0)
    if value:
        cfg.num_labels = 1
        model = AutoModelForTokenClassification.from_config(cfg, attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.float().to(device).eval()


def batch(quick: bool, device: torch.device, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    lens = [23, 7, 16, 1] if quick else [300, 57, 129, 1, 211]
    s = max(lens)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (len(lens), s), generator=g)
    mask = torch.zeros(len(lens), s, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    return ids.to(device), mask.to(device)


def padded_logprobs(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    lsm = logits.log_softmax(-1)
    lp = torch.zeros(ids.shape, device=ids.device)
    ent = torch.zeros(ids.shape, device=ids.device)
    lp[:, 1:] = lsm[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ent[:, 1:] = -(lsm.exp() * lsm).sum(-1)[:, :-1]
    scored = torch.zeros_like(mask, dtype=torch.bool)
    scored[:, 1:] = (mask[:, 1:] > 0) & (mask[:, :-1] > 0)
    return lp * scored, ent * scored


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat(
        [p.grad.float().reshape(-1) for _, p in sorted(model.named_parameters()) if p.grad is not None]
    )


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def errs(x: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor) -> tuple[float, float]:
    d = (x.detach().double() - ref.detach().double()).abs()[keep]
    return float(d.max()), float(d.mean())


def check_causal(arch: str, quick: bool, device: torch.device, attention: str | None) -> dict[str, Any]:
    ref = build(arch, quick, False, device)
    ids, mask = batch(quick, device, ref.config.vocab_size)
    keep = mask.bool()
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)).to(device)

    ref_lp, ref_ent = padded_logprobs(ref, ids, mask)
    (ref_lp * w).sum().backward()
    g_ref = flat_grad(ref)

    hf = copy.deepcopy(ref).to(torch.bfloat16)
    hf.zero_grad(set_to_none=True)
    hf_impl = hf_bf16_attention(hf)
    hf_lp, hf_ent = padded_logprobs(hf, ids, mask)
    (hf_lp * w).sum().backward()
    g_hf = flat_grad(hf)

    ours = prepare_model(copy.deepcopy(ref).to(torch.bfloat16), attention=attention)
    ours.zero_grad(set_to_none=True)
    packed = unpad(ids, mask)
    kernel = get_logprob_kernel()
    out = packed_forward(ours, packed, logprob_kernel=kernel)
    assert out.log_probs is not None and out.entropy is not None
    lp, ent = pad(out.log_probs, packed), pad(out.entropy, packed)
    (lp * w).sum().backward()
    g_ours = flat_grad(ours)

    # the padded route: the prepared model called with an attention mask (kernel.padded)
    with torch.no_grad():
        pad_lp, _ = padded_logprobs(ours, ids, mask)

    row: dict[str, Any] = {
        "check": f"{arch} causal-lm",
        "logprob_kernel": kernel.name,
        "hf_attention": hf_impl,
    }
    row["lp_max_ours"], row["lp_mean_ours"] = errs(lp, ref_lp, keep)
    row["lp_max_hf"], row["lp_mean_hf"] = errs(hf_lp, ref_lp, keep)
    row["ent_max_ours"], row["ent_mean_ours"] = errs(ent, ref_ent, keep)
    row["ent_max_hf"], row["ent_mean_hf"] = errs(hf_ent, ref_ent, keep)
    row["lp_max_padded_route"], row["lp_mean_padded_route"] = errs(pad_lp, ref_lp, keep)
    row["grad_cos_ours"], row["grad_cos_hf"] = cosine(g_ours, g_ref), cosine(g_hf, g_ref)
    row["ok"] = bool(
        row["lp_mean_ours"] <= 1.5 * row["lp_mean_hf"] + 2e-3
        and row["lp_max_ours"] <= 1.5 * row["lp_max_hf"] + 2e-2
        and row["ent_mean_ours"] <= 1.5 * row["ent_mean_hf"] + 2e-3
        and row["lp_mean_padded_route"] <= 1.5 * row["lp_mean_hf"] + 2e-3
        and row["grad_cos_ours"] >= 0.99
    )
    return row


def check_value(arch: str, quick: bool, device: torch.device, attention: str | None) -> dict[str, Any]:
    ref = build(arch, quick, True, device)
    ids, mask = batch(quick, device, ref.config.vocab_size)
    keep = mask.bool()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0].float()
    (want * keep).sum().backward()
    g_ref = flat_grad(ref)
    hf = copy.deepcopy(ref).to(torch.bfloat16)
    hf.zero_grad(set_to_none=True)
    hf_impl = hf_bf16_attention(hf)
    hf_v = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0].float()
    ours = prepare_model(copy.deepcopy(ref).to(torch.bfloat16), attention=attention)
    ours.zero_grad(set_to_none=True)
    packed = unpad(ids, mask)
    out = packed_forward(ours, packed)
    assert out.values is not None
    values = pad(out.values, packed)
    values.sum().backward()
    row: dict[str, Any] = {"check": f"{arch} value-model", "logprob_kernel": "-", "hf_attention": hf_impl}
    row["lp_max_ours"], row["lp_mean_ours"] = errs(values, want, keep)
    row["lp_max_hf"], row["lp_mean_hf"] = errs(hf_v, want, keep)
    row["grad_cos_ours"] = cosine(flat_grad(ours), g_ref)
    row["ok"] = bool(row["lp_mean_ours"] <= 1.5 * row["lp_mean_hf"] + 2e-3 and row["grad_cos_ours"] >= 0.99)
    return row


VL_ARCHS = ("qwen2_5_vl", "qwen3_vl")
"""Vision-language models checked with images in some sequences (packed forward with the vision tower)."""


def build_vl(arch: str, quick: bool, device: torch.device) -> nn.Module:
    """A small random Qwen2.5-VL / Qwen3-VL (2 text layers, 2 vision blocks, 2x2 patches merged 2x2;
    token ids 500-503 are the image / video / vision-start / vision-end tokens)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    hidden = 64 if quick else 256
    text: dict[str, Any] = dict(
        vocab_size=512 if quick else 4096,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4 if quick else 8,
        num_key_value_heads=2,
        attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        bos_token_id=0,
        eos_token_id=1,
    )
    vision: dict[str, Any] = dict(
        depth=2, hidden_size=32 if quick else 128, intermediate_size=48 if quick else 256, num_heads=2,
        out_hidden_size=hidden, patch_size=2, spatial_merge_size=2, temporal_patch_size=1,
    )  # fmt: skip
    if arch == "qwen2_5_vl":
        vision.update(window_size=8, fullatt_block_indexes=[1])
    else:
        text.update(head_dim=16 if quick else 32)
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True)
        if not quick:
            text["rope_parameters"]["mrope_section"] = [4, 6, 6]
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
    if arch == "qwen2_5_vl" and not quick:
        text["rope_parameters"]["mrope_section"] = [4, 6, 6]  # head_dim 32: 16 rotary pairs
    cfg = AutoConfig.for_model(
        arch, text_config=text, vision_config=vision, image_token_id=500, video_token_id=501,
        vision_start_token_id=502, vision_end_token_id=503, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.float().to(device).eval()  # type: ignore[no-any-return]


def vl_batch(quick: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Three right-padded sequences: an image inside the first, one at the start of the second, the
    third text-only; images of ``side x side`` patches."""
    side = 8 if quick else 16
    g = torch.Generator().manual_seed(1)
    image = [502] + [500] * (side * side // 4) + [503]

    def text(n: int) -> list[int]:
        return torch.randint(0, 500, (n,), generator=g).tolist()

    seqs = [text(9) + image + text(20), image + text(33), text(57 if quick else 150)]
    s = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask = torch.zeros(len(seqs), s, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    grid = torch.tensor([[1, side, side]] * 2)
    pixels = torch.randn(2 * side * side, 3 * 2 * 2, generator=g)
    return (
        ids.to(device),
        mask.to(device),
        {"pixel_values": pixels.to(device), "image_grid_thw": grid.to(device)},
    )


def vl_padded_logprobs(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, mm: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    kinds = (ids == 500).long()
    logits = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=kinds, **mm).logits.float()
    lsm = logits.log_softmax(-1)
    lp = torch.zeros(ids.shape, device=ids.device)
    ent = torch.zeros(ids.shape, device=ids.device)
    lp[:, 1:] = lsm[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ent[:, 1:] = -(lsm.exp() * lsm).sum(-1)[:, :-1]
    scored = torch.zeros_like(mask, dtype=torch.bool)
    scored[:, 1:] = (mask[:, 1:] > 0) & (mask[:, :-1] > 0)
    return lp * scored, ent * scored


def check_vl(arch: str, quick: bool, device: torch.device, attention: str | None) -> dict[str, Any]:
    """As ``check_causal`` for a vision-language model with images (``hf``: sdpa, bf16)."""
    ref = build_vl(arch, quick, device)
    ids, mask, mm = vl_batch(quick, device)
    keep = mask.bool()
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)).to(device)
    ref_lp, ref_ent = vl_padded_logprobs(ref, ids, mask, mm)
    (ref_lp * w).sum().backward()
    g_ref = flat_grad(ref)
    mm16 = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in mm.items()}
    hf = copy.deepcopy(ref).to(torch.bfloat16)
    hf.zero_grad(set_to_none=True)
    hf_impl = hf_bf16_attention(hf)
    hf_lp, hf_ent = vl_padded_logprobs(hf, ids, mask, mm16)
    (hf_lp * w).sum().backward()
    g_hf = flat_grad(hf)
    ours = prepare_model(copy.deepcopy(ref).to(torch.bfloat16), attention=attention)
    ours.zero_grad(set_to_none=True)
    packed = unpad(ids, mask)
    kernel = get_logprob_kernel()
    out = packed_forward(ours, packed, logprob_kernel=kernel, multimodal=mm16)
    assert out.log_probs is not None and out.entropy is not None
    lp, ent = pad(out.log_probs, packed), pad(out.entropy, packed)
    (lp * w).sum().backward()
    g_ours = flat_grad(ours)
    row: dict[str, Any] = {
        "check": f"{arch} causal-lm + images",
        "logprob_kernel": kernel.name,
        "hf_attention": hf_impl,
    }
    row["lp_max_ours"], row["lp_mean_ours"] = errs(lp, ref_lp, keep)
    row["lp_max_hf"], row["lp_mean_hf"] = errs(hf_lp, ref_lp, keep)
    row["ent_max_ours"], row["ent_mean_ours"] = errs(ent, ref_ent, keep)
    row["ent_max_hf"], row["ent_mean_hf"] = errs(hf_ent, ref_ent, keep)
    row["grad_cos_ours"], row["grad_cos_hf"] = cosine(g_ours, g_ref), cosine(g_hf, g_ref)
    row["ok"] = bool(
        row["lp_mean_ours"] <= 1.5 * row["lp_mean_hf"] + 2e-3
        and row["lp_max_ours"] <= 1.5 * row["lp_max_hf"] + 2e-2
        and row["ent_mean_ours"] <= 1.5 * row["ent_mean_hf"] + 2e-3
        and row["grad_cos_ours"] >= 0.99
    )
    return row


def check_tiled(quick: bool, device: torch.device) -> dict[str, Any]:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    h, f, n = (64, 256, 512) if quick else (1024, 4096, 8192)
    torch.manual_seed(0)
    mlp = Qwen2MLP(Qwen2Config(hidden_size=h, intermediate_size=f)).to(device, torch.bfloat16)
    x = torch.randn(1, n, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(1, n, h, device=device, dtype=torch.bfloat16)
    y = mlp(x)
    (y.float() * up.float()).sum().backward()
    gx, gp = x.grad.clone(), [p.grad.clone() for p in mlp.parameters()]  # type: ignore[union-attr]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    yt = TiledMLP(mlp, 8)(x)
    (yt.float() * up.float()).sum().backward()
    assert x.grad is not None
    fwd = float((yt.float() - y.float()).abs().max())
    cos_x = cosine(x.grad.float().reshape(-1), gx.float().reshape(-1))
    cos_p = min(
        cosine(p.grad.float().reshape(-1), g.float().reshape(-1)) for p, g in zip(mlp.parameters(), gp)
    )  # type: ignore[union-attr]
    return {
        "check": f"TiledMLP x8 ({n} tok, {h}->{f})",
        "logprob_kernel": "-",
        "lp_max_ours": fwd,
        "grad_cos_ours": min(cos_x, cos_p),
        "ok": bool(fwd <= 0.05 * float(y.float().abs().max()) and min(cos_x, cos_p) >= 0.999),
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_causal_lm_bf16_error_within_hf_bf16_error(arch: str) -> None:
    row = check_causal(arch, False, _CUDA, None)
    assert row["ok"], row


@pytest.mark.parametrize("arch", VALUE_ARCHS)
def test_value_model_bf16_error_within_hf_bf16_error(arch: str) -> None:
    row = check_value(arch, False, _CUDA, None)
    assert row["ok"], row


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vision_language_bf16_error_within_hf_bf16_error(arch: str) -> None:
    row = check_vl(arch, False, _CUDA, None)
    assert row["ok"], row


def test_tiled_mlp_matches_plain_mlp_in_bf16() -> None:
    row = check_tiled(False, _CUDA)
    assert row["ok"], row
