"""Which decoder-only causal-LM model types of the installed transformers each engine runs.

The classification is generated from transformers' own registry (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``):
every model type there is built as a tiny model on the ``meta`` device (no memory, no weights) and
handed to each engine's own capability check -- :func:`underlay.models.inspect_model` for ``fsdp2``
(what ``prepare_model`` calls) and ``arch_of`` of the mcore engine (what its build calls) -- so a
refusal's reason is the ``ConfigError`` the engine itself raises.

:data:`KNOWN` is the reviewed expectation per model type; a model type the installed transformers
registers and :data:`KNOWN` lacks is reported by :func:`unknown_model_types` (the coverage test fails
on it until it is classified, so a new transformers release is picked up).
"""

from __future__ import annotations

import importlib
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from underlay.interfaces import ConfigError

__all__ = [
    "ENGINES",
    "ENGINE_GAPS",
    "ENGINE_MATRIX_PENDING",
    "EXACT",
    "KNOWN",
    "NOT_EXACT",
    "CoverageRow",
    "Status",
    "causal_lm_model_types",
    "classify",
    "counts",
    "coverage_matrix",
    "markdown_table",
    "tiny_config",
    "unknown_model_types",
    "value_refused",
]

Status = Literal["exact", "accepted", "refused", "encoder-decoder", "no-tiny-config"]
"""``exact``: the engine runs the type and a test proves it equal to transformers' eager forward;
``accepted``: the engine's capability check passes but the matrix test does not prove it exact (the
reason, from :data:`NOT_EXACT`, says what fails); ``refused``: the
engine raises ``ConfigError`` (the reason is its message); ``encoder-decoder``: transformers"
default config of the type is an encoder-decoder (its causal-LM class is a decoder half; not a
decoder-only causal LM); ``no-tiny-config``: transformers cannot build
the type at the generic tiny sizes (the type's config needs other sizes), so it is not classified."""

ENGINES: tuple[str, ...] = ("fsdp2", "mcore")

EXACT: dict[str, frozenset[str]] = {
    "fsdp2": frozenset(
        {
            "afmoe",
            "apertus",
            "apertus1p5_text",
            "arcee",
            "aria_text",
            "axk1",
            "beam",
            "biogpt",
            "bitnet",
            "cohere_compass_text",
            "cwm",
            "deepseek_v2",
            "dbrx",
            "deepseek_v3",
            "diffllama",
            "dots1",
            "emu3",
            "ergo",
            "ernie4_5",
            "ernie4_5_moe",
            "exaone",
            "exaone4",
            "exaone_moe",
            "falcon",
            "flex_olmo",
            "flint",
            "fuyu",
            "gemma",
            "gemma2",
            "gemma3_text",
            "gemma3n_text",
            "gemma4",
            "gemma4_text",
            "gemma4_unified",
            "gemma4_unified_text",
            "glm",
            "glm4",
            "glm4_moe",
            "glm4_moe_lite",
            "gpt-sw3",
            "gpt2",
            "gpt_bigcode",
            "gpt_neox",
            "gpt_oss",
            "granite",
            "granite_swa",
            "granitemoe",
            "granitemoe_swa",
            "granitemoeshared",
            "helium",
            "hrm_text",
            "hunyuan_v1_dense",
            "hunyuan_v1_moe",
            "hy_v3",
            "hyperclovax",
            "internlm3",
            "iquestcoder",
            "jais2",
            "jetmoe",
            "kolibri1",
            "laguna",
            "lfm2",
            "llama",
            "mellum",
            "mimo_v2_flash",
            "minicpm5_moe",
            "minimax_m2",
            "minimax_m3_vl_text",
            "ministral",
            "ministral3",
            "mistral",
            "mixtral",
            "moshi",
            "nanochat",
            "nemotron",
            "olmo",
            "olmo2",
            "olmo3",
            "olmoe",
            "opt",
            "param2moe",
            "persimmon",
            "phi3",
            "phimoe",
            "qwen2",
            "qwen2_moe",
            "qwen3",
            "qwen3_moe",
            "sarvam_mla",
            "sarvam_moe",
            "seed_oss",
            "smollm3",
            "solar_open",
            "stablelm",
            "starcoder2",
            "vaultgemma",
            "youtu",
        }
    ),
    "mcore": frozenset(
        {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3"}
    ),
}  # fmt: skip
"""Per engine, the model types whose equality with transformers' float64 eager forward is proven by
tests (tests/unit/models/test_model_coverage_matrix.py for every fsdp2 row, test_model_fixes.py,
tests/distributed/test_model_coverage.py,
tests/mcore/test_mcore_models.py)."""

ENGINE_MATRIX_PENDING: frozenset[str] = frozenset()
"""fsdp2 rows whose model forward is exact (:data:`EXACT`) but that tests/distributed/test_engine_matrix.py
does not take through the engine yet (it skips them): none. The 27 rows that were here (MoE
``save_pretrained`` layouts: per-expert tensors, renamed routers, routing biases and attention
tensors; emu3's text config; gemma3n's per-layer MLP widths) now pass every engine check or are
refused by name (:data:`ENGINE_GAPS`): the fsdp2 weight map reads transformers' own conversion
mapping (``underlay.engines._hf_conversion``). A row added here must name why in a comment."""


NOT_EXACT: dict[str, str] = {}
"""fsdp2 rows the engine accepts but the matrix test does not prove exact, and why (the row's reason);
``accepted`` is their status. None: dbrx and phimoe, here until the matrix compared packings with
row-invariant float64 products, are exact. With the platform's products their two packings differ by
1 ulp: MKL's AVX2 float64 gemm computes rows in blocks of 4 and the ``M mod 4`` rows left over in
another summation order, a MoE block gathers each expert's tokens into its own product (so the
packing decides which tokens land in the remainder), and their float64 ``nn.LayerNorm`` keeps the
difference that transformers' fp32 RMSNorm rounds away (tests/unit/models/test_packing_ulp.py proves
each part, and that row-at-a-time products make the packings bit-equal; llama shows the same at
other lengths). That is the BLAS below underlay, not its packing, so the matrix's packing column
runs under ``tests.unit.models._matrix.row_invariant_products``."""

_TINY: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8)
_TWO_LAYER_TYPES = ["sliding_attention", "full_attention"]
_ROPE_PER_LAYER_TYPE = {
    t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("full_attention", "sliding_attention")
}
_OVERRIDES: dict[str, dict[str, Any]] = {
    # a few experts (the defaults hold 60-256); every layer but the first MoE in the DeepSeek-style
    # types (their defaults make the first 3 dense, leaving no MoE layer of 2)
    "deepseek_v3": dict(
        _MOE, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=4, n_group=2, topk_group=1
    ),
    "deepseek_v2": dict(num_experts_per_tok=2),  # its default (None) does not run
    "bamba": dict(_MAMBA, attn_layer_indices=[1]),
    "cohere_compass_text": dict(rope_parameters=_ROPE_PER_LAYER_TYPE),  # its default names no layer type
    "dbrx": dict(
        d_model=32,
        n_heads=4,
        n_layers=2,
        max_seq_len=128,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2),
    ),
    # its modeling reads num_local_experts, which its config lacks
    "dots1": dict(num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "dots3_note": dict(num_key_value_heads=4),
    "dots3_note_text": dict(num_key_value_heads=4),
    "gemma3n_text": dict(
        num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0], layer_types=_TWO_LAYER_TYPES
    ),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    "gpt_neo": dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=4),
    "granitemoehybrid": dict(_MAMBA, layer_types=["mamba", "attention"]),
    "hunyuan_v1_dense": dict(head_dim=8),  # its default (None) does not build
    "hunyuan_v1_moe": dict(head_dim=8, num_experts=4, moe_topk=2, moe_intermediate_size=16),
    "kolibri1_1": dict(
        head_dim=16, index_num_heads=1, layer_types=["sliding_attention", "indexed_attention"]
    ),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "mamba2": dict(num_heads=8),  # hidden 32 x expand 2 = 8 heads of head_dim 8
    "ministral": dict(head_dim=8),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[16, 16], axial_pos_shape=[8, 16]),
    "xlnet": dict(max_position_embeddings=None, d_head=8),  # it takes no length limit
    "zamba": dict(num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
    "zaya": dict(num_experts_per_tok=1),  # its only supported value
    "flint": dict(mlp_only_layers=[0]),  # its default makes layers 0 and 1 dense: no MoE layer of 2
    "glm4_moe": dict(_MOE, first_k_dense_replace=1, n_routed_experts=4, n_group=2, topk_group=1),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_MOE, num_experts=4, shared_expert_intermediate_size=16),
    "qwen3_moe": dict(_MOE, num_experts=4),
}
"""Per model type, tiny-size overrides on top of the generic ones (what the type's config needs)."""


def causal_lm_model_types() -> tuple[str, ...]:
    """Sorted model types of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (what
    ``AutoModelForCausalLM`` builds: decoder-only LMs, decoder halves, and vision-language models whose
    causal-LM class is the text part or the whole model). Needs transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


_SHRINK: dict[str, Any] = dict(
    # experts: a few, two per token, narrow
    num_experts=4,
    n_routed_experts=4,
    num_local_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_k=2,
    top_k_experts=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    n_group=1,
    topk_group=1,
    # heads of hidden 32 / 4 heads; rotary and latent-attention dims to match
    head_dim=8,
    rotary_dim=4,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,  # = head_dim: latent-attention types rotate head_dim wide
    qk_nope_head_dim=8,
    v_head_dim=8,
    # windows shorter than the test sequences, so that they bite
    sliding_window=4,
    # Gemma 3n/4 per-layer input embeddings (262144 x 256 by default)
    vocab_size_per_layer_input=96,
    hidden_size_per_layer_input=8,
    # no dropout: the matrix compares deterministic forwards (the engines decide train-mode randomness)
    attention_dropout=0.0,
    residual_dropout=0.0,
)
"""Fields shrunk wherever the type's default config has them (not ``None``): the defaults of
mixture-of-experts and latent-attention types hold 64-384 experts and 128-wide heads, which make a
tiny model slow or inconsistent with hidden size 32."""


def _has(config: Any, fields: dict[str, Any], name: str) -> bool:
    # a stored field (not a derived property) of the default config that is set
    return fields.get(name) is not None


def tiny_config(model_type: str) -> Any:
    """A transformers config of ``model_type`` at tiny sizes (hidden 32, 2 layers, vocabulary 96; the
    :data:`_SHRINK` fields its default config sets; then the type's own overrides).

    Raises whatever transformers raises when the type cannot take these sizes."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    sizes = {**_TINY, **_shrunk(default), **_OVERRIDES.get(model_type, {})}
    sizes = {k: v for k, v in sizes.items() if v is not None}  # an override of None drops the field
    text = getattr(default, "text_config", None)
    if text is not None and hasattr(text, "to_dict"):  # a composite config: its language model too
        sizes["text_config"] = {**_TINY, **_shrunk(text), **_OVERRIDES.get(model_type, {})}
    return AutoConfig.for_model(model_type, **sizes)


def _shrunk(default: Any) -> dict[str, Any]:
    fields = default.to_dict()
    shrink = {k: v for k, v in _SHRINK.items() if _has(default, fields, k)}
    if "kv_lora_rank" in shrink:  # latent attention: one key/value head per query head
        shrink["num_key_value_heads"] = _TINY["num_attention_heads"]
    return shrink


@dataclass(frozen=True)
class CoverageRow:
    """One model type on one engine: ``status`` (see :data:`Status`) and ``reason`` (the engine"s
    ``ConfigError`` message for ``refused``, what the matrix test finds for ``accepted``, transformers'
    error for ``no-tiny-config``, else empty)."""

    model_type: str
    engine: str
    status: Status
    reason: str = ""


def _fsdp2_check(config: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from underlay.models._compat import inspect_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    inspect_model(model)


def _mcore_check(config: Any) -> None:
    # coverage reports over both engines; the engine module is looked up late (models sits below
    # engines in the layer contract and must not import them at module level)
    importlib.import_module("underlay.engines.mcore.config").arch_of(config)


def classify(model_type: str) -> list[CoverageRow]:
    """The live classification of ``model_type`` on every engine of :data:`ENGINES` (one row each).

    Engine refusals are caught (``ConfigError``); any other error building the tiny config or model
    gives ``no-tiny-config``. Needs transformers and torch (mcore needs nothing more: only its config
    check runs)."""
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if bool(getattr(AutoConfig.for_model(model_type), "is_encoder_decoder", False)):
                return [CoverageRow(model_type, e, "encoder-decoder") for e in ENGINES]
            config = tiny_config(model_type)
            _fsdp2_check(config)
            fsdp2: tuple[Status, str] = (
                ("exact", "") if model_type in EXACT["fsdp2"] else ("accepted", NOT_EXACT.get(model_type, ""))
            )
        except ConfigError as exc:
            fsdp2 = ("refused", str(exc))
        except Exception as exc:  # transformers cannot build the type at these sizes
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            reason = f"{type(exc).__name__}: {' '.join(lines[:2])[:300]}"
            return [CoverageRow(model_type, e, "no-tiny-config", reason) for e in ENGINES]
        try:
            _mcore_check(config)
            mcore: tuple[Status, str] = ("exact" if model_type in EXACT["mcore"] else "accepted", "")
        except ConfigError as exc:
            mcore = ("refused", str(exc))
    return [CoverageRow(model_type, "fsdp2", *fsdp2), CoverageRow(model_type, "mcore", *mcore)]


def coverage_matrix() -> list[CoverageRow]:
    """:func:`classify` of every :func:`causal_lm_model_types` (about 200 types; a few seconds)."""
    return [row for mt in causal_lm_model_types() for row in classify(mt)]


def unknown_model_types() -> tuple[str, ...]:
    """Causal-LM model types of the installed transformers that :data:`KNOWN` does not classify."""
    return tuple(mt for mt in causal_lm_model_types() if mt not in KNOWN)


def counts(rows: list[CoverageRow]) -> dict[str, dict[str, int]]:
    """Per engine, the number of rows of each status."""
    out: dict[str, Counter[str]] = {e: Counter() for e in ENGINES}
    for r in rows:
        out[r.engine][r.status] += 1
    return {e: dict(sorted(c.items())) for e, c in out.items()}


def markdown_table(rows: list[CoverageRow]) -> str:
    """The counts per engine then the matrix as a markdown table (one line per model type: the status
    per engine), as in docs/model-matrix.md."""
    out = [f"- {e}: " + ", ".join(f"{n} {s}" for s, n in per.items()) for e, per in counts(rows).items()]
    by_type: dict[str, dict[str, str]] = {}
    for r in rows:
        by_type.setdefault(r.model_type, {})[r.engine] = r.status
    out += ["", "| model type | " + " | ".join(ENGINES) + " |", "|---|" + "---|" * len(ENGINES)]
    for mt, per in by_type.items():
        out.append(f"| {mt} | " + " | ".join(per[e] for e in ENGINES) + " |")
    return "\n".join(out)


KNOWN: dict[str, tuple[str, str]] = {
    "afmoe": ("exact", "refused"),
    "apertus": ("exact", "refused"),
    "apertus1p5_text": ("exact", "refused"),
    "arcee": ("exact", "refused"),
    "aria_text": ("exact", "refused"),
    "axk1": ("exact", "refused"),
    "axk2": ("refused", "refused"),
    "bailing_hybrid": ("refused", "refused"),
    "bamba": ("refused", "refused"),
    "bart": ("encoder-decoder", "encoder-decoder"),
    "beam": ("exact", "refused"),
    "bert": ("refused", "refused"),
    "bert-generation": ("refused", "refused"),
    "big_bird": ("refused", "refused"),
    "bigbird_pegasus": ("encoder-decoder", "encoder-decoder"),
    "biogpt": ("exact", "refused"),
    "bitnet": ("exact", "refused"),
    "blenderbot": ("encoder-decoder", "encoder-decoder"),
    "blenderbot-small": ("encoder-decoder", "encoder-decoder"),
    "bloom": ("refused", "refused"),
    "blt": ("refused", "refused"),
    "camembert": ("refused", "refused"),
    "codegen": ("refused", "refused"),
    "cohere": ("refused", "refused"),
    "cohere2": ("refused", "refused"),
    "cohere2_moe": ("refused", "refused"),
    "cohere_compass_text": ("exact", "refused"),
    "cpmant": ("refused", "refused"),
    "ctrl": ("refused", "refused"),
    "cwm": ("exact", "refused"),
    "data2vec-text": ("refused", "refused"),
    "dbrx": ("exact", "refused"),
    "deepseek_v2": ("exact", "refused"),
    "deepseek_v3": ("exact", "exact"),
    "deepseek_v32": ("refused", "refused"),
    "deepseek_v4": ("refused", "refused"),
    "diffllama": ("exact", "refused"),
    "doge": ("refused", "refused"),
    "dory": ("refused", "refused"),
    "dots1": ("exact", "refused"),
    "dots3_note": ("no-tiny-config", "no-tiny-config"),
    "dots3_note_text": ("refused", "refused"),
    "electra": ("refused", "refused"),
    "emu3": ("exact", "refused"),
    "ergo": ("exact", "refused"),
    "ernie": ("refused", "refused"),
    "ernie4_5": ("exact", "refused"),
    "ernie4_5_moe": ("exact", "refused"),
    "exaone": ("exact", "refused"),
    "exaone4": ("exact", "refused"),
    "exaone_moe": ("exact", "refused"),
    "falcon": ("exact", "refused"),
    "falcon_h1": ("refused", "refused"),
    "falcon_mamba": ("refused", "refused"),
    "flex_olmo": ("exact", "refused"),
    "flint": ("exact", "refused"),
    "fuyu": ("exact", "refused"),
    "gemma": ("exact", "refused"),
    "gemma2": ("exact", "refused"),
    "gemma3": ("refused", "refused"),
    "gemma3_text": ("exact", "refused"),
    "gemma3n": ("no-tiny-config", "no-tiny-config"),
    "gemma3n_text": ("exact", "refused"),
    "gemma4": ("exact", "refused"),
    "gemma4_assistant": ("no-tiny-config", "no-tiny-config"),
    "gemma4_text": ("exact", "refused"),
    "gemma4_unified": ("exact", "refused"),
    "gemma4_unified_assistant": ("refused", "refused"),
    "gemma4_unified_text": ("exact", "refused"),
    "git": ("refused", "refused"),
    "glm": ("exact", "refused"),
    "glm4": ("exact", "refused"),
    "glm4_moe": ("exact", "exact"),
    "glm4_moe_lite": ("exact", "refused"),
    "glm_moe_dsa": ("refused", "refused"),
    "got_ocr2": ("refused", "refused"),
    "gpt-sw3": ("exact", "refused"),
    "gpt2": ("exact", "refused"),
    "gpt_bigcode": ("exact", "refused"),
    "gpt_neo": ("refused", "refused"),
    "gpt_neox": ("exact", "refused"),
    "gpt_neox_japanese": ("refused", "refused"),
    "gpt_oss": ("exact", "refused"),
    "gptj": ("refused", "refused"),
    "granite": ("exact", "refused"),
    "granite_swa": ("exact", "refused"),
    "granitemoe": ("exact", "refused"),
    "granitemoe_swa": ("exact", "refused"),
    "granitemoehybrid": ("refused", "refused"),
    "granitemoeshared": ("exact", "refused"),
    "helium": ("exact", "refused"),
    "hrm_text": ("exact", "refused"),
    "hunyuan_v1_dense": ("exact", "refused"),
    "hunyuan_v1_moe": ("exact", "refused"),
    "hy_v3": ("exact", "refused"),
    "hy_v4": ("refused", "refused"),
    "hyperclovax": ("exact", "refused"),
    "inkling2_loop_text": ("refused", "refused"),
    "inkling2_text": ("refused", "refused"),
    "inkling_text": ("refused", "refused"),
    "internlm3": ("exact", "refused"),
    "iquestcoder": ("exact", "refused"),
    "jais2": ("exact", "refused"),
    "jamba": ("refused", "refused"),
    "jetmoe": ("exact", "refused"),
    "kimi_linear": ("refused", "refused"),
    "kolibri1": ("exact", "refused"),
    "kolibri1_1": ("refused", "refused"),
    "laguna": ("exact", "refused"),
    "lara_mini": ("refused", "refused"),
    "lfm2": ("exact", "refused"),
    "lfm2_moe": ("refused", "refused"),
    "lfm3": ("refused", "refused"),
    "llama": ("exact", "exact"),
    "llama4": ("refused", "refused"),
    "llama4_text": ("refused", "refused"),
    "longcat_flash": ("refused", "refused"),
    "mamba": ("refused", "refused"),
    "mamba2": ("refused", "refused"),
    "marian": ("encoder-decoder", "encoder-decoder"),
    "mbart": ("encoder-decoder", "encoder-decoder"),
    "megatron-bert": ("refused", "refused"),
    "mellum": ("exact", "refused"),
    "mimo_v2_flash": ("exact", "refused"),
    "minicpm3": ("refused", "refused"),
    "minicpm5_moe": ("exact", "refused"),
    "minimax": ("refused", "refused"),
    "minimax_m2": ("exact", "refused"),
    "minimax_m3_vl_text": ("exact", "refused"),
    "ministral": ("exact", "refused"),
    "ministral3": ("exact", "refused"),
    "mistral": ("exact", "exact"),
    "mixtral": ("exact", "exact"),
    "mllama": ("refused", "refused"),
    "modernbert-decoder": ("refused", "refused"),
    "moshi": ("exact", "refused"),
    "moss_transcribe_diarize": ("refused", "refused"),
    "mpt": ("refused", "refused"),
    "musicgen": ("encoder-decoder", "encoder-decoder"),
    "musicgen_melody": ("encoder-decoder", "encoder-decoder"),
    "mvp": ("encoder-decoder", "encoder-decoder"),
    "nanochat": ("exact", "refused"),
    "nemotron": ("exact", "refused"),
    "nemotron_h": ("refused", "refused"),
    "olmo": ("exact", "refused"),
    "olmo2": ("exact", "refused"),
    "olmo3": ("exact", "refused"),
    "olmo_hybrid": ("refused", "refused"),
    "olmoe": ("exact", "refused"),
    "openai-gpt": ("refused", "refused"),
    "opt": ("exact", "refused"),
    "param2moe": ("exact", "refused"),
    "pegasus": ("encoder-decoder", "encoder-decoder"),
    "persimmon": ("exact", "refused"),
    "phi": ("refused", "refused"),
    "phi3": ("exact", "refused"),
    "phi4_multimodal": ("refused", "refused"),
    "phimoe": ("exact", "refused"),
    "plbart": ("encoder-decoder", "encoder-decoder"),
    "prophetnet": ("encoder-decoder", "encoder-decoder"),
    "qwen2": ("exact", "exact"),
    "qwen2_moe": ("exact", "exact"),
    "qwen3": ("exact", "exact"),
    "qwen3_5": ("refused", "refused"),
    "qwen3_5_moe": ("refused", "refused"),
    "qwen3_5_moe_text": ("refused", "refused"),
    "qwen3_5_text": ("refused", "refused"),
    "qwen3_moe": ("exact", "exact"),
    "qwen3_next": ("refused", "refused"),
    "qwen4_exp": ("refused", "refused"),
    "qwen4_exp_text": ("refused", "refused"),
    "recurrent_gemma": ("refused", "refused"),
    "reformer": ("refused", "refused"),
    "rembert": ("refused", "refused"),
    "roberta": ("refused", "refused"),
    "roberta-prelayernorm": ("refused", "refused"),
    "roc_bert": ("refused", "refused"),
    "roformer": ("refused", "refused"),
    "rwkv": ("refused", "refused"),
    "sarvam_mla": ("exact", "refused"),
    "sarvam_moe": ("exact", "refused"),
    "seed_oss": ("exact", "refused"),
    "smollm3": ("exact", "refused"),
    "solar_open": ("exact", "refused"),
    "stablelm": ("exact", "refused"),
    "starcoder2": ("exact", "refused"),
    "trocr": ("refused", "refused"),
    "vaultgemma": ("exact", "refused"),
    "whisper": ("encoder-decoder", "encoder-decoder"),
    "xglm": ("refused", "refused"),
    "xlm": ("refused", "refused"),
    "xlm-roberta": ("refused", "refused"),
    "xlm-roberta-xl": ("refused", "refused"),
    "xlnet": ("refused", "refused"),
    "xlstm": ("refused", "refused"),
    "xmod": ("refused", "refused"),
    "youtu": ("exact", "refused"),
    "zamba": ("refused", "refused"),
    "zamba2": ("refused", "refused"),
    "zaya": ("refused", "refused"),
}
"""Reviewed ``(fsdp2 status, mcore status)`` per causal-LM model type of the installed transformers."""


ENGINE_GAPS: dict[str, dict[str, str]] = {
    "biogpt": {"load": "found no decoder layers"},
    "hrm_text": {"load": "builds one file tensor from several in-memory tensors"},
    "emu3": {"load": "is no AutoModelForCausalLM config"},
    "param2moe": {"load": "builds one file tensor from several in-memory tensors"},
    "sarvam_moe": {"load": "builds one file tensor from several in-memory tensors"},
}
"""Reviewed engine-level refusals of fsdp2 rows whose model forward is exact (:data:`EXACT`): per model
type, the check of tests/distributed/test_engine_matrix.py that the fsdp2 engine refuses (an
``underlay.errors`` exception, never a silent wrong number) and a fragment of its message. Checks:
``load`` (build the policy from transformers' ``save_pretrained`` checkpoint; when it is refused nothing
else runs), ``infer`` (``infer`` log-probs == ``forward_backward``'s), ``export`` (``export_hf`` ->
``from_pretrained`` gives the source's logits), ``checkpoint`` (``CheckpointManager`` save, load into a
fresh engine, same ``infer``), ``value`` (``ModelConfig(path, kind="value")`` loads head and backbone).
Beyond this table, ``value`` is refused by name for every model type transformers has no
token-classification class for (``value_refused``). Today's gaps: biogpt has no decoder-layer class
for fsdp2 to shard; hrm_text's checkpoint fuses ``gqkv_proj`` from four parameters (see sarvam_moe
below); emu3's ``save_pretrained`` writes an ``Emu3TextConfig``, which transformers'
``AutoModelForCausalLM`` cannot build (nor read back); sarvam_moe and param2moe store
``query_key_value`` fused on disk, built from three parameters (``q_proj``/``k_proj``/``v_proj``), which
a one-rule-per-parameter weight map cannot express. (The GPT-2 family, falcon and gpt_neox name their
token-classification head ``classifier``; the value path reads it: ``models.forward.value_head``.)"""


def value_refused(model_type: str) -> bool:
    """Whether ``ModelConfig(kind="value")`` of ``model_type`` is refused because transformers has no
    token-classification class for it (``AutoModelForTokenClassification``). Needs transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    return model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES
