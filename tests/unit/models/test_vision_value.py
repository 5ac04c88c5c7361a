"""Value models (RL critics) of vision-language models, which transformers has no head for:
``models.vision_value_model`` = the VL backbone + ``score`` (hidden -> 1). The packed forward with
images gives the same per-token values, and the same gradients of every parameter (vision tower and
head included), as the padded forward of the same module in float64."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.unit.models._tiny import VL_ARCHS, tiny_vl_model, vl_batch
from underlay.interfaces import ConfigError
from underlay.models import inspect_model, packed_forward, prepare_model, vision_value_model
from underlay.ops.packing import pad, unpad


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vl_value_model_packed_values_and_grads_equal_padded_float64(arch: str) -> None:
    cfg = tiny_vl_model(arch).config
    torch.manual_seed(5)
    model = vision_value_model(copy.deepcopy(cfg))
    assert type(model).__name__.endswith("ValueModel")
    assert model.config.num_labels == 1 and model.score.out_features == 1
    with torch.no_grad():  # a head far from 0, so the values are not all near 0
        model.score.weight.normal_(0, 0.3)
        model.score.bias.fill_(0.25)
    ref = copy.deepcopy(model).double()
    ref.set_attn_implementation("eager")
    if arch == "qwen3_vl_moe":
        ref.set_experts_implementation("eager")  # grouped_mm has no float64
    assert inspect_model(model).multimodal_rope
    prepare_model(model, attention="eager")
    ids, mask, mm = vl_batch(seed=11)
    packed = unpad(ids, mask)
    out = packed_forward(model, packed, multimodal=mm)
    assert out.values is not None and out.log_probs is None
    assert out.values.dtype == torch.float32 and out.values.shape == (packed.total_tokens,)
    kinds = (ids == cfg.image_token_id).long()
    mm64 = {k: v.double() if v.is_floating_point() else v for k, v in mm.items()}
    ref_values = ref(input_ids=ids, attention_mask=mask, mm_token_type_ids=kinds, **mm64).logits[..., 0]
    ref_values = ref_values * mask
    values = pad(out.values, packed)
    torch.testing.assert_close(values.double(), ref_values, atol=2e-5, rtol=0)
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (values.double() * w).sum().backward()
    (ref_values * w).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    assert {"score.weight", "score.bias"} <= grads.keys()
    assert any(n.startswith("model.visual.") for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g.double(), ref_grads[name], atol=2e-5, rtol=1e-4, msg=name)


def test_vision_value_model_refuses_a_text_config() -> None:
    from tests.unit.models._tiny import tiny_config

    with pytest.raises(ConfigError, match="not a vision-language config"):
        vision_value_model(tiny_config("qwen3"))


def test_qwen3_vl_moe_weight_map_reads_hub_and_module_layouts() -> None:
    """fsdp2's map of Qwen3-VL-MoE: fused experts in the hub layout (dims 1 and 2 swapped, exact round
    trip); ``match_file_layout`` reads files in the module layout as they are; square experts (2I == H)
    are taken as in memory, as transformers does."""
    from underlay.engines.fsdp2.weightmap import TRANSPOSE_EXPERTS, fsdp2_weight_map, match_file_layout

    model = tiny_vl_model("qwen3_vl_moe", moe_intermediate=24)
    params = dict(model.named_parameters())
    wmap = fsdp2_weight_map(model.named_parameters(remove_duplicate=False), model.config, "causal_lm")
    experts = [r for r in wmap.rules if ".experts." in r.engine_name]
    assert len(experts) == 4 and all(r.kind == TRANSPOSE_EXPERTS for r in experts)
    gate_up = next(r for r in experts if r.engine_name.endswith("gate_up_proj"))
    assert gate_up.engine_shape == (4, 48, 64) and gate_up.hf_shapes() == {gate_up.hf_names[0]: (4, 64, 48)}
    full = params[gate_up.engine_name].detach()
    hub = gate_up.to_hf(full)[gate_up.hf_names[0]]
    assert torch.equal(hub, full.transpose(1, 2)) and torch.equal(
        gate_up.from_hf({gate_up.hf_names[0]: hub}), full
    )
    hub_shapes = {n: s for r in wmap.rules for n, s in r.hf_shapes().items()}
    assert match_file_layout(wmap, hub_shapes) is wmap
    module_shapes = {r.hf_names[0]: r.engine_shape for r in experts}
    as_saved = match_file_layout(wmap, {**hub_shapes, **module_shapes})
    switched = [as_saved.rule(r.engine_name) for r in experts]
    assert all(r.kind == "rename" and r.hf_shapes() == {r.hf_names[0]: r.engine_shape} for r in switched)
    assert torch.equal(switched[0].from_hf({switched[0].hf_names[0]: full}), full)
    square = tiny_vl_model("qwen3_vl_moe", moe_intermediate=32)  # gate_up [4, 64, 64]
    smap = fsdp2_weight_map(square.named_parameters(remove_duplicate=False), square.config, "causal_lm")
    kinds = {r.engine_name.rsplit(".", 1)[-1]: r.kind for r in smap.rules if ".experts." in r.engine_name}
    assert kinds == {"gate_up_proj": "rename", "down_proj": TRANSPOSE_EXPERTS}
