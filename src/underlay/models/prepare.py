"""prepare_model: make a Hugging Face model route attention through underlay (and optionally tile MLPs)."""

from __future__ import annotations

import copy
import inspect
from typing import Any, TypeVar

from torch import nn

from underlay.interfaces import AttentionKernel, ConfigError
from underlay.models._compat import (
    capabilities,
    check_architecture,
    check_transformers_version,
    text_config,
    unwrap_model,
)
from underlay.models.attention import (
    ATTN_IMPLEMENTATION,
    ROUTE_ATTR,
    VARLEN_ATTN_IMPLEMENTATION,
    AttentionRoute,
    register_attention,
)
from underlay.models.rope import apply_per_sequence_rope
from underlay.models.tiled_mlp import apply_tiled_mlp, check_tileable
from underlay.parallel.ulysses import sp_world_size, validate_sp
from underlay.registry import resolve

__all__ = ["attention_modules", "prepare_model"]

M = TypeVar("M", bound=nn.Module)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of a transformers model that dispatch through its AttentionInterface
    (those :func:`underlay.models.inspect_model` lists), in module order. Raises ``ConfigError`` when
    the model is not supported."""
    inner = unwrap_model(model)
    names = set(capabilities(inner).attention_modules)
    return [m for name, m in inner.named_modules() if name in names]


def _splittable_after_embedding(inner: nn.Module) -> bool:
    """Whether a Qwen-VL style model's language model takes only embeddings and position ids (Qwen2.5-VL),
    so that Ulysses can split the sequence after the vision features are merged; Qwen3-VL's also takes
    deepstack features inside its layers."""
    backbone = getattr(inner, str(getattr(inner, "base_model_prefix", "model")), None)
    language = getattr(backbone, "language_model", None)
    if not isinstance(language, nn.Module):
        return False
    return "deepstack_visual_embeds" not in inspect.signature(language.forward).parameters


def _set_implementation(inner: nn.Module, config: Any) -> None:
    setter = getattr(inner, "set_attn_implementation", None)
    if callable(setter):
        setter(ATTN_IMPLEMENTATION)
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        config._attn_implementation = ATTN_IMPLEMENTATION


def prepare_model(
    model: M,
    *,
    attention: str | AttentionKernel | None = None,
    sp_group: Any | None = None,
    tiled_mlp_tiles: int | None = None,
) -> M:
    """Prepare a transformers causal-LM or token-classification model for RL training, in place.

    - Registers ``"underlay"`` with ``transformers.AttentionInterface`` and switches the model to it
      (``set_attn_implementation``), so every attention layer calls the underlay AttentionKernel
      ``attention`` (a registry name such as ``"eager"``, ``"torch"``, ``"flash_attn"``; ``None`` =
      ``UNDERLAY_ATTENTION`` or ``auto``; or a kernel object the caller built, e.g. with constructor
      options such as ``TorchAttention(device, dense_uniform=True)``, used for every call): packed input (batch 1, position ids restarting at 0) goes to
      ``kernel.varlen``, padded input with an attention mask to ``kernel.padded``; each layer's scaling,
      sliding window, softcap, sinks and causality are those the layer passes to the attention function
      (never the module's attributes). Use :func:`underlay.models.packed_forward` to run it.
    - ``sp_group``: Ulysses sequence parallelism over that process group (checked with
      :func:`underlay.parallel.ulysses.validate_sp` against the head counts). For Qwen2.5-VL the
      sequence is split after the vision features are merged into the embeddings (the vision tower's
      attention runs unsplit); Qwen3-VL (deepstack) is refused. A vision tower gets a private copy of its config
      whose attention implementation is ``VARLEN_ATTN_IMPLEMENTATION``, so each vision block makes one
      varlen call over all its images and windows (the model's own config is not changed).
    - ``tiled_mlp_tiles``: compute every decoder MLP (or MoE block) in that many token tiles with
      recomputation in backward (:class:`underlay.models.TiledMLP`); ``None`` leaves MLPs plain (and
      removes tiling installed by an earlier call). MLPs that return a tuple (gpt-oss) are refused.
    - Rotary embeddings whose frequencies depend on the sequence length (``dynamic``, ``longrope``) are
      computed per packed sequence (:func:`underlay.models.rope.apply_per_sequence_rope`), so a sequence's
      result does not depend on the sequences packed with it.

    What the model needs is inspected (:func:`underlay.models.inspect_model`: attention dispatch through
    the AttentionInterface, position ids, layer types, logit scaling; sliding windows, softcaps, sinks,
    latent attention and MoE blocks are recorded); the attention kernel is chosen per call from the
    call's ``AttentionSpec``, so ``auto`` picks one that can run softcaps, sinks or ``Dv != D``.

    Idempotent: calling it again re-applies the given settings. Parameter names and the module tree do
    not change. Returns ``model``. Warns when transformers is outside ``TESTED_TRANSFORMERS``.
    Raises ``ConfigError`` naming the missing capability for a model underlay cannot run, attention dropout
    > 0, bad ``tiled_mlp_tiles``, or head counts that sp does not split; ``UnknownBackend`` /
    ``BackendUnavailable`` for an attention name that does not exist or cannot run here.
    """
    check_transformers_version()
    inner = unwrap_model(model)
    config = check_architecture(inner)
    # resolved now, also when only UNDERLAY_ATTENTION names it: a bad name fails at build, not at the
    # first forward
    kernel_name = attention if attention is None or isinstance(attention, str) else None
    given = None if attention is None or isinstance(attention, str) else attention
    if given is None:
        resolve("attention", kernel_name)
    elif not isinstance(given, AttentionKernel):
        raise ConfigError(
            f"prepare_model(attention={attention!r}): give an attention backend name, an AttentionKernel "
            "object or None"
        )
    text = text_config(config)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    sp = sp_world_size(sp_group)
    validate_sp(heads, kv_heads, sp)
    caps = capabilities(inner)
    if sp > 1 and caps.multimodal_rope and not _splittable_after_embedding(inner):
        raise ConfigError(
            f"{config.model_type}: Ulysses sequence parallelism (sp={sp}) is not supported for this vision-language "
            "model: its language model takes vision features inside the decoder layers (deepstack), so the "
            "sequence cannot be split after the embedding; use sp=1"
        )
    dropout = float(getattr(text, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        raise ConfigError(
            f"{config.model_type}: config.attention_dropout={dropout}; the underlay attention route has no "
            "dropout, set attention_dropout=0.0"
        )
    if tiled_mlp_tiles is not None and (
        isinstance(tiled_mlp_tiles, bool) or not isinstance(tiled_mlp_tiles, int) or tiled_mlp_tiles < 1
    ):
        raise ConfigError(f"tiled_mlp_tiles={tiled_mlp_tiles!r}: must be an int >= 1 or None")
    if tiled_mlp_tiles is not None:
        check_tileable(inner)
    named = dict(inner.named_modules())
    vision = f"{getattr(inner, 'base_model_prefix', 'model')}.visual."
    register_attention()
    _set_implementation(inner, config)
    for name in caps.attention_modules:  # the vision tower sees whole images on every rank: no sp
        group = None if name.startswith(vision) else sp_group
        setattr(named[name], ROUTE_ATTR, AttentionRoute(kernel_name, group, given))
    tower = named.get(vision.rstrip("."))
    if tower is not None:
        _vision_varlen(tower)
        if not getattr(tower, _TEXT_PACKING_FILTER, False):
            tower.register_forward_pre_hook(_drop_text_packing, with_kwargs=True)
            setattr(tower, _TEXT_PACKING_FILTER, True)
    apply_tiled_mlp(inner, tiled_mlp_tiles)
    apply_per_sequence_rope(inner, sp_group)
    return model


def _vision_varlen(tower: nn.Module) -> None:
    """Give the vision tower (and every module of it that shares its config) a private copy of its
    config whose attention implementation is ``VARLEN_ATTN_IMPLEMENTATION``, so each vision block makes
    one varlen call. A copy, because transformers checks a ``"flash"``-named implementation for a flash
    library when a model is built: the model's own ``config.vision_config``, which exports save and from
    which models are built, keeps ``"underlay"``."""
    shared = getattr(tower, "config", None)
    if shared is None or getattr(shared, "_attn_implementation", None) == VARLEN_ATTN_IMPLEMENTATION:
        return
    own = copy.deepcopy(shared)
    own._attn_implementation = VARLEN_ATTN_IMPLEMENTATION
    for module in tower.modules():
        if getattr(module, "config", None) is shared:
            module.config = own


TEXT_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The packed-forward keywords that describe the text sequence (:func:`underlay.models.packed_forward`)."""
_TEXT_PACKING_FILTER = "_underlay_drops_text_packing"


def _drop_text_packing(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of a vision tower: some transformers versions pass the language model's keyword
    arguments on to it (``get_image_features(..., **kwargs)``), and with them the text sequence's
    packing metadata, which its attention would take for the image patches' own."""
    return args, {k: v for k, v in kwargs.items() if k not in TEXT_PACKING_KEYS}
