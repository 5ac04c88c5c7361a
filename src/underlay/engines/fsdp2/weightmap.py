"""The fsdp2 engine's ``WeightMap``: Hugging Face names, give or take peft wrappers and fused experts.

fsdp2 shards the Hugging Face module itself, so almost every parameter is its HF tensor under the same
name (``rename``): peft's ``base_model.model.`` prefix and ``.base_layer.`` segment are dropped, LoRA
adapters get no rule (``named_full_parameters`` merges them into their base weights). Two exceptions:

- Mixture-of-experts models whose transformers 5 modules keep the experts fused in memory
  (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) while their checkpoints hold
  one tensor per expert (``experts.{e}.gate_proj.weight`` ...): ``stack_experts`` rules, for the model
  types in ``PER_EXPERT_CHECKPOINTS`` (other model types map those tensors by name, as saved).
- Value models (``ModelConfig.kind == "value"``): the head (``score.*``) is optional (a causal-LM
  checkpoint lacks it; the engine initialises it from the seed) and a checkpoint's ``lm_head.*`` is
  ignored.
- Qwen2-VL / Qwen2.5-VL (``LEGACY_VL_CHECKPOINTS``): transformers 5 nests the modules
  (``model.visual.*``, ``model.language_model.*``) while their checkpoints, and what ``save_pretrained``
  writes, keep the flat layout (``visual.*``, ``model.*``): those two prefixes are renamed. Qwen3-VL
  checkpoints use the module names.
Tied parameters (``lm_head.weight`` = ``model.embed_tokens.weight``) map once, the alias in ``tied``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from underlay.engines._weightmap import rename, stack_experts
from underlay.engines.fsdp2._build import hf_name
from underlay.interfaces import RulePattern, WeightMap, WeightRule

__all__ = ["LEGACY_VL_CHECKPOINTS", "PER_EXPERT_CHECKPOINTS", "fsdp2_weight_map", "hf_name"]

PER_EXPERT_CHECKPOINTS = frozenset({"qwen2_moe", "qwen3_moe"})
"""Model types whose checkpoints store ``experts.{e}.{gate,up,down}_proj.weight`` while transformers 5
fuses them in memory (verified for qwen3_moe with transformers 5.24's ``save_pretrained``)."""

LEGACY_VL_CHECKPOINTS = frozenset({"qwen2_vl", "qwen2_5_vl"})
"""Vision-language model types whose checkpoints hold ``visual.*`` and ``model.*`` for the modules
``model.visual.*`` and ``model.language_model.*`` (transformers 5.24's ``save_pretrained`` writes them so)."""


def _legacy_vl_name(name: str) -> str:
    """The flat checkpoint name of a nested Qwen2(.5)-VL module name (HF name, peft already removed)."""
    if name.startswith("model.visual."):
        return name[len("model.") :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def _legacy_vl(match: re.Match[str], shape: tuple[int, ...]) -> WeightRule:
    return rename(match.string, _legacy_vl_name(hf_name(match.string)))


LORA_PATTERN = r".*\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\..*"


def _renamed(match: re.Match[str], shape: tuple[int, ...]) -> WeightRule:
    return rename(match.string, hf_name(match.string))


def _optional(match: re.Match[str], shape: tuple[int, ...]) -> WeightRule:
    return rename(match.string, hf_name(match.string), optional=True)


def _gate_up(match: re.Match[str], shape: tuple[int, ...]) -> WeightRule:
    prefix = hf_name(match.string).rsplit(".", 1)[0]  # "...mlp.experts"
    return stack_experts(
        match.string,
        (prefix + ".{e}.gate_proj.weight", prefix + ".{e}.up_proj.weight"),
        shape[0],
        cat_dim=0,
    )


def _down(match: re.Match[str], shape: tuple[int, ...]) -> WeightRule:
    prefix = hf_name(match.string).rsplit(".", 1)[0]
    return stack_experts(match.string, (prefix + ".{e}.down_proj.weight",), shape[0])


def fsdp2_weight_map(
    named_params: Iterable[tuple[str, torch.Tensor]], hf_config: Any, kind: str
) -> WeightMap:
    """The map of a model from ``model.named_parameters(remove_duplicate=False)`` (every alias, so ties
    are found), its ``hf_config`` and ``kind`` (``"causal_lm"`` or ``"value"``). Only names and shapes
    are read (meta parameters are fine)."""
    model_type = getattr(getattr(hf_config, "text_config", None) or hf_config, "model_type", None)
    legacy_vl = getattr(hf_config, "model_type", None) in LEGACY_VL_CHECKPOINTS

    def hf(name: str) -> str:
        return _legacy_vl_name(hf_name(name)) if legacy_vl else hf_name(name)

    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    unique: list[tuple[str, tuple[int, ...]]] = []
    for name, param in named_params:
        key = id(param)
        if key in first:
            if not re.fullmatch(LORA_PATTERN, name):
                tied[hf(name)] = hf(first[key])
            continue
        first[key] = name
        unique.append((name, tuple(param.shape)))
    patterns = [RulePattern(LORA_PATTERN, skip=True)]
    if model_type in PER_EXPERT_CHECKPOINTS:
        patterns += [
            RulePattern(r".*\.experts\.gate_up_proj", _gate_up),
            RulePattern(r".*\.experts\.down_proj", _down),
        ]
    ignored: tuple[str, ...] = ()
    if kind == "value":
        patterns.append(RulePattern(r"(.*\.)?score\.(weight|bias)", _optional))
        ignored = ("lm_head.*",)
    patterns.append(RulePattern(r".*", _legacy_vl if legacy_vl else _renamed))
    return WeightMap.resolve(unique, patterns, tied=tied, ignored=ignored)
