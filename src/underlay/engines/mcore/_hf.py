"""Hugging Face side of the mcore engine: the config to build and the seed-initialised reference model
(the same construction as the fsdp2 engine's, so both engines start from identical weights)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from underlay.interfaces import ConfigError, ModelConfig
from underlay.models.overrides import apply_overrides

__all__ = ["hf_config_of", "seeded_hf_state", "seeded_hf_states", "signature_diff", "value_hf_config"]


def hf_config_of(model_cfg: ModelConfig) -> Any:
    """``hf_config`` as given, or ``config.json`` of the local directory ``path`` (``ConfigError`` when
    it has none; nothing is downloaded)."""
    if model_cfg.hf_config is not None:
        return apply_overrides(model_cfg.hf_config, model_cfg)
    from transformers import AutoConfig

    assert model_cfg.path is not None
    path = Path(model_cfg.path)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"ModelConfig.path={model_cfg.path!r} has no config.json; give a local Hugging Face model directory"
        )
    return apply_overrides(AutoConfig.from_pretrained(str(path), local_files_only=True), model_cfg)


def value_hf_config(hf_config: Any) -> Any:
    """A copy of ``hf_config`` for a value model: ``num_labels=1`` and ``architectures`` naming the
    family's ``*ForTokenClassification`` class (what ``export_hf`` writes, so transformers reloads it
    with ``AutoModelForTokenClassification``). The caller's config is not changed."""
    import copy

    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    cfg = copy.deepcopy(hf_config)
    cfg.num_labels = 1
    name = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(str(getattr(cfg, "model_type", "")))
    if name is None:
        raise ConfigError(
            f"mcore: ModelConfig.kind='value' for model_type {getattr(cfg, 'model_type', None)!r}: "
            "transformers has no token-classification model for it"
        )
    cfg.architectures = [name]
    return cfg


def seeded_hf_state(model_cfg: ModelConfig, hf_config: Any) -> dict[str, torch.Tensor]:
    """The fp32 model built on the cpu under ``torch.manual_seed(model_cfg.seed)`` (global RNG state
    restored afterwards): the causal LM, or for ``kind="value"`` the token-classification model
    (``hf_config.num_labels`` must be 1), as the fsdp2 engine builds them; as tensors under the names
    ``save_pretrained`` writes (per-expert MoE names, ``weightmap.checkpoint_names``). With
    ``model_cfg.lora`` the base model's tensors (``seeded_hf_states`` has the adapters too)."""
    return seeded_hf_states(model_cfg, hf_config)[0]


def seeded_hf_states(
    model_cfg: ModelConfig, hf_config: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(base, adapters)``: ``seeded_hf_state``'s tensors, and with ``model_cfg.lora`` the LoRA adapters
    peft initialises on that model right after it is built (inside the same seeded RNG scope, as the
    fsdp2 engine builds its peft model, so both engines start from the same adapters) under peft's saved
    names (``base_model.model.<module>.lora_A.weight``); ``{}`` without LoRA."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from underlay.engines._lora import PEFT_PREFIX, add_lora

    auto = AutoModelForTokenClassification if model_cfg.kind == "value" else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_cfg.seed)
        model = auto.from_config(hf_config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        if model_cfg.lora is not None:
            model = add_lora(model, model_cfg.lora)
    state: dict[str, torch.Tensor] = {}
    adapters: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if ".lora_" in n:
            adapters[n.replace(".default.", ".")] = p.detach()
        else:
            state[n.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")] = p.detach()
    # routing-bias buffers (glm4_moe's e_score_correction_bias) are model state the weight map carries
    state.update(
        {
            n.removeprefix(PEFT_PREFIX): b
            for n, b in model.named_buffers()
            if n.endswith("e_score_correction_bias")
        }
    )
    from underlay.engines.mcore.weightmap import checkpoint_names

    return checkpoint_names(str(getattr(hf_config, "model_type", "")), per_expert_names(state)), adapters


def per_expert_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename transformers 5's fused in-memory experts (``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``) to ``experts.{e}.gate_proj/up_proj/down_proj.weight``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, 0)
                out[f"{base}{e}.gate_proj.weight"] = gate
                out[f"{base}{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def signature_diff(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str:
    """First differences between two model signatures, human-readable ("" when equal)."""
    problems = [
        f"{k}: checkpoint {saved.get(k)!r} != model {mine.get(k)!r}"
        for k in sorted(set(saved) | set(mine))
        if k != "params" and saved.get(k) != mine.get(k)
    ]
    sp, mp = saved.get("params", {}), mine.get("params", {})
    if set(sp) != set(mp):
        problems.append(
            f"tensors only in the model: {sorted(set(mp) - set(sp))[:3]}; only in the checkpoint: "
            f"{sorted(set(sp) - set(mp))[:3]}"
        )
    shapes = [f"{n} {sp[n]} != {mp[n]}" for n in sorted(set(sp) & set(mp)) if sp[n] != mp[n]]
    if shapes:
        problems.append(f"shape mismatch: {shapes[:3]}")
    return "; ".join(problems)
