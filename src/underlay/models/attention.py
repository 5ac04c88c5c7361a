"""Routing Hugging Face attention to underlay's AttentionKernel through transformers' AttentionInterface.

:func:`register_attention` registers :func:`underlay_attention_forward` under the implementation name
``"underlay"`` (``transformers.AttentionInterface``) together with a mask builder
(``transformers.masking_utils.AttentionMaskInterface``) that hands the attention function the raw 2-D
padding mask (or ``None``), as flash-attention does. A model whose ``config._attn_implementation`` is
``"underlay"`` then calls :func:`underlay_attention_forward` in every attention layer, which:

- on **packed** input (batch 1, no padding mask, position ids restarting at 0 for every sequence, or
  explicit ``cu_seq_lens_q``/``max_length_q`` keyword arguments as transformers' flash path uses)
  calls ``kernel.varlen`` with the sequence boundaries;
- otherwise calls ``kernel.padded`` with the ``[B, S]`` keep-mask;
- under Ulysses sequence parallelism (the route's ``sp_group`` has more than one rank) trades the local
  token slice for a head slice around ``kernel.varlen`` (:mod:`underlay.parallel.ulysses`).

The per-layer settings (kernel name, sp group) live in an :class:`AttentionRoute` attached to each
attention module by :func:`underlay.models.prepare_model`; every per-layer attention property comes
from what the layer passes to the attention function, never from the module's attributes (a module may
carry ``sliding_window`` on a full-attention layer, or ``attn_logit_softcapping`` that its forward does
not apply, as transformers' own attention functions ignore them too): ``scaling`` (``None``:
``1/sqrt(head_dim)``), ``sliding_window`` (``None``: full attention), ``softcap`` (``None``: none),
``s_aux`` (attention sinks) and ``is_causal`` (absent: causal; a module declaring ``is_causal=False``
without passing it is refused with ``ConfigError``).

Vision towers use a second name, :data:`VARLEN_ATTN_IMPLEMENTATION`, for the same function: transformers'
Qwen-VL vision attention hands all windows and images of a forward pass to the attention function in
one varlen call (``cu_seq_lens_q``) only when the implementation's name contains ``"flash"``; under any
other name it splits the patches on the host and calls the function once per window, which is hundreds
of small kernel launches and a device sync per vision block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from underlay.interfaces import (
    AttentionKernel,
    AttentionSpec,
    BackendUnavailable,
    ConfigError,
    InvalidInput,
    UnsupportedOperation,
)
from underlay.parallel.ulysses import (
    gather_seq,
    head_to_seq,
    repeat_kv_for_sp,
    seq_to_head,
    slice_for_rank,
    sp_world_size,
    validate_sp,
)
from underlay.registry import backends, get_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ROUTE_ATTR",
    "SHARED_PROMPTS_KWARG",
    "VARLEN_ATTN_IMPLEMENTATION",
    "AttentionRoute",
    "cu_seqlens_from_position_ids",
    "register_attention",
    "underlay_attention_forward",
]

ATTN_IMPLEMENTATION = "underlay"
"""The name registered with ``transformers.AttentionInterface``."""

VARLEN_ATTN_IMPLEMENTATION = "underlay_flash_varlen"
"""The same function under a name that makes transformers' vision attention pass its patches packed, with
their boundaries (transformers tests ``"flash" in name``; see the module docstring). Only the vision towers'
configs use it: a text model keeps :data:`ATTN_IMPLEMENTATION`, so no flash-attention-only code path of
transformers runs there."""

ROUTE_ATTR = "_underlay_attention_route"
"""Attribute of an attention module that holds its :class:`AttentionRoute`."""

SHARED_PROMPTS_KWARG = "underlay_shared_prompts"
"""Keyword argument (passed to the backbone, forwarded by transformers to every attention call) that
carries an ``ops.prompt_sharing.SharedPrompts`` layout: the attention of that call is
``ops.shared_prefix_attention`` over the shared-prompt stream."""


@dataclass
class AttentionRoute:
    """Where one attention module sends its calls.

    ``kernel_name`` is an attention backend name (``None``: the registry's selection, i.e.
    ``UNDERLAY_ATTENTION`` or ``auto``), resolved lazily per :class:`AttentionSpec` and cached.
    ``sp_group`` is the Ulysses process group (``None``: no sequence parallelism). ``given`` is a kernel
    built by the caller (``ModelConfig.attention`` as an object): every call uses it and ``kernel_name``
    is ignored.
    """

    kernel_name: str | None = None
    sp_group: Any | None = None
    given: AttentionKernel | None = None
    _kernels: dict[AttentionSpec, AttentionKernel] = field(default_factory=dict, repr=False)
    _cu_cache: tuple[torch.Tensor, torch.Tensor, int] | None = field(default=None, repr=False)
    _traceable: dict[tuple[Any, ...], Callable[..., torch.Tensor]] = field(default_factory=dict, repr=False)
    _pending: dict[tuple[Any, ...], Callable[..., torch.Tensor]] = field(default_factory=dict, repr=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> AttentionRoute:
        # a copied model shares the process group and kernels (neither can be copied); caches reset
        return AttentionRoute(self.kernel_name, self.sp_group, self.given)

    def kernel(self, spec: AttentionSpec) -> AttentionKernel:
        """The kernel for ``spec`` (``BackendUnavailable`` when the named or given kernel cannot run it)."""
        found = self._kernels.get(spec)
        if found is None:
            if self.given is None:
                found = get_attention(self.kernel_name, spec=spec)
            elif reasons := self.given.supports(spec):
                raise BackendUnavailable(
                    "attention",
                    self.given.name,
                    f"the kernel given as ModelConfig.attention ({type(self.given).__name__}) cannot run "
                    f"{spec}: {'; '.join(reasons)}",
                    [b.name for b in backends("attention")],
                    "give a kernel that supports this case, or a registry name / None to select one",
                )
            else:
                found = self.given
            self._kernels[spec] = found
        return found

    def traceable(self, key: tuple[Any, ...]) -> Callable[..., torch.Tensor] | None:
        """The in-graph varlen call for the case ``key`` (see :func:`_trace_key`) once an eager call
        has resolved its kernel and the kernel offers one (``traceable_varlen``); else ``None``."""
        return self._traceable.get(key)

    def remember_traceable(self, spec: AttentionSpec, kernel: AttentionKernel) -> None:
        """After an eager call: note the kernel's traceable varlen function for ``spec``, if it has one.
        It is used from the next :meth:`activate_traceable` on, so that one forward pass, and its
        recomputation under activation checkpointing, takes the same path throughout."""
        key = _trace_key(spec)
        if key in self._traceable or key in self._pending:
            return
        offer = getattr(kernel, "traceable_varlen", None)
        fn = offer(spec) if callable(offer) else None
        if fn is not None:
            self._pending[key] = fn

    def activate_traceable(self) -> None:
        """Make the noted traceable calls available to compiled graphs (``packed_forward`` calls this
        before each forward pass; nothing changes when nothing new was noted)."""
        if self._pending:
            self._traceable.update(self._pending)
            self._pending.clear()

    def traceable_count(self) -> int:
        """How many kernel calls compiled graphs may trace now (0 until the first :meth:`activate_traceable`
        that had something to add; Ulysses routes stay at 0). Code compiled by ``torch.compile`` that
        reads it is guarded on the value, so it recompiles when a call becomes traceable."""
        return len(self._traceable)

    def boundaries(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(cu_seqlens int32 [B + 1], max_seqlen)`` of the (full, gathered over the sp group) packed
        sequence whose per-token positions are ``position_ids``; cached for the last tensor seen, so a
        forward pass computes it once rather than once per layer."""
        cached = self._cu_cache
        if cached is not None and cached[0] is position_ids:
            return cached[1], cached[2]
        pos = position_ids.reshape(-1)
        if sp_world_size(self.sp_group) > 1:
            with torch.no_grad():
                pos = gather_seq(pos, self.sp_group)
        cu, max_len = cu_seqlens_from_position_ids(pos)
        self._cu_cache = (position_ids, cu, max_len)
        return cu, max_len


def _trace_key(spec: AttentionSpec) -> tuple[Any, ...]:
    """The fields of a varlen ``AttentionSpec`` as a plain tuple (torch.compile guards on it cheaply;
    :func:`underlay_attention_forward` builds the same tuple from the tensors in traced code)."""
    return (
        spec.dtype,
        spec.head_dim,
        spec.num_heads,
        spec.num_kv_heads,
        spec.device_type,
        spec.causal,
        spec.window,
        spec.softcap,
        spec.head_dim_v,
        spec.requires_grad,
        spec.sinks,
    )


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sequence boundaries of packed tokens: a sequence starts at token 0 and wherever the position id
    is 0. ``position_ids`` ``[T]`` (or ``[1, T]``) int -> ``(cu_seqlens int32 [B + 1], max_seqlen)``.
    Synchronises with the device (reads the lengths)."""
    pos = position_ids.reshape(-1)
    n = int(pos.numel())
    if n == 0:
        raise InvalidInput("cu_seqlens_from_position_ids: position_ids is empty")
    first = torch.zeros_like(pos, dtype=torch.bool)
    first[0] = True
    starts = torch.nonzero((pos == 0) | first).reshape(-1)
    cu = torch.cat([starts, starts.new_tensor([n])]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max().item())
    return cu, max_len


def _window(sliding_window: int | None, causal: bool) -> tuple[int, int] | None:
    # transformers: key j is visible from query i when i - j < sliding_window (and j <= i if causal)
    if sliding_window is None or sliding_window <= 0:
        return None
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _causal(module: nn.Module, given: Any) -> bool:
    """Whether this call is causal: the ``is_causal`` keyword the layer passed, else ``True`` (every layer
    of a decoder-only model). A module that declares itself non-causal (``module.is_causal is False``)
    without passing ``is_causal`` is refused: its mask would come from the model's mask function, which
    the kernel does not read, so guessing either way could be silently wrong."""
    if given is not None:
        return bool(given)
    if getattr(module, "is_causal", True) is False:
        raise ConfigError(
            f"{type(module).__name__} declares is_causal=False but its forward passes no is_causal to the "
            "attention function; underlay routes only causal decoder attention (bidirectional layers are "
            "not supported)"
        )
    return True


def underlay_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for ``attn_implementation="underlay"``.

    ``query [B, Hq, S, D]``, ``key``/``value [B, Hk, S, D]`` (transformers' layout, after RoPE);
    ``attention_mask`` a ``[B, S]`` keep-mask or ``None`` (see the module docstring); ``s_aux`` (keyword,
    gpt-oss) per-head attention-sink logits ``[Hq]``, passed to the kernel as ``sinks``. Returns
    ``(out [B, S, Hq, Dv], None)`` in the dtype of ``query``; attention weights are never built.
    Raises ``UnsupportedOperation`` for attention dropout > 0, 4-D custom masks, and Ulysses on padded
    input; ``BackendUnavailable`` when the routed kernel cannot run the case.
    """
    route: AttentionRoute = getattr(module, ROUTE_ATTR, None) or _DEFAULT_ROUTE
    if dropout and dropout > 0:
        raise UnsupportedOperation(
            f"attention dropout={dropout} is not supported by the underlay attention route; set "
            "config.attention_dropout=0 (RL training runs without attention dropout)"
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise UnsupportedOperation(
            f"underlay attention got a {attention_mask.dim()}-D attention mask of shape "
            f"{tuple(attention_mask.shape)}; pass a [batch, seq] padding mask or packed position ids"
        )
    causal = _causal(module, kwargs.pop("is_causal", None))
    scale = scaling  # None: 1/sqrt(head_dim), as transformers' sdpa and flash functions
    window = _window(sliding_window, causal)
    sinks = kwargs.pop("s_aux", None)
    shared = kwargs.pop(SHARED_PROMPTS_KWARG, None)
    if shared is not None:
        return _shared_attention(
            module, route, shared, query, key, value, attention_mask, causal, window, scale, softcap, sinks
        ), None
    # (no int() of the sequence dimension: under torch.compile it would specialise on the length)
    bsz, hq, dim = int(query.shape[0]), int(query.shape[1]), int(query.shape[3])
    hk, dim_v = int(key.shape[1]), int(value.shape[-1])
    sp = sp_world_size(route.sp_group)
    cu_q = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    packed = bsz == 1 and attention_mask is None and (cu_q is not None or position_ids is not None)
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value, sinks) if t is not None
    )

    if not packed:
        if sp > 1:
            raise UnsupportedOperation(
                f"Ulysses sequence parallelism (sp={sp}) needs packed input (batch 1, no attention_mask, "
                "position ids restarting per sequence); got a padded batch. Use underlay.models.packed_forward"
            )
        spec = AttentionSpec(
            query.dtype,
            dim,
            hq,
            hk,
            query.device.type,
            "padded",
            causal,
            window,
            softcap,
            dim_v,
            needs_grad,
            sinks is not None,
        )
        out = route.kernel(spec).padded(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attention_mask=attention_mask,
            causal=causal,
            window=window,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
        )
        return out, None

    # [S, H, D], contiguous as varlen kernels expect (transformers' own flash varlen path copies too; under
    # torch.compile the copy fuses with RoPE; under sp the all-to-all makes it)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if sp == 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        max_length = kwargs.get("max_length_q")
        if torch.compiler.is_compiling() and cu_q is not None and max_length:
            # inside a compiled graph: the kernel call is traced too (no graph break), with boundaries
            # packed_forward validated; an eager call of this layer has resolved the kernel
            key_ = (
                query.dtype,
                dim,
                hq,
                hk,
                query.device.type,
                causal,
                window,
                softcap,
                dim_v,
                needs_grad,
                sinks is not None,
            )
            traced = route.traceable(key_)
            if traced is not None:
                return traced(q, k, v, cu_q, max_length, causal, window, scale).unsqueeze(0), None
    out = _packed_attention(
        route,
        q,
        k,
        v,
        cu_q,
        kwargs.get("max_length_q"),
        position_ids,
        causal,
        window,
        scale,
        softcap,
        sinks,
        needs_grad,
    )
    return out.unsqueeze(0), None


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _packed_attention(
    route: AttentionRoute,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor | None,
    max_length: int | None,
    position_ids: torch.Tensor | None,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    needs_grad: bool,
) -> torch.Tensor:
    """The packed kernel call ``[S, Hq, D] -> [S, Hq, Dv]``. Always eager, also inside a compiled
    region (a graph break): it reads the sequence boundaries on the host, selects the kernel and runs the
    Ulysses all-to-alls, and traced it would specialise the graph on every new token count."""
    if cu_q is not None:
        cu = cu_q
        max_len = int(max_length or int((cu[1:] - cu[:-1]).max().item()))
    else:
        cu, max_len = route.boundaries(position_ids)  # type: ignore[arg-type]
    sp = sp_world_size(route.sp_group)
    if sp > 1:
        validate_sp(int(q.shape[1]), int(k.shape[1]), sp)
        k, v = repeat_kv_for_sp(k, sp), repeat_kv_for_sp(v, sp)
        q, k, v = (seq_to_head(t, route.sp_group) for t in (q, k, v))
        if sinks is not None:  # this rank's contiguous head slice (seq_to_head's head order)
            sinks = slice_for_rank(sinks, route.sp_group)
    spec = AttentionSpec(
        q.dtype,
        int(q.shape[-1]),
        int(q.shape[1]),
        int(k.shape[1]),
        q.device.type,
        "varlen",
        causal,
        window,
        softcap,
        int(v.shape[-1]),
        needs_grad,
        sinks is not None,
    )
    total = int(q.shape[0])
    if cu.device.type == "cpu" and int(cu[-1]) != total:  # (no per-layer device sync on accelerators)
        raise InvalidInput(
            f"underlay attention: cu_seqlens ends at {int(cu[-1])} but the packed input has {total} tokens "
            f"(over sp={sp} ranks); pass the boundaries of the whole packed sequence"
        )
    kernel = route.kernel(spec)
    options: dict[str, Any] = {"causal": causal, "window": window, "scale": scale, "softcap": softcap}
    if sinks is not None:  # (only then: kernels predating sinks keep working)
        options["sinks"] = sinks
    out = kernel.varlen(q, k, v, cu, cu, max_len, max_len, **options)
    if sp == 1 and cu_q is not None:
        route.remember_traceable(spec, kernel)
    return head_to_seq(out, route.sp_group) if sp > 1 else out


_DEFAULT_ROUTE = AttentionRoute()


def _shared_attention(
    module: nn.Module,
    route: AttentionRoute,
    shared: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one layer over a shared-prompt stream (``ops.shared_prefix_attention``):
    ``[1, H, T', D]`` inputs -> ``[1, T', Hq, Dv]``. ``UnsupportedOperation`` naming the layer's
    property that the shared layout cannot reproduce exactly (non-causal, logit softcap, attention
    sinks, Ulysses, a padded batch)."""
    from underlay.ops.prompt_sharing import shared_prefix_attention

    name = type(module).__name__
    problems = [
        what
        for what, bad in (
            (
                "a padded batch (shared prompts need the packed stream)",
                attention_mask is not None or query.shape[0] != 1,
            ),
            ("non-causal attention", not causal),
            (f"attention logit softcapping ({softcap})", softcap is not None),
            ("attention sinks (s_aux)", sinks is not None),
            (
                f"Ulysses sequence parallelism (sp={sp_world_size(route.sp_group)})",
                sp_world_size(route.sp_group) > 1,
            ),
        )
        if bad
    ]
    if problems:
        raise UnsupportedOperation(
            f"shared-prompt attention in {name}: {', '.join(problems)} is not supported; run this batch "
            "without TokenBatch.prompt_groups"
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out: torch.Tensor = shared_prefix_attention(q, k, v, shared, scale=scale, window=window)
    shared.calls.value += 1
    return out.unsqueeze(0)


def _padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers mask builder for ``"underlay"``: the ``[B, kv_length]`` bool keep-mask, or ``None``
    when nothing is padded (causality, windows and packing are the kernel's job)."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def register_attention() -> None:
    """Register ``"underlay"`` and :data:`VARLEN_ATTN_IMPLEMENTATION` with transformers' attention and
    mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in (ATTN_IMPLEMENTATION, VARLEN_ATTN_IMPLEMENTATION):
        AttentionInterface.register(name, underlay_attention_forward)
        AttentionMaskInterface.register(name, _padding_mask)
