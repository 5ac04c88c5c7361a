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
    "EXACT",
    "KNOWN",
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
``accepted``: the engine's capability check passes but no test proves exactness yet; ``refused``: the
engine raises ``ConfigError`` (the reason is its message); ``encoder-decoder``: transformers"
default config of the type is an encoder-decoder (its causal-LM class is a decoder half; not a
decoder-only causal LM); ``no-tiny-config``: transformers cannot build
the type at the generic tiny sizes (the type's config needs other sizes), so it is not classified."""

ENGINES: tuple[str, ...] = ("fsdp2", "mcore")

EXACT: dict[str, frozenset[str]] = {
    "fsdp2": frozenset(
        {
            "apertus",
            "apertus1p5_text",
            "arcee",
            "aria_text",
            "beam",
            "biogpt",
            "bitnet",
            "cwm",
            "deepseek_v3",
            "diffllama",
            "ernie4_5",
            "exaone",
            "exaone4",
            "falcon",
            "flex_olmo",
            "fuyu",
            "gemma",
            "gemma2",
            "gemma3_text",
            "gemma4_unified_text",
            "glm",
            "glm4",
            "glm4_moe",
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
            "hrm_text",
            "hyperclovax",
            "internlm3",
            "iquestcoder",
            "jais2",
            "jetmoe",
            "lfm2",
            "llama",
            "minimax_m2",
            "minimax_m3_vl_text",
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
            "persimmon",
            "phi3",
            "qwen2",
            "qwen2_moe",
            "qwen3",
            "qwen3_moe",
            "smollm3",
            "stablelm",
            "starcoder2",
            "vaultgemma",
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
_OVERRIDES: dict[str, dict[str, Any]] = {
    # a few experts (the defaults hold 60-256); every layer but the first MoE in the DeepSeek-style
    # types (their defaults make the first 3 dense, leaving no MoE layer of 2)
    "deepseek_v3": dict(
        _MOE, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=4, n_group=2, topk_group=1
    ),
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


def tiny_config(model_type: str) -> Any:
    """A transformers config of ``model_type`` at tiny sizes (hidden 32, 2 layers, vocabulary 96).

    Raises whatever transformers raises when the type cannot take these sizes."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**_TINY, **_OVERRIDES.get(model_type, {})})


@dataclass(frozen=True)
class CoverageRow:
    """One model type on one engine: ``status`` (see :data:`Status`) and ``reason`` (the engine"s
    ``ConfigError`` message for ``refused``, transformers' error for ``no-tiny-config``, else empty)."""

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
            fsdp2: tuple[Status, str] = ("exact" if model_type in EXACT["fsdp2"] else "accepted", "")
        except ConfigError as exc:
            fsdp2 = ("refused", str(exc))
        except Exception as exc:  # transformers cannot build the type at these sizes
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
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
    "afmoe": ("accepted", "refused"),
    "apertus": ("exact", "refused"),
    "apertus1p5_text": ("exact", "refused"),
    "arcee": ("exact", "refused"),
    "aria_text": ("exact", "refused"),
    "axk1": ("accepted", "refused"),
    "axk2": ("refused", "refused"),
    "bailing_hybrid": ("refused", "refused"),
    "bamba": ("no-tiny-config", "no-tiny-config"),
    "bart": ("encoder-decoder", "encoder-decoder"),
    "beam": ("exact", "refused"),
    "bert": ("accepted", "refused"),
    "bert-generation": ("accepted", "refused"),
    "big_bird": ("refused", "refused"),
    "bigbird_pegasus": ("encoder-decoder", "encoder-decoder"),
    "biogpt": ("exact", "refused"),
    "bitnet": ("exact", "refused"),
    "blenderbot": ("encoder-decoder", "encoder-decoder"),
    "blenderbot-small": ("encoder-decoder", "encoder-decoder"),
    "bloom": ("refused", "refused"),
    "blt": ("accepted", "refused"),
    "camembert": ("accepted", "refused"),
    "codegen": ("accepted", "refused"),
    "cohere": ("refused", "refused"),
    "cohere2": ("refused", "refused"),
    "cohere2_moe": ("refused", "refused"),
    "cohere_compass_text": ("no-tiny-config", "no-tiny-config"),
    "cpmant": ("refused", "refused"),
    "ctrl": ("accepted", "refused"),
    "cwm": ("exact", "refused"),
    "data2vec-text": ("accepted", "refused"),
    "dbrx": ("no-tiny-config", "no-tiny-config"),
    "deepseek_v2": ("accepted", "refused"),
    "deepseek_v3": ("exact", "exact"),
    "deepseek_v32": ("refused", "refused"),
    "deepseek_v4": ("refused", "refused"),
    "diffllama": ("exact", "refused"),
    "doge": ("accepted", "refused"),
    "dory": ("accepted", "refused"),
    "dots1": ("no-tiny-config", "no-tiny-config"),
    "dots3_note": ("no-tiny-config", "no-tiny-config"),
    "dots3_note_text": ("no-tiny-config", "no-tiny-config"),
    "electra": ("accepted", "refused"),
    "emu3": ("accepted", "refused"),
    "ergo": ("accepted", "refused"),
    "ernie": ("accepted", "refused"),
    "ernie4_5": ("exact", "refused"),
    "ernie4_5_moe": ("accepted", "refused"),
    "exaone": ("exact", "refused"),
    "exaone4": ("exact", "refused"),
    "exaone_moe": ("accepted", "refused"),
    "falcon": ("exact", "refused"),
    "falcon_h1": ("refused", "refused"),
    "falcon_mamba": ("refused", "refused"),
    "flex_olmo": ("exact", "refused"),
    "flint": ("accepted", "refused"),
    "fuyu": ("exact", "refused"),
    "gemma": ("exact", "refused"),
    "gemma2": ("exact", "refused"),
    "gemma3": ("refused", "refused"),
    "gemma3_text": ("exact", "refused"),
    "gemma3n": ("no-tiny-config", "no-tiny-config"),
    "gemma3n_text": ("no-tiny-config", "no-tiny-config"),
    "gemma4": ("accepted", "refused"),
    "gemma4_assistant": ("no-tiny-config", "no-tiny-config"),
    "gemma4_text": ("accepted", "refused"),
    "gemma4_unified": ("accepted", "refused"),
    "gemma4_unified_assistant": ("accepted", "refused"),
    "gemma4_unified_text": ("exact", "refused"),
    "git": ("refused", "refused"),
    "glm": ("exact", "refused"),
    "glm4": ("exact", "refused"),
    "glm4_moe": ("exact", "exact"),
    "glm4_moe_lite": ("accepted", "refused"),
    "glm_moe_dsa": ("refused", "refused"),
    "got_ocr2": ("refused", "refused"),
    "gpt-sw3": ("exact", "refused"),
    "gpt2": ("exact", "refused"),
    "gpt_bigcode": ("exact", "refused"),
    "gpt_neo": ("no-tiny-config", "no-tiny-config"),
    "gpt_neox": ("exact", "refused"),
    "gpt_neox_japanese": ("refused", "refused"),
    "gpt_oss": ("exact", "refused"),
    "gptj": ("accepted", "refused"),
    "granite": ("exact", "refused"),
    "granite_swa": ("exact", "refused"),
    "granitemoe": ("exact", "refused"),
    "granitemoe_swa": ("exact", "refused"),
    "granitemoehybrid": ("no-tiny-config", "no-tiny-config"),
    "granitemoeshared": ("exact", "refused"),
    "helium": ("accepted", "refused"),
    "hrm_text": ("exact", "refused"),
    "hunyuan_v1_dense": ("no-tiny-config", "no-tiny-config"),
    "hunyuan_v1_moe": ("no-tiny-config", "no-tiny-config"),
    "hy_v3": ("accepted", "refused"),
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
    "kolibri1": ("accepted", "refused"),
    "kolibri1_1": ("no-tiny-config", "no-tiny-config"),
    "laguna": ("accepted", "refused"),
    "lara_mini": ("refused", "refused"),
    "lfm2": ("exact", "refused"),
    "lfm2_moe": ("no-tiny-config", "no-tiny-config"),
    "lfm3": ("refused", "refused"),
    "llama": ("exact", "exact"),
    "llama4": ("refused", "refused"),
    "llama4_text": ("refused", "refused"),
    "longcat_flash": ("refused", "refused"),
    "mamba": ("refused", "refused"),
    "mamba2": ("no-tiny-config", "no-tiny-config"),
    "marian": ("encoder-decoder", "encoder-decoder"),
    "mbart": ("encoder-decoder", "encoder-decoder"),
    "megatron-bert": ("refused", "refused"),
    "mellum": ("accepted", "refused"),
    "mimo_v2_flash": ("accepted", "refused"),
    "minicpm3": ("refused", "refused"),
    "minicpm5_moe": ("accepted", "refused"),
    "minimax": ("refused", "refused"),
    "minimax_m2": ("exact", "refused"),
    "minimax_m3_vl_text": ("exact", "refused"),
    "ministral": ("no-tiny-config", "no-tiny-config"),
    "ministral3": ("exact", "refused"),
    "mistral": ("exact", "exact"),
    "mixtral": ("exact", "exact"),
    "mllama": ("refused", "refused"),
    "modernbert-decoder": ("accepted", "refused"),
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
    "param2moe": ("accepted", "refused"),
    "pegasus": ("encoder-decoder", "encoder-decoder"),
    "persimmon": ("exact", "refused"),
    "phi": ("accepted", "refused"),
    "phi3": ("exact", "refused"),
    "phi4_multimodal": ("refused", "refused"),
    "phimoe": ("accepted", "refused"),
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
    "qwen4_exp": ("no-tiny-config", "no-tiny-config"),
    "qwen4_exp_text": ("refused", "refused"),
    "recurrent_gemma": ("refused", "refused"),
    "reformer": ("no-tiny-config", "no-tiny-config"),
    "rembert": ("refused", "refused"),
    "roberta": ("accepted", "refused"),
    "roberta-prelayernorm": ("accepted", "refused"),
    "roc_bert": ("accepted", "refused"),
    "roformer": ("refused", "refused"),
    "rwkv": ("refused", "refused"),
    "sarvam_mla": ("accepted", "refused"),
    "sarvam_moe": ("accepted", "refused"),
    "seed_oss": ("accepted", "refused"),
    "smollm3": ("exact", "refused"),
    "solar_open": ("accepted", "refused"),
    "stablelm": ("exact", "refused"),
    "starcoder2": ("exact", "refused"),
    "trocr": ("refused", "refused"),
    "vaultgemma": ("exact", "refused"),
    "whisper": ("encoder-decoder", "encoder-decoder"),
    "xglm": ("refused", "refused"),
    "xlm": ("refused", "refused"),
    "xlm-roberta": ("accepted", "refused"),
    "xlm-roberta-xl": ("accepted", "refused"),
    "xlnet": ("no-tiny-config", "no-tiny-config"),
    "xlstm": ("refused", "refused"),
    "xmod": ("accepted", "refused"),
    "youtu": ("accepted", "refused"),
    "zamba": ("no-tiny-config", "no-tiny-config"),
    "zamba2": ("no-tiny-config", "no-tiny-config"),
    "zaya": ("refused", "refused"),
}
"""Reviewed ``(fsdp2 status, mcore status)`` per causal-LM model type of the installed transformers."""


ENGINE_GAPS: dict[str, dict[str, str]] = {
    "biogpt": {"load": "found no decoder layers"},
    "exaone": {"load": "missing ['model.embed_tokens.weight'"},
    "hrm_text": {"load": "missing ['model.L_module.layers.0.self_attn.q_proj.weight'"},
    "falcon": {"value": "nor a score head"},
    "gpt-sw3": {"value": "nor a score head"},
    "gpt2": {"value": "nor a score head"},
    "gpt_bigcode": {"value": "nor a score head"},
    "gpt_neox": {"value": "nor a score head"},
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
for fsdp2 to shard; exaone's and hrm_text's checkpoints hold fused/renamed tensors the fsdp2 weight map
does not convert; the GPT-2 family, falcon and gpt_neox name their token-classification head
``classifier``, which the value path does not read."""


def value_refused(model_type: str) -> bool:
    """Whether ``ModelConfig(kind="value")`` of ``model_type`` is refused because transformers has no
    token-classification class for it (``AutoModelForTokenClassification``). Needs transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    return model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES
