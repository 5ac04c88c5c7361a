"""How megatron-core ``GPTModel`` parameters map to Hugging Face tensors (pure functions, no collectives).

Megatron's fused layouts:

- ``linear_qkv`` rows are grouped per query group ``g``: the group's ``heads / groups`` query heads, then
  its key head, then its value head (``head_dim`` rows each); TP splits whole groups, so rank ``r`` holds
  a contiguous block of groups.
- ``linear_fc1`` is ``[gate; up]`` per TP rank: rank ``r`` holds gate's ``r``-th row chunk followed by
  up's ``r``-th row chunk.
- ``linear_proj`` and ``linear_fc2`` split along dim 1; the word embedding and the output layer along
  the vocabulary (dim 0); norms and the router are replicated.
- A value model's head (HF ``score.weight [1, H]``, ``score.bias [1]``) is the last stage's
  ``output_layer`` (``layers.ValueHead``), replicated over TP.
- A vocabulary that the TP size does not divide is padded with zero rows at the end
  (``MCoreArch.vocab_rows``); the padded rows exist only in the engine (kind ``vocab``: added on load,
  dropped on export).
- Experts keep the names ``save_pretrained`` writes: ``mlp.experts.{e}.gate_proj/up_proj/down_proj``,
  mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2`` (router ``block_sparse_moe.gate``); qwen2_moe's
  shared expert ``mlp.shared_expert.*`` (glm4_moe's ``mlp.shared_experts.*``) is megatron's
  ``mlp.shared_experts`` (TP-split like a dense MLP) and its gate ``mlp.shared_expert_gate.weight
  [1, H]`` is ``shared_experts.gate_weight`` (replicated); glm4_moe's routing bias buffer
  ``mlp.gate.e_score_correction_bias [E]`` is the router's buffer ``expert_bias`` (replicated).
- Dense layers of an MoE model (glm4_moe's first ``first_k_dense_replace``) map like a dense model's.

A ``Rule`` names one engine parameter (its name inside a pipeline chunk, with the chunk-local layer and
expert indices), the HF tensors it is built from and its TP layout ``kind``; ``engine_rule`` turns it
into the ``WeightRule`` under the global engine name (the shared conversions of
``engines._weightmap``), which the engine's weight map, ``load_hf`` and export use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from underlay.engines._weightmap import fuse_gate_up as _wm_gate_up
from underlay.engines._weightmap import fuse_qkv as _wm_qkv
from underlay.engines._weightmap import rename
from underlay.engines.mcore.config import MCoreArch
from underlay.interfaces.weightmap import WeightRule

__all__ = [
    "VALUE_HEAD_NAMES",
    "Rule",
    "checkpoint_names",
    "engine_rule",
    "hf_shapes",
    "moe_names",
    "pad_rows",
    "stage_rules",
]

Kind = Literal["replicated", "column", "row", "qkv", "gate_up", "vocab"]


def moe_names(arch: MCoreArch) -> tuple[str, str, str, str]:
    """``(block, gate, up, down)`` of an MoE layer's HF names: the block's prefix inside a layer
    (``"mlp."``, mixtral's ``"block_sparse_moe."``) and the per-expert projection names."""
    if arch.model_type == "mixtral":
        return "block_sparse_moe.", "w1", "w3", "w2"
    return "mlp.", "gate_proj", "up_proj", "down_proj"


def _shared_prefix(arch: MCoreArch) -> str:
    return "mlp.shared_experts." if arch.model_type in ("glm4_moe", "deepseek_v3") else "mlp.shared_expert."


def checkpoint_names(model_type: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (transformers' in-memory names after ``_hf.per_expert_names``) under the names
    ``save_pretrained`` writes for ``model_type``: mixtral's ``mlp.experts.{e}.gate_proj/up_proj/down_proj``
    and ``mlp.gate`` become ``block_sparse_moe.experts.{e}.w1/w3/w2`` and ``block_sparse_moe.gate``;
    other families unchanged."""
    if model_type != "mixtral":
        return state
    out: dict[str, torch.Tensor] = {}
    swap = {"gate_proj.weight": "w1.weight", "up_proj.weight": "w3.weight", "down_proj.weight": "w2.weight"}
    for name, t in state.items():
        if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
            name = name.replace(".mlp.", ".block_sparse_moe.")
            for old, new in swap.items():
                if name.endswith(old):
                    name = name[: -len(old)] + new
        out[name] = t
    return out


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t [n, ...]`` with zero rows appended up to ``rows`` (``t`` itself when ``n == rows``)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], 0)


@dataclass(frozen=True)
class Rule:
    """One engine parameter: ``name`` inside its pipeline chunk, the HF tensors it comes from, and its
    TP layout ``kind`` (``replicated``, ``column`` = split dim 0, ``row`` = split dim 1, ``qkv``,
    ``gate_up``, ``vocab`` = split dim 0 after padding to ``arch.vocab_rows`` rows). ``expert`` rules use the expert-TP group instead of the TP group."""

    name: str
    hf: tuple[str, ...]
    kind: Kind
    arch: MCoreArch
    expert: bool = False


def hf_shapes(arch: MCoreArch) -> dict[str, tuple[int, ...]]:
    """Full shape of every HF tensor of ``arch`` (the names ``save_pretrained`` writes)."""
    a = arch
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab, a.hidden)}
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (a.hidden,)
        out[p + "post_attention_layernorm.weight"] = (a.hidden,)
        if a.is_mla:
            out.update(_mla_shapes(a, p + "self_attn."))
        else:
            out.update(_attention_shapes(a, p + "self_attn."))
        if a.moe_layer(i):
            block, gate, up, down = moe_names(a)
            out[p + block + "gate.weight"] = (a.num_experts, a.hidden)
            if a.expert_bias:
                out[p + block + "gate.e_score_correction_bias"] = (a.num_experts,)
            for e in range(a.num_experts):
                q = f"{p}{block}experts.{e}."
                out[q + gate + ".weight"] = (a.moe_ffn, a.hidden)
                out[q + up + ".weight"] = (a.moe_ffn, a.hidden)
                out[q + down + ".weight"] = (a.hidden, a.moe_ffn)
            if a.shared_ffn:
                q = p + _shared_prefix(a)
                out[q + "gate_proj.weight"] = (a.shared_ffn, a.hidden)
                out[q + "up_proj.weight"] = (a.shared_ffn, a.hidden)
                out[q + "down_proj.weight"] = (a.hidden, a.shared_ffn)
                if a.shared_gate:
                    out[p + "mlp.shared_expert_gate.weight"] = (1, a.hidden)
        else:
            out[p + "mlp.gate_proj.weight"] = (a.ffn, a.hidden)
            out[p + "mlp.up_proj.weight"] = (a.ffn, a.hidden)
            out[p + "mlp.down_proj.weight"] = (a.hidden, a.ffn)
    out["model.norm.weight"] = (a.hidden,)
    if a.value_head:
        out["score.weight"] = (1, a.hidden)
        if a.value_bias:
            out["score.bias"] = (1,)
    elif not a.tied:
        out["lm_head.weight"] = (a.vocab, a.hidden)
    return out


def _attention_shapes(a: MCoreArch, p: str) -> dict[str, tuple[int, ...]]:
    qd, kd = a.heads * a.head_dim, a.num_query_groups * a.head_dim
    out: dict[str, tuple[int, ...]] = {
        p + "q_proj.weight": (qd, a.hidden),
        p + "k_proj.weight": (kd, a.hidden),
        p + "v_proj.weight": (kd, a.hidden),
        p + "o_proj.weight": (a.hidden, qd),
    }
    if a.qkv_bias:
        out.update({p + "q_proj.bias": (qd,), p + "k_proj.bias": (kd,), p + "v_proj.bias": (kd,)})
    if a.qk_norm:
        out.update({p + "q_norm.weight": (a.head_dim,), p + "k_norm.weight": (a.head_dim,)})
    return out


def _mla_shapes(a: MCoreArch, p: str) -> dict[str, tuple[int, ...]]:
    qd = a.heads * (a.head_dim + a.qk_rope_dim)
    out: dict[str, tuple[int, ...]] = {}
    if a.q_lora_rank:
        out[p + "q_a_proj.weight"] = (a.q_lora_rank, a.hidden)
        out[p + "q_a_layernorm.weight"] = (a.q_lora_rank,)
        out[p + "q_b_proj.weight"] = (qd, a.q_lora_rank)
    else:
        out[p + "q_proj.weight"] = (qd, a.hidden)
    out[p + "kv_a_proj_with_mqa.weight"] = (a.kv_lora_rank + a.qk_rope_dim, a.hidden)
    out[p + "kv_a_layernorm.weight"] = (a.kv_lora_rank,)
    out[p + "kv_b_proj.weight"] = (a.heads * (a.head_dim + a.v_head_dim), a.kv_lora_rank)
    out[p + "o_proj.weight"] = (a.hidden, a.heads * a.v_head_dim)
    return out


def _attention_rules(a: MCoreArch, att: str, h: str) -> list[Rule]:
    """megatron's ``SelfAttention`` parameters: fused q/k/v (+ bias), q/k norms, ``linear_proj``."""
    qkv = tuple(f"{h}self_attn.{x}_proj.weight" for x in "qkv")
    rules = [Rule(att + "linear_qkv.weight", qkv, "qkv", a)]
    if a.qkv_bias:
        rules.append(
            Rule(att + "linear_qkv.bias", tuple(n[: -len("weight")] + "bias" for n in qkv), "qkv", a)
        )
    if a.qk_norm:
        rules.append(Rule(att + "q_layernorm.weight", (h + "self_attn.q_norm.weight",), "replicated", a))
        rules.append(Rule(att + "k_layernorm.weight", (h + "self_attn.k_norm.weight",), "replicated", a))
    rules.append(Rule(att + "linear_proj.weight", (h + "self_attn.o_proj.weight",), "row", a))
    return rules


def _mla_rules(a: MCoreArch, att: str, h: str) -> list[Rule]:
    """megatron's ``MLASelfAttention`` parameters: the down projections are column-parallel (their
    outputs are gathered over TP before the norms), the up projections split whole heads (per head
    ``[nope; rope]`` rows for q, ``[k_nope; v]`` for kv, the same order in both), ``linear_proj``
    by rows of its input."""
    s = h + "self_attn."
    rules = []
    if a.q_lora_rank:
        rules.append(Rule(att + "linear_q_down_proj.weight", (s + "q_a_proj.weight",), "column", a))
        rules.append(Rule(att + "q_layernorm.weight", (s + "q_a_layernorm.weight",), "replicated", a))
        rules.append(Rule(att + "linear_q_up_proj.weight", (s + "q_b_proj.weight",), "column", a))
    else:
        rules.append(Rule(att + "linear_q_proj.weight", (s + "q_proj.weight",), "column", a))
    rules.append(Rule(att + "linear_kv_down_proj.weight", (s + "kv_a_proj_with_mqa.weight",), "column", a))
    rules.append(Rule(att + "kv_layernorm.weight", (s + "kv_a_layernorm.weight",), "replicated", a))
    rules.append(Rule(att + "linear_kv_up_proj.weight", (s + "kv_b_proj.weight",), "column", a))
    rules.append(Rule(att + "linear_proj.weight", (s + "o_proj.weight",), "row", a))
    return rules


VALUE_HEAD_NAMES = ("score.weight", "score.bias")
"""HF names of a value model's head (``*ForTokenClassification.score``); a causal-LM checkpoint lacks
them (the head then comes from the seed, as in the fsdp2 engine)."""


def stage_rules(
    arch: MCoreArch,
    *,
    first_layer: int,
    num_layers: int,
    pre_process: bool,
    post_process: bool,
    expert_offset: int = 0,
    local_experts: int = 0,
) -> list[Rule]:
    """The rules of one pipeline chunk holding global layers ``[first_layer, first_layer + num_layers)``,
    the embedding when ``pre_process``, the final norm and output layer when ``post_process`` (with tied
    embeddings the output layer of a last stage that is not also the first is a copy of the embedding,
    built from ``model.embed_tokens.weight``), and experts ``[expert_offset, expert_offset +
    local_experts)`` of each MoE layer."""
    a = arch
    rules: list[Rule] = []
    if pre_process:
        rules.append(Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", a))
    for local in range(num_layers):
        g = first_layer + local
        p, h = f"decoder.layers.{local}.", f"model.layers.{g}."
        att = p + "self_attention."
        rules.append(Rule(p + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicated", a))
        rules.extend(_mla_rules(a, att, h) if a.is_mla else _attention_rules(a, att, h))
        rules.append(
            Rule(p + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated", a)
        )
        if a.moe_layer(g):
            block, gate, up, down = moe_names(a)
            rules.append(Rule(p + "mlp.router.weight", (h + block + "gate.weight",), "replicated", a))
            if a.expert_bias:  # a buffer (not trained), fixed routing bias
                bias = (h + block + "gate.e_score_correction_bias",)
                rules.append(Rule(p + "mlp.router.expert_bias", bias, "replicated", a))
            for j in range(local_experts):
                e = expert_offset + j
                q, hq = f"{p}mlp.experts.local_experts.{j}.", f"{h}{block}experts.{e}."
                gu = (hq + gate + ".weight", hq + up + ".weight")
                rules.append(Rule(q + "linear_fc1.weight", gu, "gate_up", a, expert=True))
                rules.append(Rule(q + "linear_fc2.weight", (hq + down + ".weight",), "row", a, expert=True))
            if a.shared_ffn:
                q, hq = p + "mlp.shared_experts.", h + _shared_prefix(a)
                gu = (hq + "gate_proj.weight", hq + "up_proj.weight")
                rules.append(Rule(q + "linear_fc1.weight", gu, "gate_up", a))
                rules.append(Rule(q + "linear_fc2.weight", (hq + "down_proj.weight",), "row", a))
                if a.shared_gate:
                    gw = (h + "mlp.shared_expert_gate.weight",)
                    rules.append(Rule(q + "gate_weight", gw, "replicated", a))
        else:
            gu = (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight")
            rules.append(Rule(p + "mlp.linear_fc1.weight", gu, "gate_up", a))
            rules.append(Rule(p + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row", a))
    if post_process:
        rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", a))
        if a.value_head:  # the value head replaces the output layer (replicated over TP)
            rules.append(Rule("output_layer.weight", ("score.weight",), "replicated", a))
            if a.value_bias:
                rules.append(Rule("output_layer.bias", ("score.bias",), "replicated", a))
        elif not a.tied:
            rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", a))
        elif not pre_process:
            rules.append(Rule("output_layer.weight", ("model.embed_tokens.weight",), "vocab", a))
    return rules


def _global_name(rule: Rule) -> str:
    """The chunk-local name of ``rule`` with the global layer index (from its HF name) and, for an
    expert, the global expert index: ``decoder.layers.<g>.`` / ``local_experts.<e>.``."""
    name = rule.name
    hf = rule.hf[0]
    if name.startswith("decoder.layers."):
        g = hf.split(".")[2]
        rest = name.split(".", 3)[3]
        name = f"decoder.layers.{g}.{rest}"
        if rule.expert:
            e = hf.split("experts.")[1].split(".")[0]
            head, tail = name.split("mlp.experts.local_experts.")
            name = f"{head}mlp.experts.local_experts.{e}.{tail.split('.', 1)[1]}"
    return name


def engine_rule(rule: Rule, arch: MCoreArch) -> WeightRule:
    """The contract-v2 ``WeightRule`` of ``rule`` under its global engine name (the full, ``tp == 1``
    tensor; TP split as megatron does: column = dim 0, row = dim 1, q/k/v in whole query groups,
    ``[gate; up]`` in two blocks)."""
    name = _global_name(rule)
    if rule.kind == "qkv":
        q, k, v = rule.hf
        return _wm_qkv(
            name, q, k, v, num_heads=arch.heads, num_kv_heads=arch.num_query_groups, head_dim=arch.head_dim
        )
    if rule.kind == "gate_up":
        return _wm_gate_up(name, rule.hf[0], rule.hf[1])
    if rule.kind == "vocab" and arch.vocab_rows != arch.vocab:
        return _padded_vocab_rule(name, rule.hf[0], arch.vocab, arch.vocab_rows)
    tp_dim = {"replicated": None, "column": 0, "vocab": 0, "row": 1}[rule.kind]
    return rename(name, rule.hf[0], tp_dim=tp_dim, optional=rule.hf[0] in VALUE_HEAD_NAMES)


def _padded_vocab_rule(engine_name: str, hf_name: str, vocab: int, rows: int) -> WeightRule:
    """The engine's ``[rows, H]`` vocabulary tensor from HF's ``[vocab, H]`` (zero rows appended) and
    back (the padded rows dropped); split over TP along dim 0."""

    def to_hf(full: torch.Tensor) -> dict[str, torch.Tensor]:
        return {hf_name: full[:vocab]}

    def from_hf(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return pad_rows(tensors[hf_name], rows)

    return WeightRule(engine_name, (hf_name,), to_hf, from_hf, tp_dim=0, kind="pad_vocab")
