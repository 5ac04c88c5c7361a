"""Issue 34 findings on the model integration, each against transformers' own eager forward in float64
on tiny configs whose every parameter is moved off its init (``_f64``):

- attention properties come only from what the layer passes (window, softcap, scaling, sinks, causal);
- length-dependent RoPE (longrope, dynamic) per sequence: results independent of the packing;
- training-mode randomness is a decision (``set_training_mode``);
- the router auxiliary loss equals transformers' own;
- heterogeneous configs (gemma4_text) read per layer; llama4_text refused naming chunked attention.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.unit.models._f64 import (
    f64_model,
    packed,
    prepared,
    reference,
    sequences,
    underlay_logprobs,
)
from underlay.interfaces import ConfigError
from underlay.models import packed_forward, prepare_model, set_training_mode
from underlay.models.attention import underlay_attention_forward
from underlay.registry import get_logprob_kernel

TOL = 2e-6  # float64 model, fp32 log-prob outputs
SLIDING_FULL = ["sliding_attention", "full_attention"]


def _max_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# --- attention: no fallback to module attributes -----------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        # full-attention layers carry `sliding_window` too; transformers passes None for them
        ("exaone4", dict(sliding_window=4, layer_types=SLIDING_FULL)),
        (
            "exaone_moe",
            dict(sliding_window=4, layer_types=SLIDING_FULL, num_experts=4, num_experts_per_tok=2),
        ),
        # Gemma 3 keeps `attn_logit_softcapping` on the module but does not apply it
        (
            "gemma3_text",
            dict(head_dim=8, sliding_window=4, attn_logit_softcapping=5.0, layer_types=SLIDING_FULL),
        ),
    ],
)
def test_attention_properties_come_from_the_layer_call(arch: str, overrides: dict[str, Any]) -> None:
    model = f64_model(arch, **overrides)
    seqs = sequences([11, 6, 9])  # longer than the 4-token window
    assert _max_error(underlay_logprobs(prepared(model), seqs), reference(model, seqs)) < TOL


class _Layer(nn.Module):
    """An attention module carrying every attribute the old fallback read."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__()
        for k, v in attrs.items():
            setattr(self, k, v)


@pytest.mark.parametrize(
    ("attrs", "passed"),
    [
        ({"sliding_window": 2}, {"sliding_window": None}),
        ({"attn_logit_softcapping": 0.5}, {"softcap": None}),
        ({"scaling": 3.0}, {"scaling": None}),
        ({"sinks": torch.ones(4, dtype=torch.float64)}, {}),
    ],
    ids=["window", "softcap", "scaling", "sinks"],
)
def test_module_attributes_never_change_the_call(attrs: dict[str, Any], passed: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 7, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(7)[None]
    plain, _ = underlay_attention_forward(_Layer(), q, k, v, None, position_ids=pos, **passed)
    decorated, _ = underlay_attention_forward(_Layer(**attrs), q, k, v, None, position_ids=pos, **passed)
    assert torch.equal(plain, decorated)


def test_causality_comes_from_the_layer_call_or_is_refused() -> None:
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    pos = torch.arange(5)[None]
    causal, _ = underlay_attention_forward(_Layer(), q, q, q, None, position_ids=pos)
    full, _ = underlay_attention_forward(
        _Layer(is_causal=True), q, q, q, None, position_ids=pos, is_causal=False
    )
    assert not torch.allclose(causal, full)  # the keyword decides, not the attribute
    with pytest.raises(ConfigError, match="is_causal=False"):
        underlay_attention_forward(_Layer(is_causal=False), q, q, q, None, position_ids=pos)


# --- packing-independent RoPE ------------------------------------------------------------------------


LONGROPE = dict(
    max_position_embeddings=64,
    original_max_position_embeddings=16,  # (phi3's config default, 4096, would override the rope's)
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(4)],
        "long_factor": [2.0 + 0.5 * i for i in range(4)],
        "original_max_position_embeddings": 16,
    },
)
DYNAMIC = dict(
    max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
)


@pytest.mark.parametrize(
    ("arch", "overrides"), [("phi3", LONGROPE), ("llama", DYNAMIC)], ids=["longrope", "dynamic"]
)
def test_length_dependent_rope_is_per_sequence(arch: str, overrides: dict[str, Any]) -> None:
    model = f64_model(arch, **overrides)
    short, long_, mid = sequences([8, 40, 20])  # 8 below the original length 16, 40 and 20 above it
    # each from a fresh copy: transformers' dynamic rope keeps the largest length it has seen
    ref = {n: reference(copy.deepcopy(model), [s])[0] for n, s in zip("slm", [short, long_, mid])}
    routed = prepared(model)
    seen: dict[str, list[torch.Tensor]] = {"s": [], "l": [], "m": []}
    for grouping in (["s"], ["s", "l"], ["l", "s", "m"], ["m", "s"]):
        by_name = {"s": short, "l": long_, "m": mid}
        for name, lp in zip(grouping, underlay_logprobs(routed, [by_name[n] for n in grouping])):
            seen[name].append(lp)
    for name, results in seen.items():
        assert float((results[0] - ref[name]).abs().max()) < TOL, name
        for other in results[1:]:  # moving a sequence across groupings: bit-equal
            assert torch.equal(other, results[0]), name


# --- training-mode randomness ------------------------------------------------------------------------


def _train_logprobs(model: nn.Module, randomness: str) -> torch.Tensor:
    set_training_mode(model, randomness)
    seqs = sequences([9, 5])
    out = packed_forward(model, packed(seqs), logprob_kernel=get_logprob_kernel("torch"))
    assert out.log_probs is not None
    return out.log_probs.detach()


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("phi3", dict(resid_pdrop=0.3, embd_pdrop=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5)),
    ],
    ids=["dropout", "router-jitter"],
)
def test_training_randomness_off_equals_inference(arch: str, overrides: dict[str, Any]) -> None:
    model = prepared(f64_model(arch, **overrides))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()
    with torch.no_grad():
        infer = packed_forward(model, packed(sequences([9, 5])), logprob_kernel=get_logprob_kernel("torch"))
    assert infer.log_probs is not None
    torch.manual_seed(5)
    assert torch.equal(_train_logprobs(model, "off"), infer.log_probs)
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    assert layers and all(m.training for m in layers)  # checkpointing still active
    assert not any(m.training for m in model.modules() if isinstance(m, nn.Dropout))
    torch.manual_seed(5)
    assert not torch.allclose(_train_logprobs(model, "keep"), infer.log_probs)  # the randomness exists
    with pytest.raises(ConfigError, match="training_randomness"):
        set_training_mode(model, "on")


# --- router auxiliary loss ---------------------------------------------------------------------------


MOE: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.3),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        router_aux_loss_coef=0.3,
    ),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.3
    ),
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
        router_aux_loss_coef=0.3,
        layer_types=["full_attention", "full_attention"],
    ),
}


@pytest.mark.parametrize("arch", sorted(MOE))
def test_router_aux_loss_equals_transformers(arch: str) -> None:
    model = f64_model(arch, **MOE[arch])
    seqs = sequences([11, 6, 9])
    ids = torch.zeros(3, 11, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : s.numel()] = s
        mask[i, : s.numel()] = 1
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    routed = prepared(model)
    out = packed_forward(routed, packed(seqs), logprob_kernel=get_logprob_kernel("torch"))
    assert out.aux_loss is not None and out.aux_loss.dim() == 0
    torch.testing.assert_close(out.aux_loss.detach().double(), 0.3 * ref.double(), rtol=1e-6, atol=0)
    out.aux_loss.backward()  # differentiable into the routers
    routers = [p.grad for n, p in routed.named_parameters() if "gate" in n and p.grad is not None]
    assert routers and any(float(g.abs().sum()) > 0 for g in routers)


def test_dense_and_value_models_have_no_aux_loss() -> None:
    model = prepared(f64_model("llama"))
    out = packed_forward(model, packed(sequences([4])), logprob_kernel=get_logprob_kernel("torch"))
    assert out.aux_loss is None


# --- crashes become refusals or work -----------------------------------------------------------------


def test_heterogeneous_gemma4_config_is_read_per_layer() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from underlay.engines.fsdp2._auto import model_shape

    cfg = AutoConfig.for_model("gemma4_text", **{**_small(), "head_dim": 16, "global_head_dim": 32})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert model_shape(model, cfg).head_dim == 32  # the largest layer's


def test_llama4_text_is_refused_naming_chunked_attention() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama4_text", **{**_small(), "head_dim": 8, "num_local_experts": 2})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ConfigError, match="chunked"):
        prepare_model(copy.copy(model))


def _small() -> dict[str, Any]:
    return dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
