"""Remove-padding forward with a fused log-prob (or value) head: :func:`packed_forward`."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from underlay.interfaces import (
    IGNORE_INDEX,
    ConfigError,
    InvalidInput,
    LogprobKernel,
    PackedBatch,
    TokenOutputs,
)
from underlay.models._compat import ModelCapabilities, capabilities, text_config, unwrap_model
from underlay.models.attention import ATTN_IMPLEMENTATION, ROUTE_ATTR, AttentionRoute
from underlay.models.vision import shard_vision_tower, zero_vision_pass
from underlay.ops.attention import seqlens_from_cu
from underlay.ops.packing import pad, pad_to_multiple
from underlay.parallel.ulysses import gather_seq, slice_for_rank, sp_world_size
from underlay.registry import get_logprob_kernel

__all__ = [
    "MULTIMODAL_KEYS",
    "VALUE_HEADS",
    "multimodal_position_ids",
    "next_token_labels",
    "packed_forward",
    "shift_to_tokens",
    "softcapped_logprobs",
    "value_head",
]

MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)
"""Inputs :func:`packed_forward` passes to a Qwen-VL style backbone: images (``pixel_values``
``[patches, C * T_patch * P * P]`` and ``image_grid_thw [images, 3]``), videos (the same with
``_videos`` / ``video_grid_thw``) and ``second_per_grid_ts [videos]``, in the order their placeholder
tokens appear in the packed ``input_ids``."""


def multimodal_position_ids(
    backbone: nn.Module, packed: PackedBatch, multimodal: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """Rotary position ids of a packed Qwen-VL batch: ``[4, 1, T]`` int64, row 0 the text positions
    (restarting per sequence, used for the sequence boundaries) and rows 1-3 the temporal/height/width
    positions the backbone's ``get_rope_index`` gives each sequence (image and video tokens get 3-D
    grid positions, text after them continues from the largest). Computed per sequence on the padded
    layout, so every sequence restarts at 0 exactly as in an unpacked forward."""
    config = getattr(backbone, "config", None)
    ids = pad(packed.input_ids, packed)
    keep = pad(torch.ones_like(packed.input_ids), packed)
    kinds = torch.zeros_like(ids, dtype=torch.int32)
    for value, attr in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(config, attr, None)
        if token is not None:
            kinds = kinds.masked_fill(ids == int(token), value)
    get_rope_index: Callable[..., Any] = backbone.get_rope_index  # type: ignore[assignment]
    pos3, _ = get_rope_index(
        ids,
        kinds,
        image_grid_thw=multimodal.get("image_grid_thw"),
        video_grid_thw=multimodal.get("video_grid_thw"),
        second_per_grid_ts=multimodal.get("second_per_grid_ts"),
        attention_mask=keep,
    )
    flat = pos3.reshape(3, -1)[:, packed.indices.to(pos3.device)]
    text = packed.position_ids.to(flat.device, flat.dtype)[None]
    return torch.cat([text, flat])[:, None]


def softcapped_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    softcap: float,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``labels`` under ``softmax(c * tanh(hidden @ weight.T / c) / T)``.

    The unfused head for models whose final logits are soft-capped (Gemma 2/3). ``hidden [N, H]``,
    ``weight [V, H]`` (same dtype), ``labels [N]`` int64 in ``[0, V)`` or ``IGNORE_INDEX``. Math in fp32
    (fp64 for fp64 input), materialising ``[N, V]`` logits. Returns fp32 ``[N]`` log-probs and entropy
    (``None`` without ``with_entropy``), 0 where the label is ignored; differentiable.
    """
    compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = torch.matmul(hidden.to(compute), weight.to(compute).t())
    logits = softcap * torch.tanh(logits / softcap) / temperature
    lsm = logits.log_softmax(-1)
    keep = labels != IGNORE_INDEX
    picked = lsm.gather(-1, torch.where(keep, labels, 0)[:, None])[:, 0]
    log_probs = torch.where(keep, picked, torch.zeros_like(picked)).float()
    entropy = None
    if with_entropy:
        ent = -(lsm.exp() * lsm).sum(-1)
        entropy = torch.where(keep, ent, torch.zeros_like(ent)).float()
    return log_probs, entropy


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Labels for next-token prediction on packed tokens: ``labels[t] = input_ids[t + 1]`` when token
    ``t + 1`` is in the same sequence, else ``IGNORE_INDEX`` (the last token of every sequence).
    ``input_ids [T]`` int64, ``cu_seqlens [B + 1]`` -> ``[T]`` int64."""
    labels = torch.roll(input_ids, -1)
    last = (cu_seqlens[1:] - 1).to(torch.long)
    return labels.index_fill(0, last[last >= 0], IGNORE_INDEX)


def shift_to_tokens(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Move per-position next-token quantities onto the token they predict: ``out[t] = x[t - 1]``
    inside each sequence and ``out[t] = 0`` at the first token of every sequence. ``x [T]`` ->
    ``[T]`` (differentiable)."""
    shifted = torch.cat([x.new_zeros(1), x[:-1]])
    first = cu_seqlens[:-1].to(torch.long)
    keep = torch.ones_like(shifted, dtype=torch.bool).index_fill(0, first, False)
    return torch.where(keep, shifted, torch.zeros_like(shifted))


def _run_inside(module: nn.Module, body: Callable[..., Any], *args: Any) -> Any:
    """Call ``body(*args)`` as ``module``'s forward through ``module.__call__``, so that the hooks of
    ``module`` run around it (FSDP2 unshards its parameters, CPU offload moves them in). Pass at least
    one tensor in ``args``: FSDP2's root pre-forward on an accelerator indexes its (moved) inputs."""
    previous = module.__dict__.get("forward")
    module.forward = body
    try:
        return module(*args)
    finally:
        if previous is None:
            del module.__dict__["forward"]
        else:
            module.forward = previous


def _routes(inner: nn.Module) -> list[AttentionRoute]:
    """The attention routes ``prepare_model`` attached, in module order (empty: not prepared)."""
    routes = (getattr(module, ROUTE_ATTR, None) for module in inner.modules())
    return [route for route in routes if isinstance(route, AttentionRoute)]


def _validate_packed(packed: PackedBatch) -> None:
    ids, pos, cu = packed.input_ids, packed.position_ids, packed.cu_seqlens
    if ids.dim() != 1 or pos.shape != ids.shape:
        raise InvalidInput(
            f"packed_forward: input_ids {tuple(ids.shape)} and position_ids {tuple(pos.shape)} must both "
            "be [T]; build the batch with underlay.ops.unpad"
        )
    ends = cu[:: max(cu.numel() - 1, 1)].tolist() if cu.dim() == 1 else []  # first and last: one host read
    if cu.dim() != 1 or cu.numel() < 2 or ends[0] != 0 or ends[-1] != ids.numel():
        raise InvalidInput(
            f"packed_forward: cu_seqlens {cu.tolist() if cu.numel() < 16 else tuple(cu.shape)} must start "
            f"at 0 and end at T={ids.numel()}"
        )
    if ids.numel() == 0:
        raise InvalidInput("packed_forward: the packed batch has no tokens")


def packed_forward(
    model: nn.Module,
    packed: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    logprob_kernel: LogprobKernel | None = None,
    sp_group: Any | None = None,
    multimodal: Mapping[str, torch.Tensor] | None = None,
    zero_vision_passes: int = 0,
) -> TokenOutputs:
    """Run a :func:`prepare_model`-ed model on a packed (padding-free) batch and return per-token outputs.

    The backbone runs on ``input_ids[None]`` / ``position_ids[None]`` (the sequences of ``packed`` side
    by side, position ids restarting at 0), with the attention kernel told the boundaries directly.

    Causal LMs return ``log_probs`` and (``with_entropy``) ``entropy``, fp32 ``[T]``, **aligned to the
    token they score**: ``log_probs[t] = log p(input_ids[t] | input_ids[s:t])`` under
    ``softmax(logits / temperature)``, where ``s`` is the first token of ``t``'s sequence, and
    ``entropy[t]`` is the entropy of that same predicting distribution. The first token of every
    sequence has no prediction and gets 0 in both. They are computed from the final hidden states and
    the ``lm_head`` weight by the :class:`~underlay.interfaces.LogprobKernel` (``logprob_kernel``, or the
    registry's selection), never materialising ``[T, vocab]`` logits, models with a final logit softcap
    included (Gemma 2/3: ``logits = c * tanh(logits / c)`` before the temperature; the kernel applies
    it inside its chunks or tiles). Token-classification (value)
    models with ``num_labels == 1`` return ``values`` fp32 ``[T]``: ``values[t]`` is the score head at
    token ``t`` (no shift). ``ops.pad(x, packed)`` maps any ``[T]`` field back to ``[B, S]``.

    With ``sp_group`` (the group given to :func:`prepare_model`; by default the model's own) every rank
    passes the same ``packed`` batch, processes a ``1/sp`` slice of its tokens (padded to a multiple of
    sp) and gets the full ``[T]`` outputs. Gradients follow :mod:`underlay.parallel.ulysses`: each rank's
    parameter gradients are its share; their sum over the group equals the single-process gradient.

    Vision-language models (Qwen-VL style, see :func:`underlay.models.inspect_model`) take their image
    and video inputs in ``multimodal`` (keys :data:`MULTIMODAL_KEYS`); the vision tower runs inside the
    backbone (its attention routed too) and the text attention gets 3-D rotary position ids from
    :func:`multimodal_position_ids`. Text-only batches of such models need no ``multimodal``.
    ``zero_vision_passes``: run the vision tower that many more times on a one-token dummy image whose
    outputs enter the result with weight 0 (:func:`underlay.models.vision.zero_vision_pass`), so that a
    rank with fewer images than the other ranks of an FSDP group runs the sharded vision blocks as often
    as they do (the fsdp2 engine agrees the count per micro-batch); outputs and gradients are unchanged.

    Mixture-of-experts causal LMs whose transformers class defines a router auxiliary (load-balancing)
    loss (``load_balancing_loss_func`` with ``config.router_aux_loss_coef``: Mixtral, Qwen2/3-MoE, gpt-oss,
    ...) also return ``aux_loss``, a 0-dim tensor (differentiable, the router logits' dtype): the term
    transformers adds to its loss, ``router_aux_loss_coef * load_balancing_loss``, over this call's
    tokens (every token of the packed batch). It is not added to anything: the ``loss_fn`` decides
    (``docs/models.md``). ``None`` for every other model.

    Raises ``ConfigError`` when the model was not prepared, is not a supported architecture, has an
    unsupported head (lm_head bias, ``num_labels != 1``), or ``sp_group`` differs from the prepared one;
    ``InvalidInput`` for an inconsistent batch, ``temperature <= 0``, or ``multimodal`` inputs given to a
    text model or with keys outside :data:`MULTIMODAL_KEYS`.
    """
    if not temperature > 0:
        raise InvalidInput(f"packed_forward: temperature={temperature} must be > 0")
    _validate_packed(packed)
    inner = unwrap_model(model)
    caps = capabilities(inner)
    config = inner.config
    mm = _validate_multimodal(caps, multimodal)
    if (
        isinstance(zero_vision_passes, bool)
        or not isinstance(zero_vision_passes, int)
        or zero_vision_passes < 0
    ):
        raise InvalidInput(f"packed_forward: zero_vision_passes={zero_vision_passes!r} must be an int >= 0")
    if zero_vision_passes and not caps.multimodal_rope:
        raise InvalidInput(
            f"packed_forward: zero_vision_passes={zero_vision_passes} for {caps.model_type}, a model without a vision tower"
        )
    routes = _routes(inner)
    if not routes or getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        raise ConfigError(
            f"packed_forward: {type(inner).__name__} is not prepared (attn_implementation="
            f"{getattr(config, '_attn_implementation', None)!r}); call underlay.models.prepare_model(model) first"
        )
    group = next((r.sp_group for r in routes if r.sp_group is not None), None)  # (vision routes: none)
    if sp_group is not None and sp_group is not group:
        raise ConfigError(
            "packed_forward: sp_group differs from the group given to prepare_model; prepare the model "
            "with prepare_model(model, sp_group=group) and pass the same group (or none)"
        )
    for route in routes:  # compiled layers may now use the kernel calls their eager calls resolved
        route.activate_traceable()
    head = _head_of(inner)
    kernel = None
    cap = caps.final_logit_softcap
    if head == "lm":
        kernel = logprob_kernel if logprob_kernel is not None else get_logprob_kernel()
    aux = _router_aux(inner, head)
    outs = _run_inside(
        model,
        lambda _ids: _packed_body(
            inner, head, kernel, cap, packed, group, temperature, with_entropy, mm, zero_vision_passes, aux
        ),
        packed.input_ids,
    )
    log_probs, entropy, values, aux_loss = outs
    return TokenOutputs(log_probs=log_probs, entropy=entropy, values=values, aux_loss=aux_loss)


def _validate_multimodal(
    caps: ModelCapabilities, multimodal: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor] | None:
    if not caps.multimodal_rope:
        if multimodal:
            raise InvalidInput(
                f"packed_forward: multimodal inputs {sorted(multimodal)} given to {caps.model_type}, a text model"
            )
        return None
    given = dict(multimodal or {})
    unknown = sorted(set(given) - set(MULTIMODAL_KEYS))
    if unknown:
        raise InvalidInput(
            f"packed_forward: unknown multimodal inputs {unknown}; expected keys {MULTIMODAL_KEYS}"
        )
    return {k: v for k, v in given.items() if v is not None}


def _split_after_embedding(
    backbone: nn.Module, group: Any | None, ids: torch.Tensor, rope: torch.Tensor, kwargs: dict[str, Any]
) -> Any:
    """Run a Qwen-VL backbone on the whole packed sequence ``ids [1, T]`` (so image placeholders meet
    their features) with ``rope [4, 1, T]`` positions; under Ulysses its language model gets only this
    rank's slice of the merged embeddings and positions (a pre-hook), so text tokens are not duplicated,
    and each rank runs the vision tower on its share of the images (:func:`shard_vision_tower`).
    Returns the backbone output (``last_hidden_state [1, T / sp, H]``)."""
    language = getattr(backbone, "language_model", None)
    if sp_world_size(group) == 1 or not isinstance(language, nn.Module):
        return backbone(input_ids=ids, position_ids=rope, **kwargs)

    def local_slice(_module: nn.Module, args: Any, kw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        kw = dict(kw)
        kw["inputs_embeds"] = slice_for_rank(kw["inputs_embeds"], group, dim=1)
        kw["position_ids"] = slice_for_rank(kw["position_ids"], group, dim=-1)
        return args, kw

    handle = language.register_forward_pre_hook(local_slice, with_kwargs=True)
    try:
        with shard_vision_tower(backbone, group):  # each rank encodes its share of the images
            return backbone(input_ids=ids, position_ids=rope, **kwargs)
    finally:
        handle.remove()


@dataclass(frozen=True)
class _RouterAux:
    """How transformers' causal-LM class of an MoE model computes its router auxiliary loss:
    ``coef * fn(router_logits, experts, top_k, attention_mask)``."""

    fn: Callable[..., Any]
    experts: int
    top_k: int
    coef: float


def _router_aux(inner: nn.Module, head: str) -> _RouterAux | None:
    """The router auxiliary loss of ``inner`` when its transformers causal-LM class defines one (its
    modeling module has ``load_balancing_loss_func`` and its config ``output_router_logits`` and
    ``router_aux_loss_coef``); ``None`` otherwise (dense models; value models, whose transformers
    classes compute none)."""
    if head != "lm":
        return None
    cfg = text_config(inner.config)
    # the class's modeling module (along the MRO: FSDP2 subclasses the model class in its own module)
    found = (
        getattr(sys.modules.get(c.__module__), "load_balancing_loss_func", None) for c in type(inner).__mro__
    )
    fn = next((f for f in found if callable(f)), None)
    coef = getattr(cfg, "router_aux_loss_coef", None)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not callable(fn) or not hasattr(cfg, "output_router_logits") or coef is None:
        return None
    if not experts or not top_k:
        raise ConfigError(
            f"packed_forward: {type(inner).__name__} defines a router auxiliary loss but its config has "
            f"no expert count (num_experts/num_local_experts={experts}) or top-k (num_experts_per_tok={top_k})"
        )
    return _RouterAux(fn, int(experts), int(top_k), float(coef))


VALUE_HEADS = ("score", "classifier")
"""Attribute names of transformers' token-classification heads: ``score`` (Llama, Qwen, Mistral, ...)
and ``classifier`` (GPT-2, GPT-BigCode, GPT-NeoX, Falcon), each applied after the model's own
``dropout`` module (when it has one) to the final hidden states."""


def value_head(inner: nn.Module) -> nn.Module | None:
    """The token-classification head of ``inner`` (``score`` or ``classifier``, see
    :data:`VALUE_HEADS`), ``None`` for a model with neither. ``ConfigError`` when it has both (which
    one scores is then not known) or when the head has another output count than 1 (``out_features``,
    else ``config.num_labels``)."""
    found = {n: m for n in VALUE_HEADS if isinstance(m := getattr(inner, n, None), nn.Module)}
    if len(found) > 1:
        raise ConfigError(
            f"packed_forward: {type(inner).__name__} has both a 'score' and a 'classifier' module, so "
            "its value head is ambiguous; use a model with one token-classification head"
        )
    if not found:
        return None
    ((name, head),) = found.items()  # nn.Linear, or peft's modules_to_save wrapper around it
    outputs = getattr(head, "out_features", None) or getattr(inner.config, "num_labels", None)
    if outputs != 1:
        raise ConfigError(
            f"packed_forward: the value head {type(inner).__name__}.{name} has {outputs} outputs; "
            "build the value model with num_labels=1"
        )
    return head


def _head_of(inner: nn.Module) -> str:
    if value_head(inner) is not None:
        return "value"
    get_head = getattr(inner, "get_output_embeddings", None)
    lm_head = get_head() if callable(get_head) else None
    if not isinstance(lm_head, nn.Linear):
        raise ConfigError(
            f"packed_forward: {type(inner).__name__} has neither a plain nn.Linear lm_head (causal LM; "
            f"got {type(lm_head).__name__}, e.g. LoRA on lm_head is not supported) nor a token-"
            "classification head (score or classifier); use AutoModelForCausalLM or AutoModelForTokenClassification"
        )
    if lm_head.bias is not None:
        raise ConfigError(
            f"packed_forward: {type(inner).__name__}.lm_head has a bias, which the fused log-prob kernel "
            "does not take; supported architectures have bias-free heads"
        )
    return "lm"


def _packed_body(
    inner: nn.Module,
    head: str,
    kernel: LogprobKernel | None,
    final_softcap: float | None,
    packed: PackedBatch,
    group: Any | None,
    temperature: float,
    with_entropy: bool,
    multimodal: dict[str, torch.Tensor] | None,
    zero_vision_passes: int = 0,
    aux: _RouterAux | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    ids, pos = packed.input_ids, packed.position_ids
    cu = packed.cu_seqlens.to(device=ids.device, dtype=torch.int32)
    total = int(ids.numel())
    max_len = int(packed.max_seqlen)
    sp = sp_world_size(group)
    if sp > 1:
        ids, pos = pad_to_multiple(ids, sp, dim=0), pad_to_multiple(pos, sp, dim=0)
        extra = int(ids.numel()) - total
        if extra:
            # the padding forms its own sequence, so real tokens never attend to it
            pos = torch.cat([pos[:total], torch.arange(extra, device=pos.device, dtype=pos.dtype)])
            cu = torch.cat([cu, cu.new_tensor([total + extra])])
            max_len = max(max_len, extra)
    # all boundaries checked on the host once per forward (compiled layers call the kernel unchecked)
    seqlens_from_cu(cu, int(ids.numel()), max_len, "cu_seqlens")
    backbone: nn.Module = getattr(inner, str(getattr(inner, "base_model_prefix", "model")))
    zero: torch.Tensor | None = None
    for _ in range(zero_vision_passes):  # before the real passes: every rank all-gathers in one order
        part = zero_vision_pass(backbone)
        zero = part if zero is None else zero + part
    kwargs: dict[str, Any] = dict(
        use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len
    )
    if aux is not None:
        kwargs["output_router_logits"] = True
    if multimodal is None:
        out = backbone(
            input_ids=slice_for_rank(ids, group)[None],
            position_ids=slice_for_rank(pos, group)[None],
            **kwargs,
        )
    else:  # a Qwen-VL model: whole sequence in (image placeholders), split after the embedding
        rope = multimodal_position_ids(backbone, packed, multimodal)
        if sp > 1 and int(ids.numel()) > total:  # the sp padding: its own sequence, positions from 0
            tail = torch.arange(int(ids.numel()) - total, device=rope.device, dtype=rope.dtype)
            rope = torch.cat([rope, tail.view(1, 1, -1).expand(4, 1, -1)], dim=-1)
        out = _split_after_embedding(backbone, group, ids[None], rope, {**multimodal, **kwargs})
    hidden = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[0]
    if head == "value":
        score = value_head(inner)
        assert score is not None  # _head_of found it
        dropout = getattr(inner, "dropout", None)
        h = dropout(hidden) if isinstance(dropout, nn.Module) else hidden
        values = gather_seq(score(h).squeeze(-1).float(), group)[:total]
        return None, None, values if zero is None else values + zero.float(), None
    lm_head: nn.Linear = inner.get_output_embeddings()  # type: ignore[operator]
    labels = next_token_labels(ids, cu)
    if labels.numel() > total:  # the sp padding predicts nothing
        labels[total:] = IGNORE_INDEX
    labels = slice_for_rank(labels, group)

    def fused_head(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # a tuple of tensors, so hooks on lm_head (FSDP2) see the outputs they must hook for backward
        assert kernel is not None
        res = kernel(
            h,
            lm_head.weight,
            labels,
            temperature=temperature,
            with_entropy=with_entropy,
            softcap=final_softcap,
        )
        return res.log_probs, res.entropy

    lp_local, ent_local = _run_inside(lm_head, fused_head, hidden)
    cu_real = packed.cu_seqlens.to(device=ids.device)
    log_probs = shift_to_tokens(gather_seq(lp_local, group)[:total], cu_real)
    if zero is not None:
        log_probs = log_probs + zero.to(log_probs.dtype)
    entropy = None
    if with_entropy and ent_local is not None:
        entropy = shift_to_tokens(gather_seq(ent_local, group)[:total], cu_real)
    aux_loss = None if aux is None else _aux_loss(aux, out, group, total, type(inner).__name__)
    return log_probs, entropy, None, aux_loss


def _aux_loss(aux: _RouterAux, out: Any, group: Any | None, total: int, name: str) -> torch.Tensor:
    """``coef * load_balancing_loss`` over the micro-batch's ``total`` real tokens (router logits of
    every layer gathered over the sp group, its padding dropped), as transformers' causal-LM forward
    computes it for the same tokens; a 0-dim float tensor, differentiable."""
    logits = getattr(out, "router_logits", None)
    if not logits:
        raise ConfigError(
            f"packed_forward: {name} defines a router auxiliary loss but its backbone returned no "
            "router_logits for output_router_logits=True; this transformers version is not supported for it"
        )
    layers = [gather_seq(t.reshape(-1, t.shape[-1]), group)[:total] for t in logits]
    value = aux.fn(tuple(layers), aux.experts, aux.top_k, None)
    return torch.as_tensor(value, dtype=layers[0].dtype, device=layers[0].device) * aux.coef
