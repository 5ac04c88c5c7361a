"""Which Hugging Face architectures and transformers versions the model integration supports."""

from __future__ import annotations

import importlib.metadata
import warnings
from typing import Any

from torch import nn

from underlay.interfaces import ConfigError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TESTED_TRANSFORMERS",
    "check_architecture",
    "check_transformers_version",
    "unwrap_model",
]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
"""Hugging Face ``config.model_type`` values that :func:`underlay.models.prepare_model` accepts
(``qwen2`` covers Qwen2 and Qwen2.5). Each is tested on tiny random models for the causal-LM and the
token-classification (value head) variant."""

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


def check_architecture(model: nn.Module) -> Any:
    """Return the model's config after checking that ``config.model_type`` is supported.

    Raises ``ConfigError`` naming :data:`SUPPORTED_ARCHITECTURES` for any other model type, or when the
    module has no Hugging Face config.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise ConfigError(
            f"{type(model).__name__} has no Hugging Face config.model_type; pass a transformers model "
            f"of one of the supported architectures {SUPPORTED_ARCHITECTURES}"
        )
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"model_type {model_type!r} ({type(model).__name__}) is not supported by underlay.models; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return config
