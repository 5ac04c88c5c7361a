"""Which Hugging Face architectures and transformers versions the model integration supports."""

from __future__ import annotations

import importlib.metadata
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from underlay.interfaces import ConfigError

__all__ = [
    "CAPABILITIES_ATTR",
    "SUPPORTED_ARCHITECTURES",
    "TESTED_TRANSFORMERS",
    "ModelCapabilities",
    "capabilities",
    "check_architecture",
    "check_transformers_version",
    "config_value",
    "inspect_model",
    "text_config",
    "unwrap_model",
]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
    "mixtral",
    "phi3",
    "glm4",
    "deepseek_v3",
    "gpt_oss",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
)
"""Hugging Face ``config.model_type`` values verified by tests on tiny random models (``qwen2`` covers
Qwen2 and Qwen2.5; the last three are vision-language models, with images and videos). :func:`underlay.models.prepare_model` does not consult this list: it accepts any
model whose needs :func:`inspect_model` finds supported, and names the missing capability otherwise."""

TESTED_TRANSFORMERS: tuple[str, ...] = (">=4.56", "<6")
"""PEP 440 specifiers of the transformers releases this integration is tested against; outside them
:func:`check_transformers_version` warns."""


def check_transformers_version(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed transformers) lies in :data:`TESTED_TRANSFORMERS`.

    Warns (``UserWarning``) naming the version and the tested range when it does not. Raises
    ``ConfigError`` when transformers is not installed (install ``underlay[hf]``).
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if version is None:
        try:
            version = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError as exc:
            raise ConfigError(
                "the model integration needs transformers; install it with `pip install underlay[hf]`"
            ) from exc
    spec = SpecifierSet(",".join(TESTED_TRANSFORMERS))
    ok = spec.contains(Version(version), prereleases=True)
    if not ok:
        warnings.warn(
            f"underlay.models is tested with transformers {spec} but transformers {version} is installed; "
            "attention routing relies on transformers' AttentionInterface and may misbehave. Install a "
            f"tested release (`pip install 'transformers{spec}'`)",
            UserWarning,
            stacklevel=3,
        )
    return ok


def unwrap_model(model: nn.Module) -> nn.Module:
    """The Hugging Face ``PreTrainedModel`` inside ``model`` (peft ``PeftModel`` wrappers are removed)."""
    inner: Any = model
    for _ in range(4):
        get_base = getattr(inner, "get_base_model", None)
        if get_base is None or not callable(get_base):
            break
        nxt = get_base()
        if nxt is inner:
            break
        inner = nxt
    if not isinstance(inner, nn.Module):
        raise ConfigError(f"expected a torch nn.Module (a transformers model), got {type(model).__name__}")
    return inner


@dataclass(frozen=True)
class ModelCapabilities:
    """What :func:`inspect_model` found a transformers model to need, all of which underlay provides.

    ``attention_modules``: qualified names of the modules that dispatch attention through
    ``transformers.AttentionInterface``; ``layer_types``: ``config.layer_types`` (``full_attention`` /
    ``sliding_attention``) or empty; ``sliding_window``: tokens, or ``None``; ``attention_softcap`` /
    ``final_logit_softcap``: the score and final-logit tanh caps (``None`` = none); ``sinks``: the
    attention modules carry sink logits; ``moe_blocks``: class names of the mixture-of-experts blocks;
    ``latent_attention``: multi-head latent attention (a value head dim other than the query/key one);
    ``multimodal_rope``: a Qwen-VL style vision-language model (vision tower ``visual``, 3-D rotary
    position ids from the backbone's ``get_rope_index``; see :func:`underlay.models.packed_forward`).
    """

    model_type: str
    attention_modules: tuple[str, ...]
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attention_softcap: float | None = None
    final_logit_softcap: float | None = None
    sinks: bool = False
    moe_blocks: tuple[str, ...] = ()
    latent_attention: bool = False
    multimodal_rope: bool = False


_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
_LOGIT_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")
CAPABILITIES_ATTR = "_underlay_capabilities"
"""Attribute of a prepared model that holds its :class:`ModelCapabilities`."""


_DISPATCHES: dict[type[nn.Module], bool] = {}


def _dispatches_attention(cls: type[nn.Module]) -> bool:
    """Whether ``cls.forward`` looks its attention function up in transformers' AttentionInterface
    (read from its source once per class)."""
    found = _DISPATCHES.get(cls)
    if found is None:
        try:
            found = "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
        except (OSError, TypeError):
            found = False
        _DISPATCHES[cls] = found
    return found


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if type(m).__name__.endswith("Attention") and _dispatches_attention(type(m))
    ]


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """``config.<name>`` read safely from a transformers config, or ``default`` when absent or ``None``.

    A heterogeneous config (transformers' per-layer configs, e.g. Gemma 4's per-layer head dims) raises
    on reading a per-layer attribute globally (``AmbiguousGlobalPerLayerAttributeError``); then the
    largest value over ``config.per_layer_config`` is returned (what a size or memory estimate needs).
    Any other error of the config propagates."""
    try:
        value = getattr(config, name, None)
    except Exception as exc:  # transformers' AmbiguousGlobalPerLayerAttributeError (a RuntimeError)
        if type(exc).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
        layers = getattr(config, "per_layer_config", None) or ()
        values = [v for v in (getattr(layer, name, None) for layer in layers) if v is not None]
        value = max(values) if values else None
    return default if value is None else value


def text_config(config: Any) -> Any:
    """The language-model part of a config: ``config.text_config`` for vision-language configs, else
    ``config`` itself."""
    return getattr(config, "text_config", None) or config


def _refuse(model: nn.Module, model_type: str, missing: str) -> ConfigError:
    return ConfigError(
        f"model_type {model_type!r} ({type(model).__name__}) is not supported by underlay.models: {missing}. "
        f"Architectures verified by tests: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _refuse_layer_kinds(model: nn.Module, model_type: str, config: Any) -> None:
    """Refuse attention kinds the kernels do not run (checked before the module layout, so the refusal
    names the missing capability rather than a layout detail)."""
    layer_types = tuple(str(t) for t in (getattr(config, "layer_types", None) or ()))
    unknown = sorted(set(layer_types) - _LAYER_TYPES)
    if unknown:
        raise _refuse(
            model,
            model_type,
            f"layer types {unknown} (only {sorted(_LAYER_TYPES)} are routed: no chunked or linear attention)",
        )
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk:
        raise _refuse(
            model,
            model_type,
            f"chunked attention (config.attention_chunk_size={chunk}) is not supported by the attention kernels",
        )


def _refuse_unrouted_features(
    model: nn.Module, model_type: str, modules: list[tuple[str, nn.Module]], config: Any
) -> None:
    """Refuse what the packed causal route and the log-prob head do not compute: cross-attention
    layers, key/value states from another model, dynamic attention masks and output-layer biases."""
    cross = sorted({type(m).__name__ for _, m in modules if "CrossAttention" in type(m).__name__})
    if cross:
        raise _refuse(
            model,
            model_type,
            f"cross-attention layers ({', '.join(cross)}: queries over another sequence's keys); the "
            "attention route runs causal self-attention over packed sequences only",
        )
    loops = getattr(config, "n_recurrent_loops", None) or 1
    if loops > 1:
        raise _refuse(
            model,
            model_type,
            f"depth-recurrent layers run {loops} times (config.n_recurrent_loops) whose attention keys span "
            "the earlier loops (more keys than queries); the attention route runs one key per token",
        )
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    layers = getattr(config, "num_hidden_layers", None) or 0
    if shared and shared >= layers:
        raise _refuse(
            model,
            model_type,
            f"every layer reuses key/value states of another model (config.num_kv_shared_layers={shared} of "
            f"num_hidden_layers={layers}: a speculative-decoding assistant); only self-contained models are routed",
        )
    keep = getattr(config, "keep_window_size", None)
    if keep is not None:
        raise _refuse(
            model,
            model_type,
            f"dynamic mask attention (config.keep_window_size={keep}: a learned per-token 4-D mask); the "
            "attention kernels take causal/sliding-window masks only",
        )
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(getattr(head, "bias", None), torch.Tensor):
        raise _refuse(
            model,
            model_type,
            f"an output-layer bias ({type(head).__name__}.bias on the lm_head), which the fused log-prob "
            "kernels do not take (a checkpoint whose lm_head bias is all zeros can drop it and load with "
            "a bias-free head)",
        )


def inspect_model(model: nn.Module) -> ModelCapabilities:
    """Check that underlay can run ``model`` (an unwrapped transformers causal-LM or token-classification
    model) and return what it needs.

    Requires: a Hugging Face ``config.model_type``; a decoder-only model (not encoder-decoder; a
    vision-language model only with a Qwen-VL style backbone: ``.visual`` and ``get_rope_index``); attention modules that dispatch through ``transformers.AttentionInterface``; a
    backbone whose ``forward`` takes ``position_ids`` and passes attention keyword arguments on
    (``**kwargs``); layer types only ``full_attention`` / ``sliding_attention``; no extra logit scaling
    other than Gemma's final softcap; no cross-attention layers, no dynamic (learned) attention masks, no
    lm_head bias, no key/value states shared from another model. MoE blocks, sinks, softcaps and latent attention are recorded.
    Raises ``ConfigError`` naming the first missing capability.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise ConfigError(
            f"{type(model).__name__} has no Hugging Face config.model_type; pass a transformers causal-LM or "
            f"token-classification model (verified: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(
            model, model_type, "encoder-decoder models are not supported (decoder-only text models)"
        )
    prefix = str(getattr(model, "base_model_prefix", "model"))
    backbone = getattr(model, prefix, None)
    multimodal = getattr(config, "vision_config", None) is not None
    if multimodal and not (
        callable(getattr(backbone, "get_rope_index", None))
        and isinstance(getattr(backbone, "visual", None), nn.Module)
    ):
        raise _refuse(
            model,
            model_type,
            "a vision-language model without a Qwen-VL style backbone (a .visual tower and get_rope_index "
            "for 3-D rotary position ids); only those are routed",
        )
    _refuse_layer_kinds(model, str(model_type), text_config(config))
    modules = _attention_modules(model)
    if not modules:
        raise _refuse(
            model,
            model_type,
            "no attention module dispatches through transformers' AttentionInterface "
            "(ALL_ATTENTION_FUNCTIONS), so attention cannot be routed to underlay's kernels",
        )
    if not isinstance(backbone, nn.Module):
        raise _refuse(model, model_type, f"no backbone module at .{prefix} (base_model_prefix)")
    params = inspect.signature(backbone.forward).parameters
    if "position_ids" not in params:
        raise _refuse(model, model_type, f"{type(backbone).__name__}.forward takes no position_ids")
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise _refuse(
            model,
            model_type,
            f"{type(backbone).__name__}.forward does not pass attention keyword arguments on (no **kwargs), "
            "so packed sequence boundaries cannot reach the attention kernel",
        )
    _refuse_unrouted_features(model, str(model_type), modules, text_config(config))
    config = text_config(config)
    layer_types = tuple(str(t) for t in (getattr(config, "layer_types", None) or ()))
    for attr in _LOGIT_SCALES:
        value = getattr(config, attr, None)
        if value is not None and float(value) != 1.0:
            raise _refuse(
                model,
                model_type,
                f"config.{attr}={value} rescales the logits, which the log-prob head does not",
            )
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    attn_cap = getattr(config, "attn_logit_softcapping", None)
    final_cap = getattr(config, "final_logit_softcapping", None)
    moe = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if isinstance(getattr(m, "experts", None), nn.Module) or type(m).__name__.endswith("MoE")
        }
    )
    v_dim, qk_dim = getattr(config, "v_head_dim", None), getattr(config, "qk_head_dim", None)
    return ModelCapabilities(
        model_type=str(model_type),
        attention_modules=tuple(name for name, _ in modules),
        layer_types=layer_types,
        sliding_window=int(window) if window else None,
        attention_softcap=float(attn_cap) if attn_cap else None,
        final_logit_softcap=float(final_cap) if final_cap else None,
        sinks=any(isinstance(getattr(m, "sinks", None), torch.Tensor) for _, m in modules),
        moe_blocks=tuple(moe),
        latent_attention=v_dim is not None and qk_dim is not None and int(v_dim) != int(qk_dim),
        multimodal_rope=multimodal,
    )


def check_architecture(model: nn.Module) -> Any:
    """Return the model's config after :func:`inspect_model` found everything it needs supported (the
    result is kept on the model, see :data:`CAPABILITIES_ATTR`). Raises ``ConfigError`` naming the
    missing capability."""
    caps = inspect_model(model)
    model.__dict__[CAPABILITIES_ATTR] = caps
    return model.config


def capabilities(model: nn.Module) -> ModelCapabilities:
    """The :class:`ModelCapabilities` of ``model`` (cached by :func:`check_architecture`)."""
    caps = model.__dict__.get(CAPABILITIES_ATTR)
    if isinstance(caps, ModelCapabilities):
        return caps
    check_architecture(model)
    return model.__dict__[CAPABILITIES_ATTR]  # type: ignore[no-any-return]
