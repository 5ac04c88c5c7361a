"""The architectures brought in through capability inspection (Gemma 2/3, Mixtral, Phi-3, GLM-4,
DeepSeek-V3, gpt-oss): packed forward through the routed kernel equals transformers' own padded forward
(log-probs, entropy, values, gradients; TiledMLP where the MLP allows), ``auto`` picks a kernel that can
run softcaps and sinks, the inspection refuses what it cannot run with the missing capability, the eager
kernel's attention sinks, and the FLOP counts of sliding windows, MLA and MoE."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit.models._tiny import (
    NEW_ARCHS,
    VL_ARCHS,
    VOCAB,
    clone,
    logprob_kernel,
    padded_batch,
    reference_logprobs,
    reference_values,
    tiny_config,
    tiny_model,
)
from underlay.interfaces import AttentionSpec, BackendUnavailable, ConfigError, InvalidInput
from underlay.models import inspect_model, packed_forward, prepare_model
from underlay.models.attention import ROUTE_ATTR, AttentionRoute
from underlay.ops.flops import FlopsCounter
from underlay.ops.packing import pad, unpad
from underlay.registry import get_attention

SEQLENS = [9, 3, 7, 1]  # longer than every tiny sliding window (4 or 5 tokens)
ATOL = 2e-5
VALUE_ARCHS = tuple(a for a in NEW_ARCHS if a != "gemma3_text")  # transformers has no Gemma3 text scorer


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """fp32 gradients against the reference's: each element within 1e-4 relative plus an absolute 1e-5
    scaled by the tensor's largest reference element (at least 1). The absolute part is normwise: an
    element is a sum of terms as large as the tensor's largest, so one that cancels to near zero keeps
    their fp32 rounding (fp32 log-probs, the outputs' contract, alone put ~1e-7 relative into every
    gradient: Qwen2.5-VL's patch embedding, largest element 50, differs by 3.8e-5 where its element is
    near zero, with the model in float64 too)."""
    assert a.keys() == b.keys() and a
    for name in a:
        scale = max(1.0, float(b[name].abs().max()))
        torch.testing.assert_close(a[name], b[name], atol=1e-5 * scale, rtol=1e-4, msg=name)


def _tiles(arch: str) -> int | None:
    return None if arch == "gpt_oss" else 3  # gpt-oss's MoE block returns a tuple: not tileable


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_packed_causal_lm_matches_padded_reference(arch: str) -> None:
    ref = tiny_model(arch)
    model = prepare_model(clone(ref), attention="eager", tiled_mlp_tiles=_tiles(arch))
    ids, mask = padded_batch(SEQLENS, 10)
    packed = unpad(ids, mask)
    out = packed_forward(model, packed, temperature=0.8, logprob_kernel=logprob_kernel())
    assert out.log_probs is not None and out.entropy is not None
    ref_lp, ref_ent = reference_logprobs(ref, ids, mask, 0.8)
    lp, ent = pad(out.log_probs, packed), pad(out.entropy, packed)
    torch.testing.assert_close(lp.double(), ref_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=ATOL, rtol=0)
    assert ref_lp.abs().sum() > 1
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (lp.double() * w + 0.1 * ent.double() * w).sum().backward()
    (ref_lp * w + 0.1 * ref_ent * w).sum().backward()
    _assert_grads_close(_grads(model), _grads(ref))


@pytest.mark.parametrize("arch", VALUE_ARCHS)
def test_packed_value_model_matches_padded_reference(arch: str) -> None:
    ref = tiny_model(arch, value=True)
    model = prepare_model(clone(ref), attention="eager")
    ids, mask = padded_batch(SEQLENS, 10)
    packed = unpad(ids, mask)
    out = packed_forward(model, packed)
    assert out.values is not None
    values, expected = pad(out.values, packed), reference_values(ref, ids, mask)
    torch.testing.assert_close(values.double(), expected, atol=ATOL, rtol=0)
    (values.double() * expected.detach()).sum().backward()
    (expected * expected.detach()).sum().backward()
    _assert_grads_close(_grads(model), _grads(ref))


def _kernels(model: torch.nn.Module) -> dict[AttentionSpec, str]:
    routes = [
        getattr(m, ROUTE_ATTR)
        for m in model.modules()
        if isinstance(getattr(m, ROUTE_ATTR, None), AttentionRoute)
    ]
    return {spec: kernel.name for route in routes for spec, kernel in route._kernels.items()}


@pytest.mark.parametrize(
    ("arch", "expected", "reason"),
    [("gemma2", "eager", "softcap"), ("gpt_oss", "eager", "sinks"), ("deepseek_v3", "torch", None)],
)
def test_auto_selects_a_kernel_that_can_run_the_case(arch: str, expected: str, reason: str | None) -> None:
    ref = tiny_model(arch)
    model = prepare_model(clone(ref))  # attention=None: UNDERLAY_ATTENTION or auto
    ids, mask = padded_batch(SEQLENS, 10)
    packed = unpad(ids, mask)
    out = packed_forward(model, packed, logprob_kernel=logprob_kernel())
    chosen = _kernels(model)
    assert chosen and set(chosen.values()) == {expected}, chosen
    if reason is not None:
        spec = next(iter(chosen))
        assert any(reason in why for why in get_attention("torch").supports(spec))
        # the torch kernel, asked for by name, refuses with the reason
        with pytest.raises(BackendUnavailable, match=reason):
            packed_forward(
                prepare_model(clone(ref), attention="torch"), packed, logprob_kernel=logprob_kernel()
            )
    else:  # latent attention (Dv != D) runs on torch SDPA
        assert next(iter(chosen)).head_dim_v != next(iter(chosen)).head_dim
    ref_lp, _ = reference_logprobs(ref, ids, mask)
    assert out.log_probs is not None
    torch.testing.assert_close(pad(out.log_probs, packed).double(), ref_lp, atol=ATOL, rtol=0)


def test_inspection_records_what_each_architecture_needs() -> None:
    gemma = inspect_model(tiny_model("gemma2"))
    assert gemma.final_logit_softcap == 5.0 and gemma.attention_softcap == 20.0
    assert gemma.layer_types == ("sliding_attention", "full_attention") and gemma.sliding_window == 4
    oss = inspect_model(tiny_model("gpt_oss"))
    assert oss.sinks and oss.moe_blocks == ("GptOssMLP",)
    ds = inspect_model(tiny_model("deepseek_v3"))
    assert ds.latent_attention and ds.moe_blocks == ("DeepseekV3MoE",) and len(ds.attention_modules) == 2
    assert inspect_model(tiny_model("mixtral")).moe_blocks == ("MixtralSparseMoeBlock",)
    assert not inspect_model(tiny_model("glm4")).latent_attention


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_fsdp2_finds_one_decoder_layer_per_hidden_layer(arch: str) -> None:
    """FSDP2 shards per decoder layer (the classes in ``_no_split_modules``)."""
    from underlay.engines.fsdp2.parallelize import decoder_layers

    model = tiny_model(arch)
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    assert all(type(layer).__name__.endswith("DecoderLayer") for layer in layers)


def test_softcapped_head_matches_dense_math() -> None:
    """The unfused head Gemma takes: log-softmax of ``c * tanh(h W^T / c) / T``, 0 at ignored labels."""
    from underlay.interfaces import IGNORE_INDEX
    from underlay.models import softcapped_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([1, 4, IGNORE_INDEX, 10, 0, 3])
    lp, ent = softcapped_logprobs(h, w, labels, 2.5, temperature=0.7)
    assert ent is not None and lp.dtype == torch.float32
    lsm = (2.5 * torch.tanh(h @ w.t() / 2.5) / 0.7).log_softmax(-1)
    keep = labels != IGNORE_INDEX
    want = lsm.gather(-1, labels.clamp(min=0)[:, None])[:, 0] * keep
    torch.testing.assert_close(lp.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent.double(), -(lsm.exp() * lsm).sum(-1) * keep, atol=1e-6, rtol=0)
    assert lp[2] == 0 and ent[2] == 0


def test_inspection_refuses_with_the_missing_capability() -> None:
    from transformers import CohereConfig, CohereForCausalLM

    cohere = CohereForCausalLM(
        CohereConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(ConfigError, match=r"'cohere'.*logit_scale=0\.0625.*verified by tests: llama"):
        prepare_model(cohere)
    chunked = tiny_model("llama")
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ConfigError, match=r"layer types \['chunked_attention'\]"):
        prepare_model(chunked)
    assert chunked.config._attn_implementation == "eager"  # refused before anything changed
    vl = tiny_model("llama")
    vl.config.vision_config = {"depth": 1}
    with pytest.raises(ConfigError, match="vision-language"):
        prepare_model(vl)
    with pytest.raises(ConfigError, match="GptOssMLP.forward returns a tuple"):
        prepare_model(tiny_model("gpt_oss"), tiled_mlp_tiles=2)


def test_eager_kernel_attention_sinks() -> None:
    """Sinks: an extra softmax column per head with a zero value, in both layouts, with gradients."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(8, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(8, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    eager = get_attention("eager")
    out = eager.varlen(q, k, v, cu, cu, 5, 5, causal=True, window=(2, 0), scale=0.3, sinks=sinks)

    def reference(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        n = qs.shape[0]
        kr, vr = ks.repeat_interleave(2, dim=1), vs.repeat_interleave(2, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, kr) * 0.3
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        s = s.masked_fill(~((j <= i) & (j >= i - 2)), float("-inf"))
        logits = torch.cat([s, sinks.view(4, 1, 1).expand(4, n, 1)], dim=-1)
        return torch.einsum("hqk,khd->qhd", logits.softmax(-1)[..., :-1], vr)

    want = torch.cat([reference(q[:5], k[:5], v[:5]), reference(q[5:], k[5:], v[5:])])
    torch.testing.assert_close(out, want)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, sinks))
    exp = torch.autograd.grad((want * w).sum(), (q, k, v, sinks))
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b)
    padded = eager.padded(
        q[None, :5], k[None, :5], v[None, :5], causal=True, window=(2, 0), scale=0.3, sinks=sinks
    )
    torch.testing.assert_close(padded[0], want[:5])
    with pytest.raises(InvalidInput, match=r"sinks has shape \(2,\)"):
        eager.varlen(q, k, v, cu, cu, 5, 5, sinks=sinks[:2])


def _active_matrix_params(arch: str) -> float:
    """Weight-matrix parameters a token passes through, counted from the model: routed expert tensors
    scaled by top_k / experts, biases and norms left out (the FlopsCounter convention)."""
    cfg = tiny_config(arch)
    model = tiny_model(arch)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "n_routed_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    total = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.endswith("bias"):
            continue
        share = top_k / experts if experts and ".experts." in name else 1.0
        total += p.numel() * share
    return total


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_flops_counter_counts_windows_mla_and_moe(arch: str) -> None:
    cfg = tiny_config(arch)
    counter = FlopsCounter(cfg)
    assert counter.params_per_token == pytest.approx(_active_matrix_params(arch))
    windows: dict[str, list[Any]] = {
        "gemma2": [4, None],
        "gemma3_text": [4, None],
        "gpt_oss": [4, None],
        "mixtral": [4, 4],
        "phi3": [5, 5],
    }
    assert [layer.window for layer in counter._layers] == windows.get(arch, [None, None])
    flops = counter.estimate_flops([10])
    pairs = {None: 10 * 10 / 2.0, 4: 4 * 4 / 2.0 + 6 * 4, 5: 5 * 5 / 2.0 + 5 * 5}
    attn = sum(
        6.0 * layer.heads * (layer.qk_dim + layer.v_dim) * pairs[layer.window] for layer in counter._layers
    )
    assert flops == pytest.approx(6.0 * counter.params_per_token * 10 + attn)
    if arch == "deepseek_v3":
        assert {(layer.qk_dim, layer.v_dim) for layer in counter._layers} == {(16, 12)}


def _spy_vision_kernel_calls(model: torch.nn.Module) -> list[Any]:
    """The ``AttentionSpec`` of every kernel call the vision tower's attention makes from now on."""
    specs: list[Any] = []
    for name, module in model.named_modules():
        route = getattr(module, ROUTE_ATTR, None)
        if route is None or ".visual." not in f".{name}.":
            continue
        kernel = route.kernel

        def spy(spec: Any, kernel: Any = kernel) -> Any:
            specs.append(spec)
            return kernel(spec)

        route.kernel = spy
    return specs


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vl_packed_forward_with_images_matches_padded_reference(arch: str) -> None:
    """Qwen2.5-VL and Qwen3-VL: the vision tower runs inside the packed forward (its attention routed too), the text
    attention gets 3-D rotary positions computed per packed sequence; log-probs, entropy and the
    gradients of every parameter (vision tower included) equal transformers' padded forward."""
    from tests.unit.models._tiny import tiny_vl_model, vl_batch
    from underlay.models import multimodal_position_ids

    ref = tiny_vl_model(arch)
    caps = inspect_model(ref)
    assert caps.multimodal_rope and len(caps.attention_modules) == 4  # 2 vision blocks + 2 text layers
    if arch == "qwen3_vl_moe":
        assert caps.moe_blocks
    model = prepare_model(clone(ref), attention="eager")
    specs = _spy_vision_kernel_calls(model)
    ids, mask, mm = vl_batch()
    packed = unpad(ids, mask)
    out = packed_forward(model, packed, temperature=0.9, logprob_kernel=logprob_kernel(), multimodal=mm)
    assert out.log_probs is not None and out.entropy is not None
    # each vision block attends over all images (and windows) in one non-causal varlen call, not one
    # call per image or window
    assert [(s.layout, s.causal) for s in specs] == [("varlen", False)] * 2, specs
    # ... through the tower's private config: the model's config (what exports save and new models are
    # built from) keeps "underlay", whose name sends transformers looking for no flash library
    assert model.config.vision_config._attn_implementation == "underlay"
    assert type(ref)._from_config(model.config) is not None
    kinds = (ids == ref.config.image_token_id).int()
    pos = ref.model.get_rope_index(ids, kinds, image_grid_thw=mm["image_grid_thw"], attention_mask=mask)[0]
    got_pos = multimodal_position_ids(model.model, packed, mm)
    assert got_pos.shape == (4, 1, packed.total_tokens)
    assert torch.equal(got_pos[1:, 0], pos[:, mask.bool()]) and torch.equal(
        got_pos[0, 0], packed.position_ids
    )
    logits = ref(input_ids=ids, attention_mask=mask, mm_token_type_ids=kinds, **mm).logits.double() / 0.9
    lsm = logits.log_softmax(-1)
    ref_lp = torch.zeros(ids.shape, dtype=torch.float64)
    ref_ent = torch.zeros(ids.shape, dtype=torch.float64)
    ref_lp[:, 1:] = lsm[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ref_ent[:, 1:] = -(lsm.exp() * lsm).sum(-1)[:, :-1]
    scored = torch.zeros_like(mask, dtype=torch.bool)
    scored[:, 1:] = (mask[:, 1:] > 0) & (mask[:, :-1] > 0)
    ref_lp, ref_ent = ref_lp * scored, ref_ent * scored
    lp, ent = pad(out.log_probs, packed), pad(out.entropy, packed)
    torch.testing.assert_close(lp.double(), ref_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=ATOL, rtol=0)
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (lp.double() * w).sum().backward()
    (ref_lp * w).sum().backward()
    grads, ref_grads = _grads(model), _grads(ref)
    assert any(n.startswith("model.visual.") for n in grads)
    _assert_grads_close(grads, ref_grads)
    # the images matter, and text models refuse image inputs
    other = dict(mm, pixel_values=mm["pixel_values"] * 2)
    moved = packed_forward(model, packed, logprob_kernel=logprob_kernel(), multimodal=other).log_probs
    assert moved is not None and not torch.allclose(moved, out.log_probs)
    with pytest.raises(InvalidInput, match="a text model"):
        packed_forward(prepare_model(tiny_model("llama")), packed, multimodal=mm)


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_flops_counter_counts_the_vision_tower(arch: str) -> None:
    """Vision matrices per patch / per merged token equal the tiny model's own parameters; the vision
    FLOPs of a batch's grids follow the module convention; a text model refuses grids."""
    from tests.unit.models._tiny import tiny_vl_model

    model = tiny_vl_model(arch)
    visual = model.model.visual
    per_patch = visual.patch_embed.proj.weight.numel() + sum(
        p.numel() for n, p in visual.blocks.named_parameters() if p.dim() >= 2
    )
    per_merged = sum(p.numel() for n, p in visual.named_parameters() if p.dim() >= 2 and "merger" in n)
    counter = FlopsCounter(model.config)
    vision = counter.vision_figures()
    assert vision is not None
    assert vision.per_patch == per_patch and vision.per_merged == per_merged
    grids = torch.tensor([[1, 4, 4], [2, 4, 8]])
    extra = counter.estimate_flops([20, 9], grids) - counter.estimate_flops([20, 9])
    d, depth = 32, 2
    want = 0.0
    for t, h, w in grids.tolist():
        n = t * h * w
        # attention within each frame; Qwen2.5-VL's block 0 is a window block (2x2 merged units =
        # 4x4 patches per window), block 1 attends over the whole frame
        pairs = [t * (h * w) ** 2] * depth
        if arch == "qwen2_5_vl":
            pairs[0] = t * (h * w // 16) * 16**2
        want += 6.0 * (per_patch * n + per_merged * n / 4) + sum(12.0 * d * p for p in pairs)
    assert extra == pytest.approx(want)
    with pytest.raises(InvalidInput, match="no vision tower"):
        FlopsCounter(tiny_config("llama")).estimate_flops([5], grids)
    if arch == "qwen3_vl_moe":  # the text model counts as the Qwen3-MoE decoder of the same shape
        text = model.config.text_config.to_dict()
        text.update(model_type="qwen3_moe", num_experts=text["num_local_experts"])
        assert counter.params_per_token == FlopsCounter(text).params_per_token
