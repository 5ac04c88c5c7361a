"""Forward of a shared-prompt packing (``ops.prompt_sharing``): :func:`shared_prompt_forward`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from underlay.interfaces import ConfigError, InvalidInput, LogprobKernel, TokenOutputs
from underlay.models._compat import capabilities, unwrap_model
from underlay.models.attention import ATTN_IMPLEMENTATION, SHARED_PROMPTS_KWARG
from underlay.models.forward import _head_of, _router_aux, _routes, _run_inside, value_head
from underlay.models.rope import length_dependent_rope
from underlay.ops.prompt_sharing import SharedPrompts
from underlay.registry import get_logprob_kernel

__all__ = ["check_shared_prompts", "shared_prompt_forward"]


def check_shared_prompts(model: nn.Module) -> None:
    """``ConfigError`` naming why ``model`` (prepared) cannot compute shared prompts exactly: a
    vision-language model (3-D positions from the whole sequence), a length-dependent rotary embedding
    (``dynamic``/``longrope``: its frequencies follow each sequence's length), a router auxiliary loss
    (it counts every token: a shared prompt counts once), or a model not prepared for underlay.
    Per-layer properties (softcapped or non-causal attention, sinks) are refused by the attention call."""
    inner = unwrap_model(model)
    caps = capabilities(inner)
    name = type(inner).__name__
    if not _routes(inner) or getattr(inner.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        raise ConfigError(f"shared prompts: {name} is not prepared; call underlay.models.prepare_model first")
    if caps.multimodal_rope:
        raise ConfigError(
            f"shared prompts: {name} is a vision-language model (3-D rotary positions of the whole "
            "sequence); run its batches without TokenBatch.prompt_groups"
        )
    if any(length_dependent_rope(m) for m in inner.modules()):
        raise ConfigError(
            f"shared prompts: {name} has a length-dependent rotary embedding (dynamic/longrope), whose "
            "frequencies follow each sequence's own length; run its batches without TokenBatch.prompt_groups"
        )
    head = _head_of(inner)
    if _router_aux(inner, head) is not None:
        raise ConfigError(
            f"shared prompts: {name} returns a router auxiliary (load-balancing) loss over every token, "
            "which counts a shared prompt once instead of once per response; run its batches without "
            "TokenBatch.prompt_groups"
        )


def shared_prompt_forward(
    model: nn.Module,
    shared: SharedPrompts,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    logprob_kernel: LogprobKernel | None = None,
) -> TokenOutputs:
    """:func:`underlay.models.packed_forward` of the unshared packing ``shared.packed``, computed on the
    shared stream: each group's common prefix runs once. Returns the same fields as ``packed_forward``
    (fp32 ``[T]`` in the unshared token order: ``ops.pad(x, shared.packed)`` gives ``[B, S]``): the
    log-prob of a prefix token is computed once and handed to every row of its group (its gradient sums
    over them), the last prefix position's hidden state scores each row's first response token.
    ``aux_loss`` is ``None``. ``ConfigError`` for models :func:`check_shared_prompts` refuses or whose
    layers do not pass the layout through to their attention calls; ``UnsupportedOperation`` from a
    layer whose attention cannot run on the layout; ``InvalidInput`` for ``temperature <= 0``."""
    if not temperature > 0:
        raise InvalidInput(f"shared_prompt_forward: temperature={temperature} must be > 0")
    check_shared_prompts(model)
    inner = unwrap_model(model)
    head = _head_of(inner)
    kernel = None
    if head == "lm":
        kernel = logprob_kernel if logprob_kernel is not None else get_logprob_kernel()
    for route in _routes(inner):
        route.activate_traceable()
    softcap = capabilities(inner).final_logit_softcap
    return _run_inside(  # type: ignore[no-any-return]
        model,
        lambda _ids: _body(inner, head, kernel, softcap, shared, temperature, with_entropy),
        shared.input_ids,
    )


def _body(
    inner: nn.Module,
    head: str,
    kernel: LogprobKernel | None,
    softcap: float | None,
    shared: SharedPrompts,
    temperature: float,
    with_entropy: bool,
) -> TokenOutputs:
    backbone: nn.Module = getattr(inner, str(getattr(inner, "base_model_prefix", "model")))
    before = shared.calls.value
    kwargs: dict[str, Any] = {"use_cache": False, SHARED_PROMPTS_KWARG: shared}
    out = backbone(input_ids=shared.input_ids[None], position_ids=shared.position_ids[None], **kwargs)
    layers = len(_routes(inner))
    if shared.calls.value - before < layers:
        raise ConfigError(
            f"shared prompts: {type(inner).__name__}'s layers passed the shared layout to "
            f"{shared.calls.value - before} of {layers} attention calls (its forward drops extra keyword "
            "arguments); run its batches without TokenBatch.prompt_groups"
        )
    hidden = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[0]
    if head == "value":
        score = value_head(inner)
        assert score is not None  # _head_of found it
        dropout = getattr(inner, "dropout", None)
        h = dropout(hidden) if isinstance(dropout, nn.Module) else hidden
        values = score(h).squeeze(-1).float()
        return TokenOutputs(None, None, values[shared.token_src], None)
    lm_head: nn.Linear = inner.get_output_embeddings()  # type: ignore[operator]

    def fused_head(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert kernel is not None
        res = kernel(
            h,
            lm_head.weight,
            shared.pred_label,
            temperature=temperature,
            with_entropy=with_entropy,
            softcap=softcap,
        )
        return res.log_probs, res.entropy

    lp, ent = _run_inside(lm_head, fused_head, hidden[shared.pred_src])
    scored = shared.token_pred >= 0
    at = shared.token_pred.clamp(min=0)

    def spread(x: torch.Tensor) -> torch.Tensor:
        return torch.where(scored, x[at], torch.zeros((), dtype=x.dtype, device=x.device))

    entropy = spread(ent) if with_entropy and ent is not None else None
    return TokenOutputs(spread(lp), entropy, None, None)
