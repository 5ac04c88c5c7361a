"""The fsdp2 engine's ``WeightMap``: Hugging Face names, give or take peft wrappers and fused experts.

fsdp2 shards the Hugging Face module itself, so almost every parameter is its HF tensor under the same
name (``rename``): peft's ``base_model.model.`` prefix and ``.base_layer.`` segment are dropped, LoRA
adapters get no rule (``named_full_parameters`` merges them into their base weights). Two exceptions:

- Mixture-of-experts models whose transformers 5 modules keep the experts fused in memory
  (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) while their checkpoints hold
  one tensor per expert (``experts.{e}.gate_proj.weight`` ...): ``stack_experts`` rules, for the model
  types in ``PER_EXPERT_CHECKPOINTS`` and, with Mixtral's names (``block_sparse_moe.experts.{e}.w1``
  ...), ``MIXTRAL_CHECKPOINTS`` (other model types map those tensors by name, as saved).
- Persistent buffers (``persistent_buffers``: DeepSeek-V3's ``e_score_correction_bias``) map by name
  like parameters, so they load from and export to checkpoints.
- Value models (``ModelConfig.kind == "value"``): the head (``score.*``, or ``classifier.*`` for
  the GPT-2 family, Falcon and GPT-NeoX) is optional (a causal-LM
  checkpoint lacks it; the engine initialises it from the seed) and a checkpoint's ``lm_head.*`` is
  ignored.
- Qwen2-VL / Qwen2.5-VL (``LEGACY_VL_CHECKPOINTS``): transformers 5 nests the modules
  (``model.visual.*``, ``model.language_model.*``) while their checkpoints, and what ``save_pretrained``
  writes, keep the flat layout (``visual.*``, ``model.*``): those two prefixes are renamed. Qwen3-VL
  checkpoints use the module names.
- Qwen3-VL-MoE (``TRANSPOSED_EXPERT_CHECKPOINTS``): the hub checkpoints store the fused experts
  transposed against transformers' modules (``experts.gate_up_proj [E, H, 2I]`` for ``[E, 2I, H]`` in
  memory, ``experts.down_proj [E, I, H]`` for ``[E, H, I]``); transformers 5.24 transposes them on load
  (its ``qwen3_vl_moe`` conversion: ``Transpose(1, 2, check_dims=True)``, i.e. only when the file's shape
  differs from the module's) and its ``save_pretrained`` writes the in-memory layout. The map reads and
  writes the hub layout (``transpose_experts`` rules); ``match_file_layout`` switches a rule to the
  in-memory layout for files that hold it (a ``save_pretrained`` output), so both load, as in
  transformers. A square tensor (``2I == H``, or ``I == H`` for ``down_proj``) cannot be told apart by
  shape: it is read and written as in memory, which is what transformers assumes then too.
Tied parameters (``lm_head.weight`` = ``model.embed_tokens.weight``) map once, the alias in ``tied``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from underlay.engines._weightmap import rename, stack_experts
from underlay.engines.fsdp2._build import hf_name
from underlay.interfaces import InvalidInput, RulePattern, WeightMap, WeightRule

__all__ = [
    "LEGACY_VL_CHECKPOINTS",
    "MIXTRAL_CHECKPOINTS",
    "PER_EXPERT_CHECKPOINTS",
    "RENAMED_CHECKPOINTS",
    "TRANSPOSED_EXPERT_CHECKPOINTS",
    "fsdp2_weight_map",
    "hf_name",
    "match_file_layout",
    "persistent_buffers",
]

PER_EXPERT_CHECKPOINTS = frozenset(
    {"qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "olmoe", "flex_olmo"}
)
"""Model types whose checkpoints store ``experts.{e}.{gate,up,down}_proj.weight`` while transformers 5
fuses them in memory (verified with transformers 5.25's ``save_pretrained`` for each)."""

MIXTRAL_CHECKPOINTS = frozenset({"mixtral", "minimax_m2"})
"""Model types whose checkpoints keep Mixtral's original layout: the sparse block under
``block_sparse_moe.`` (module ``mlp.``) and per-expert ``experts.{e}.w1`` (gate), ``w3`` (up) and
``w2`` (down) (transformers 5.25's ``save_pretrained`` writes them so)."""

LEGACY_VL_CHECKPOINTS = frozenset({"qwen2_vl", "qwen2_5_vl"})
"""Vision-language model types whose checkpoints hold ``visual.*`` and ``model.*`` for the modules
``model.visual.*`` and ``model.language_model.*`` (transformers 5.24's ``save_pretrained`` writes them so)."""


RENAMED_CHECKPOINTS: dict[str, tuple[tuple[str, str], ...]] = {
    "gpt_neox": ((r"^lm_head\.", "embed_out."),),
    "fuyu": (
        (r"^lm_head\.", "language_model.lm_head."),
        (r"^model\.language_model\.", "language_model.model."),
        (r"^model\.vision_embed_tokens\.", "vision_embed_tokens."),
    ),
    "aria_text": (
        (r"\.mlp\.experts\.gate_up_proj$", ".mlp.experts.fc1.weight"),
        (r"\.mlp\.experts\.down_proj$", ".mlp.experts.fc2.weight"),
    ),
    **{
        mt: (
            (r"\.block_sparse_moe\.experts\.gate_up_proj$", ".block_sparse_moe.input_linear.weight"),
            (r"\.block_sparse_moe\.experts\.down_proj$", ".block_sparse_moe.output_linear.weight"),
            (r"\.block_sparse_moe\.router\.weight$", ".block_sparse_moe.router.layer.weight"),
        )
        for mt in ("granitemoe", "granitemoeshared")
    },
}
"""Per model type, ``(module-name regex, checkpoint name)`` substitutions: the tensors whose checkpoint
name differs from the module's only by name (transformers 5.25's conversion mapping renames them on
load and its ``save_pretrained`` writes the checkpoint names; verified for each by
tests/distributed/test_engine_matrix.py)."""

TRANSPOSED_EXPERT_CHECKPOINTS = frozenset({"qwen3_vl_moe"})
"""Model types (``hf_config.model_type``) whose hub checkpoints hold ``experts.gate_up_proj`` and
``experts.down_proj`` with dims 1 and 2 swapped against the modules (transformers 5.24's conversion
mapping transposes them on load)."""

TRANSPOSE_EXPERTS = "transpose_experts"
"""``WeightRule.kind`` of the rules that swap dims 1 and 2 of a fused expert tensor."""


def _transposed(engine_name: str, hf: str) -> WeightRule:
    """The engine's ``[E, A, B]`` is the HF tensor ``hf`` stored as ``[E, B, A]``."""

    def to_hf(full: torch.Tensor) -> dict[str, torch.Tensor]:
        return {hf: full.transpose(1, 2).contiguous()}

    def from_hf(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        try:
            return tensors[hf].transpose(1, 2)
        except KeyError:
            raise InvalidInput(f"{engine_name}: HF tensor {hf!r} is missing") from None

    return WeightRule(engine_name, (hf,), to_hf, from_hf, kind=TRANSPOSE_EXPERTS)


def match_file_layout(wmap: WeightMap, shapes: Mapping[str, Sequence[int]]) -> WeightMap:
    """``wmap`` adapted to the files about to be loaded (``shapes``: HF name -> shape in the files):
    a ``transpose_experts`` rule whose tensor the files hold in the module layout (the engine shape;
    ``save_pretrained`` writes that) becomes a plain rename, so those files load as well as hub ones.
    Other rules, and names the files lack, are unchanged; returns ``wmap`` itself when nothing changes.
    Pure."""
    rules = list(wmap.rules)
    changed = False
    for i, rule in enumerate(rules):
        if rule.kind != TRANSPOSE_EXPERTS or rule.engine_shape is None:
            continue
        hf = rule.hf_names[0]
        if hf in shapes and tuple(int(d) for d in shapes[hf]) == rule.engine_shape:
            rules[i] = dataclasses.replace(
                rename(rule.engine_name, hf, optional=rule.optional), engine_shape=rule.engine_shape
            )
            changed = True
    if not changed:
        return wmap
    return WeightMap(tuple(rules), dict(wmap.tied), wmap.ignored)


def _legacy_vl_name(name: str) -> str:
    """The flat checkpoint name of a nested Qwen2(.5)-VL module name (HF name, peft already removed)."""
    if name.startswith("model.visual."):
        return name[len("model.") :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


LORA_PATTERN = r".*\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\..*"


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


def _mixtral_name(name: str) -> str:
    return hf_name(name).replace(".mlp.", ".block_sparse_moe.")


def _mixtral(match: re.Match[str], shape: tuple[int, ...]) -> WeightRule:
    return rename(match.string, _mixtral_name(match.string))


def _mixtral_gate_up(match: re.Match[str], shape: tuple[int, ...]) -> WeightRule:
    prefix = _mixtral_name(match.string).rsplit(".", 1)[0]  # "...block_sparse_moe.experts"
    return stack_experts(match.string, (prefix + ".{e}.w1.weight", prefix + ".{e}.w3.weight"), shape[0])


def _mixtral_down(match: re.Match[str], shape: tuple[int, ...]) -> WeightRule:
    prefix = _mixtral_name(match.string).rsplit(".", 1)[0]
    return stack_experts(match.string, (prefix + ".{e}.w2.weight",), shape[0])


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers of ``model`` that its ``state_dict`` (and so ``save_pretrained``) holds, e.g. DeepSeek-V3's
    and GLM-4-MoE's routing bias ``mlp.gate.e_score_correction_bias``, by qualified name."""
    out: list[tuple[str, torch.Tensor]] = []
    for module_name, module in model.named_modules():
        for leaf, buf in module.named_buffers(recurse=False):
            if buf is not None and leaf not in module._non_persistent_buffers_set:
                out.append((f"{module_name}.{leaf}" if module_name else leaf, buf))
    return out


def fsdp2_weight_map(
    named_params: Iterable[tuple[str, torch.Tensor]], hf_config: Any, kind: str
) -> WeightMap:
    """The map of a model from ``model.named_parameters(remove_duplicate=False)`` (every alias, so ties
    are found) followed by its :func:`persistent_buffers` (so routing-bias buffers load and export), its
    ``hf_config`` and ``kind`` (``"causal_lm"`` or ``"value"``). Only names and shapes are read (meta
    parameters are fine)."""
    model_type = getattr(getattr(hf_config, "text_config", None) or hf_config, "model_type", None)
    legacy_vl = getattr(hf_config, "model_type", None) in LEGACY_VL_CHECKPOINTS
    renames = RENAMED_CHECKPOINTS.get(str(getattr(hf_config, "model_type", None)), ())

    def hf(name: str) -> str:
        out = _legacy_vl_name(hf_name(name)) if legacy_vl else hf_name(name)
        for pattern, repl in renames:
            out = re.sub(pattern, repl, out)
        return out

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
    if model_type in MIXTRAL_CHECKPOINTS:
        patterns += [
            RulePattern(r".*\.mlp\.experts\.gate_up_proj", _mixtral_gate_up),
            RulePattern(r".*\.mlp\.experts\.down_proj", _mixtral_down),
            RulePattern(r".*\.mlp\..*", _mixtral),
        ]
    ignored: tuple[str, ...] = ()
    if getattr(hf_config, "model_type", None) in TRANSPOSED_EXPERT_CHECKPOINTS:

        def experts(match: re.Match[str], shape: tuple[int, ...]) -> WeightRule:
            if len(shape) != 3 or shape[1] == shape[2]:  # square: as in memory (transformers does so)
                return rename(match.string, hf(match.string))
            return _transposed(match.string, hf(match.string))

        patterns.append(RulePattern(r".*\.experts\.(gate_up_proj|down_proj)", experts))
    if kind == "value":
        # transformers' token-classification head: ``score``, or ``classifier`` (GPT-2 family, Falcon,
        # GPT-NeoX); a model has one of them (``models.forward.value_head`` refuses both)
        patterns.append(RulePattern(r"(.*\.)?(score|classifier)\.(weight|bias)", _optional))
        ignored = ("lm_head.*",)
    head = hf("lm_head.weight")
    if kind == "value" and head != "lm_head.weight":  # a causal-LM checkpoint's head, renamed
        ignored += (head.rsplit(".", 1)[0] + ".*",)

    def renamed(match: re.Match[str], shape: tuple[int, ...]) -> WeightRule:
        return rename(match.string, hf(match.string))

    patterns.append(RulePattern(r".*", renamed))
    return WeightMap.resolve(unique, patterns, tied=tied, ignored=ignored)
