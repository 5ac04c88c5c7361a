"""``ModelConfig.overrides``: changes to a model's Hugging Face config applied before it is built and
its weights load (RoPE scaling, maximum positions, dropout, MoE routing options...).

The overridden config is what the engine builds, what ``engine.hf_config`` returns and what
``export_hf`` writes, so an exported model reloads with the same behaviour. Overrides that would change
a parameter's shape while weights load from ``path`` are refused (the checkpoint could not fill the
model), as are the settings that have their own ``ModelConfig``/``EngineConfig`` field.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from underlay.interfaces import ConfigError, ModelConfig

__all__ = ["OWN_FIELD", "SHAPE_KEYS", "apply_overrides", "check_overrides"]

SHAPE_KEYS = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "n_shared_experts",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "first_k_dense_replace",
    }
)
"""Config keys that change parameter names or shapes: refused while weights load from ``path``."""

OWN_FIELD = {
    "attn_implementation": "ModelConfig.attention",
    "_attn_implementation": "ModelConfig.attention",
    "torch_dtype": "EngineConfig.param_dtype",
    "dtype": "EngineConfig.param_dtype",
    "model_type": "a checkpoint of the other architecture",
    "architectures": "ModelConfig.kind ('causal_lm' or 'value')",
    "num_labels": "ModelConfig.kind='value'",
}
"""Config keys with a field of their own elsewhere (which to set instead)."""


def check_overrides(overrides: Any, where: str = "ModelConfig.overrides") -> dict[str, Any]:
    """``overrides`` as a plain dict after the checks that need no model config (``{}`` for
    ``None``): a mapping of config keys (``"rope_scaling"``, or ``"text_config.rope_scaling"`` for a
    sub-config) to JSON-serialisable values, none of them a key with a field of its own
    (:data:`OWN_FIELD`). Raises ``ConfigError`` naming the key and what to do."""
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(
            f"{where}={overrides!r}: give a mapping of Hugging Face config keys to values, "
            "e.g. {'max_position_embeddings': 8192}"
        )
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        parts = key.split(".") if isinstance(key, str) else []
        if not parts or not all(p.isidentifier() for p in parts):
            raise ConfigError(f"{where} key {key!r}: use a config attribute name, dotted for a sub-config")
        if parts[-1] in OWN_FIELD:
            raise ConfigError(
                f"{where} key {key!r} is not overridable here: set {OWN_FIELD[parts[-1]]} instead"
            )
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}[{key!r}]={value!r} is not JSON-serialisable ({exc})") from exc
        out[key] = copy.deepcopy(value)
    return out


def _compatible(old: Any, new: Any) -> bool:
    if old is None or new is None:
        return True
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, (int, float)) and isinstance(new, (int, float)):
        return isinstance(old, float) or isinstance(new, int)
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        return True
    return isinstance(new, type(old))


def apply_overrides(hf_config: Any, model_cfg: ModelConfig) -> Any:
    """A new ``transformers`` config: ``hf_config`` with ``model_cfg.overrides`` applied through the
    config class's own constructor (so its validation runs, e.g. of ``rope_scaling``); ``hf_config``
    itself is returned unchanged when there are none, and is never modified.

    Raises ``ConfigError`` naming the key for a key the config (or sub-config) does not have, a value
    whose type differs from the current one (an int where a float is expected is accepted), a shape key
    (:data:`SHAPE_KEYS`) while weights load from ``model_cfg.path``, or a value the config class rejects.
    """
    overrides = check_overrides(model_cfg.overrides)
    if not overrides:
        return hf_config
    loading = model_cfg.path is not None and model_cfg.load_weights
    data = hf_config.to_dict()
    for key, value in overrides.items():
        *subs, leaf = key.split(".")
        target, node = hf_config, data
        for s in subs:
            target = getattr(target, s, None)
            if target is None or not isinstance(node.get(s), dict):
                raise ConfigError(f"ModelConfig.overrides key {key!r}: the config has no sub-config {s!r}")
            node = node[s]
        if not hasattr(target, leaf) and leaf not in node:
            known = sorted(k for k in node if not k.startswith("_"))
            raise ConfigError(
                f"ModelConfig.overrides key {key!r}: {type(target).__name__} has no such field "
                f"(it has: {', '.join(known)})"
            )
        if loading and leaf in SHAPE_KEYS:
            raise ConfigError(
                f"ModelConfig.overrides key {key!r} changes parameter shapes, but the weights load from "
                f"{model_cfg.path!r}; build from hf_config= without a checkpoint to change the architecture"
            )
        old = getattr(target, leaf, node.get(leaf))
        if not _compatible(old, value):
            raise ConfigError(
                f"ModelConfig.overrides[{key!r}]={value!r} is a {type(value).__name__}; the config's "
                f"value {old!r} is a {type(old).__name__}"
            )
        node[leaf] = value
    try:
        return type(hf_config).from_dict(data)
    except Exception as exc:  # transformers validates in the constructor: KeyError, ValueError, ...
        raise ConfigError(
            f"ModelConfig.overrides {overrides!r} rejected by {type(hf_config).__name__}: {type(exc).__name__}: {exc}"
        ) from exc
