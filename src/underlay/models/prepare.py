"""prepare_model: make a Hugging Face model route attention through underlay (and optionally tile MLPs)."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from underlay.interfaces import ConfigError
from underlay.models._compat import check_architecture, check_transformers_version, unwrap_model
from underlay.models.attention import (
    ATTN_IMPLEMENTATION,
    ROUTE_ATTR,
    AttentionRoute,
    register_attention,
)
from underlay.models.tiled_mlp import apply_tiled_mlp
from underlay.parallel.ulysses import sp_world_size, validate_sp
from underlay.registry import resolve

__all__ = ["attention_modules", "prepare_model"]

M = TypeVar("M", bound=nn.Module)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a supported transformers model (those with q/k/v projections)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention")
        and all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj"))
    ]


def _set_implementation(inner: nn.Module, config: Any) -> None:
    setter = getattr(inner, "set_attn_implementation", None)
    if callable(setter):
        setter(ATTN_IMPLEMENTATION)
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        config._attn_implementation = ATTN_IMPLEMENTATION


def prepare_model(
    model: M,
    *,
    attention: str | None = None,
    sp_group: Any | None = None,
    tiled_mlp_tiles: int | None = None,
) -> M:
    """Prepare a transformers causal-LM or token-classification model for RL training, in place.

    - Registers ``"underlay"`` with ``transformers.AttentionInterface`` and switches the model to it
      (``set_attn_implementation``), so every attention layer calls the underlay AttentionKernel
      ``attention`` (a registry name such as ``"eager"``, ``"torch"``, ``"flash_attn"``; ``None`` =
      ``UNDERLAY_ATTENTION`` or ``auto``): packed input (batch 1, position ids restarting at 0) goes to
      ``kernel.varlen``, padded input with an attention mask to ``kernel.padded``; the module's scaling,
      sliding window and softcap are respected. Use :func:`underlay.models.packed_forward` to run it.
    - ``sp_group``: Ulysses sequence parallelism over that process group (checked with
      :func:`underlay.parallel.ulysses.validate_sp` against the head counts).
    - ``tiled_mlp_tiles``: compute every decoder MLP (or MoE block) in that many token tiles with
      recomputation in backward (:class:`underlay.models.TiledMLP`); ``None`` leaves MLPs plain (and
      removes tiling installed by an earlier call).

    Idempotent: calling it again re-applies the given settings. Parameter names and the module tree do
    not change. Returns ``model``. Warns when transformers is outside ``TESTED_TRANSFORMERS``.
    Raises ``ConfigError`` for an architecture not in ``SUPPORTED_ARCHITECTURES``, attention dropout
    > 0, bad ``tiled_mlp_tiles``, or head counts that sp does not split; ``UnknownBackend`` /
    ``BackendUnavailable`` for an attention name that does not exist or cannot run here.
    """
    check_transformers_version()
    inner = unwrap_model(model)
    config = check_architecture(inner)
    # resolved now, also when only UNDERLAY_ATTENTION names it: a bad name fails at build, not at the
    # first forward
    resolve("attention", attention)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    validate_sp(heads, kv_heads, sp_world_size(sp_group))
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        raise ConfigError(
            f"{config.model_type}: config.attention_dropout={dropout}; the underlay attention route has no "
            "dropout, set attention_dropout=0.0"
        )
    if tiled_mlp_tiles is not None and (
        isinstance(tiled_mlp_tiles, bool) or not isinstance(tiled_mlp_tiles, int) or tiled_mlp_tiles < 1
    ):
        raise ConfigError(f"tiled_mlp_tiles={tiled_mlp_tiles!r}: must be an int >= 1 or None")
    modules = attention_modules(inner)
    if not modules:
        raise ConfigError(
            f"{type(inner).__name__}: found no attention modules with q_proj/k_proj/v_proj to route"
        )
    register_attention()
    _set_implementation(inner, config)
    for module in modules:
        setattr(module, ROUTE_ATTR, AttentionRoute(attention, sp_group))
    apply_tiled_mlp(inner, tiled_mlp_tiles)
    return model
