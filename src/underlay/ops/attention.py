"""Argument validation and mask helpers shared by every ``AttentionKernel``.

Every kernel enters through :func:`varlen_call` or :func:`padded_call` before it launches anything: one
validation of shapes, dtypes, devices, GQA, ``cu_seqlens``, window, scale, softcap and sinks, so that bad
input raises ``InvalidInput`` with the same message on every backend, returning the normalised
:class:`AttentionCall` (spec for ``supports``, resolved scale, per-sequence lengths) the kernel consumes.
:func:`attention_spec` builds the ``AttentionSpec`` a kernel's ``supports`` judges, and
:func:`allowed_mask` is the one definition of which keys a query may see (causal, window, alignment).

Alignment: when a sequence has ``S_q`` queries and ``S_k`` keys, query ``i`` sits at key position
``p = i + S_k - S_q`` (bottom-right alignment, as flash-attn). ``causal`` keeps keys ``j <= p``; a
window ``(left, right)`` keeps ``p - left <= j <= p + right`` (``-1`` = unbounded on that side).
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Literal

import torch

from underlay.interfaces import AttentionSpec, InvalidInput, UnsupportedOperation

__all__ = [
    "FLOAT_DTYPES",
    "AttentionCall",
    "allowed_mask",
    "attach_seqlens",
    "attention_spec",
    "check_options",
    "check_padded",
    "check_qkv",
    "check_sinks",
    "check_varlen",
    "effective_window",
    "normalize_window",
    "padded_call",
    "padded_key_mask",
    "require_supported",
    "seqlens_from_cu",
    "varlen_call",
]

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Dtypes any attention kernel may accept for q, k and v."""


def normalize_window(window: tuple[int, int] | None) -> tuple[int, int] | None:
    """Validate ``window = (left, right)`` and return it, or ``None`` for full attention.

    Each side is an int ``>= -1`` (``-1`` = unbounded); ``(-1, -1)`` normalises to ``None``.
    Raises ``InvalidInput`` for anything else.
    """
    if window is None:
        return None
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
    ):
        raise InvalidInput(
            f"attention: window={window!r} must be a pair (left, right) of ints >= -1 (-1 = unbounded), "
            "or None for full attention"
        )
    left, right = int(window[0]), int(window[1])
    if left == -1 and right == -1:
        return None
    return (left, right)


def effective_window(causal: bool, window: tuple[int, int] | None) -> tuple[int, int]:
    """The ``(left, right)`` band, ``-1`` = unbounded, that ``causal`` and ``window`` select together.

    Causal caps ``right`` at 0; this is the ``window_size`` flash-attn style kernels take.
    """
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    return (left, right)


def check_options(
    causal: bool, window: tuple[int, int] | None, scale: float | None, softcap: float | None
) -> tuple[int, int] | None:
    """Validate the scalar options of an attention call; returns the normalised window.

    ``causal`` must be a bool, ``scale`` ``None`` or a finite float ``> 0``, ``softcap`` ``None`` or a
    finite float ``> 0``. Raises ``InvalidInput``.
    """
    if not isinstance(causal, bool):
        raise InvalidInput(f"attention: causal={causal!r} must be a bool")
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise InvalidInput(f"attention: scale={scale!r} must be a finite number > 0, or None for D ** -0.5")
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        raise InvalidInput(f"attention: softcap={softcap!r} must be a finite number > 0, or None for no cap")
    return normalize_window(window)


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Validate attention-sink logits: ``None``, or a floating ``[Hq]`` tensor on q's device (``Hq``
    = q's head count). Raises ``InvalidInput``."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        raise InvalidInput(
            f"attention: sinks must be a floating torch.Tensor [Hq] or None, got {type(sinks).__name__}"
            + (f" of dtype {sinks.dtype}" if isinstance(sinks, torch.Tensor) else "")
        )
    hq = int(q.shape[-2])
    if tuple(sinks.shape) != (hq,):
        raise InvalidInput(
            f"attention: sinks has shape {tuple(sinks.shape)}; expected [Hq] = [{hq}] (one logit per query head)"
        )
    if sinks.device != q.device:
        raise InvalidInput(
            f"attention: sinks is on {sinks.device} but q is on {q.device}; move it to q's device"
        )


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Literal["varlen", "padded"]) -> None:
    """Check ranks, dtypes, devices and head counts of q, k, v.

    varlen: ``q [T_q, Hq, D]``, ``k [T_k, Hk, D]``, ``v [T_k, Hk, Dv]``; padded: ``q [B, S_q, Hq, D]``,
    ``k [B, S_k, Hk, D]``, ``v [B, S_k, Hk, Dv]``. One floating dtype (fp16/bf16/fp32/fp64) and one
    device for all three; ``Hq % Hk == 0``. Raises ``InvalidInput`` naming the bad tensor.
    """
    rank = 3 if layout == "varlen" else 4
    shape_txt = "[T, H, D]" if layout == "varlen" else "[B, S, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidInput(f"attention ({layout}): {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise InvalidInput(
                f"attention ({layout}): {name} has shape {tuple(t.shape)} (rank {t.dim()}); expected "
                f"rank {rank} {shape_txt}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise InvalidInput(
            f"attention ({layout}): dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}; cast them to one dtype"
        )
    if q.dtype not in FLOAT_DTYPES:
        raise InvalidInput(
            f"attention ({layout}): dtype {q.dtype} is not supported; use one of "
            f"{[str(d) for d in FLOAT_DTYPES]}"
        )
    if not (q.device == k.device == v.device):
        raise InvalidInput(
            f"attention ({layout}): devices differ: q {q.device}, k {k.device}, v {v.device}; move them "
            "to one device"
        )
    hq, hk, hv = q.shape[-2], k.shape[-2], v.shape[-2]
    if hk != hv:
        raise InvalidInput(f"attention ({layout}): k has {hk} heads but v has {hv}; they must match")
    if hk < 1 or hq % hk:
        raise InvalidInput(
            f"attention ({layout}): q heads {hq} must be a positive multiple of kv heads {hk} (GQA/MQA); "
            "fix the head counts of q, k and v"
        )
    if q.shape[-1] != k.shape[-1] or q.shape[-1] < 1:
        raise InvalidInput(
            f"attention ({layout}): q head_dim {q.shape[-1]} and k head_dim {k.shape[-1]} must be equal "
            "and >= 1"
        )
    if v.shape[-1] < 1:
        raise InvalidInput(f"attention ({layout}): v head_dim {v.shape[-1]} must be >= 1")
    if k.shape[:-2] != v.shape[:-2]:
        raise InvalidInput(
            f"attention ({layout}): k {tuple(k.shape)} and v {tuple(v.shape)} must have the same leading "
            "(token) dimensions"
        )
    if layout == "padded" and q.shape[0] != k.shape[0]:
        raise InvalidInput(
            f"attention (padded): batch sizes differ: q {q.shape[0]}, k {k.shape[0]}; they must match"
        )


def seqlens_from_cu(cu_seqlens: torch.Tensor, total: int, max_seqlen: int, name: str) -> list[int]:
    """Validate one ``cu_seqlens`` and return the per-sequence lengths (host ints).

    ``cu_seqlens`` must be a 1-D int32 tensor ``[B + 1]`` (``B >= 1``) starting at 0, non-decreasing,
    ending at ``total``; ``max_seqlen`` an int ``>=`` the longest length. Reads the tensor on the host
    (one device sync) the first time it sees this tensor object: the lengths are kept on the tensor
    itself (until it is modified in place), so the decoder layers of one packed forward, which all pass
    the same ``cu_seqlens``, sync once rather than once per layer. Raises ``InvalidInput``.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise InvalidInput(
            f"attention (varlen): {name} must be a torch.Tensor, got {type(cu_seqlens).__name__}"
        )
    if cu_seqlens.dtype != torch.int32:
        raise InvalidInput(
            f"attention (varlen): {name} has dtype {cu_seqlens.dtype}; it must be torch.int32 "
            f"(use {name}.to(torch.int32))"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise InvalidInput(
            f"attention (varlen): {name} has shape {tuple(cu_seqlens.shape)}; it must be 1-D [B + 1] with B >= 1"
        )
    known = getattr(cu_seqlens, _LENGTHS_ATTR, None)
    if known is not None and known[0] == cu_seqlens._version and known[1] == total:
        lens = list(known[2])
    else:
        lens = _read_lengths(cu_seqlens, total, name)
        setattr(cu_seqlens, _LENGTHS_ATTR, (cu_seqlens._version, total, tuple(lens)))
    _check_max_seqlen(max_seqlen, lens, name)
    return lens


def attach_seqlens(cu_seqlens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Record the host-known per-sequence ``lengths`` of ``cu_seqlens`` on the tensor (as
    ``seqlens_from_cu`` caches them after reading it), so the varlen checks read no device values.
    For a caller that built ``cu_seqlens`` from ``lengths`` on the host and copied it to the device
    (the mcore engine's packed micro-batches): the lengths must be the tensor's (they are trusted,
    not re-read). ``InvalidInput`` for a negative length. Returns ``cu_seqlens``."""
    if any(n < 0 for n in lengths):
        raise InvalidInput(f"attach_seqlens: lengths {lengths[:8]} must be >= 0")
    setattr(cu_seqlens, _LENGTHS_ATTR, (cu_seqlens._version, sum(lengths), tuple(int(n) for n in lengths)))
    return cu_seqlens


_LENGTHS_ATTR = "_underlay_lengths"
"""Attribute of a ``cu_seqlens`` tensor holding ``(version, total, lengths)`` once it was read and
validated on the host: the cache belongs to the tensor the caller owns (``packed_forward`` builds one per
forward and every decoder layer, and any recomputation in backward, passes that same object), so there
is no process-wide state and it dies with the tensor."""


def _read_lengths(cu_seqlens: torch.Tensor, total: int, name: str) -> list[int]:
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise InvalidInput(f"attention (varlen): {name} starts at {cu[0]}; it must start at 0")
    lens = [b - a for a, b in itertools.pairwise(cu)]
    if any(n < 0 for n in lens):
        bad = next(i for i, n in enumerate(lens) if n < 0)
        raise InvalidInput(
            f"attention (varlen): {name} is not monotonic: entry {bad + 1} ({cu[bad + 1]}) < entry {bad} "
            f"({cu[bad]}); cumulative lengths must be non-decreasing"
        )
    if cu[-1] != total:
        raise InvalidInput(
            f"attention (varlen): {name} ends at {cu[-1]} but the tensor has {total} tokens; the last entry "
            "must equal the token count"
        )
    return lens


def _check_max_seqlen(max_seqlen: int, lens: list[int], name: str) -> None:
    try:
        if isinstance(max_seqlen, bool):
            raise TypeError
        value = operator.index(max_seqlen)
    except TypeError:
        raise InvalidInput(
            f"attention (varlen): max_seqlen for {name} must be an int, got {max_seqlen!r}"
        ) from None
    longest = max(lens)
    if value < longest:
        raise InvalidInput(
            f"attention (varlen): max_seqlen {value} is smaller than the longest sequence {longest} "
            f"in {name}; pass max_seqlen >= {longest}"
        )


def check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> tuple[list[int], list[int]]:
    """Validate a packed (THD) attention call; returns ``(lengths_q, lengths_k)`` per sequence.

    Checks :func:`check_qkv` for the varlen layout, both ``cu_seqlens`` (:func:`seqlens_from_cu`),
    that they have the same number of sequences, and that they live on q's device (or the cpu).
    Raises ``InvalidInput`` before anything is launched.
    """
    check_qkv(q, k, v, "varlen")
    lens_q = seqlens_from_cu(cu_seqlens_q, int(q.shape[0]), max_seqlen_q, "cu_seqlens_q")
    if cu_seqlens_k is cu_seqlens_q and k.shape[0] == q.shape[0]:
        lens_k = lens_q
        _check_max_seqlen(max_seqlen_k, lens_k, "cu_seqlens_k")
    else:
        lens_k = seqlens_from_cu(cu_seqlens_k, int(k.shape[0]), max_seqlen_k, "cu_seqlens_k")
    if len(lens_q) != len(lens_k):
        raise InvalidInput(
            f"attention (varlen): cu_seqlens_q has {len(lens_q)} sequences but cu_seqlens_k has {len(lens_k)}; "
            "they must describe the same batch"
        )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.device != q.device and cu.device.type != "cpu":
            raise InvalidInput(
                f"attention (varlen): {name} is on {cu.device} but q is on {q.device}; move it to q's device"
            )
    return lens_q, lens_k


def check_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None
) -> None:
    """Validate a padded ``[B, S, H, D]`` attention call.

    ``attention_mask``, when given, is ``[B, S_k]`` of bool or an integer dtype holding 0/1 (1 = keep),
    on q's device. Raises ``InvalidInput``.
    """
    check_qkv(q, k, v, "padded")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise InvalidInput(
            f"attention (padded): attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}"
        )
    b, sk = int(k.shape[0]), int(k.shape[1])
    if tuple(attention_mask.shape) != (b, sk):
        raise InvalidInput(
            f"attention (padded): attention_mask has shape {tuple(attention_mask.shape)}; expected [B, S_k] = "
            f"{[b, sk]}"
        )
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise InvalidInput(
            f"attention (padded): attention_mask dtype {attention_mask.dtype} must be bool or an integer "
            "dtype holding 0/1 (1 = keep)"
        )
    if attention_mask.device != q.device:
        raise InvalidInput(
            f"attention (padded): attention_mask is on {attention_mask.device} but q is on {q.device}"
        )


def attention_spec(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Literal["varlen", "padded"] = "varlen",
    causal: bool = True,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> AttentionSpec:
    """The ``AttentionSpec`` of a call on these tensors (validates them with :func:`check_qkv` and
    :func:`check_sinks`).

    ``requires_grad`` is true when any of q, k, v (or ``sinks``) requires grad; ``window`` is normalised
    (``(-1, -1)`` -> ``None``). Raises ``InvalidInput``.
    """
    if layout not in ("varlen", "padded"):
        raise InvalidInput(f"attention: layout={layout!r}; use 'varlen' or 'padded'")
    check_qkv(q, k, v, layout)
    window = check_options(causal, window, None, softcap)
    check_sinks(sinks, q)
    grad = q.requires_grad or k.requires_grad or v.requires_grad
    return AttentionSpec(
        dtype=q.dtype,
        head_dim=int(q.shape[-1]),
        num_heads=int(q.shape[-2]),
        num_kv_heads=int(k.shape[-2]),
        device_type=q.device.type,
        layout=layout,
        causal=causal,
        window=window,
        softcap=softcap,
        head_dim_v=int(v.shape[-1]),
        requires_grad=grad or (sinks is not None and sinks.requires_grad),
        sinks=sinks is not None,
    )


def allowed_mask(
    s_q: int, s_k: int, causal: bool, window: tuple[int, int] | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean ``[s_q, s_k]`` mask (True = query may attend key) for one sequence, or ``None`` when
    every key is visible. Bottom-right aligned: query ``i`` sits at key position ``i + s_k - s_q``."""
    left, right = effective_window(causal, window)
    if left < 0 and right < 0:
        return None
    pos = torch.arange(s_q, device=device).unsqueeze(1) + (s_k - s_q)
    key = torch.arange(s_k, device=device).unsqueeze(0)
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= key >= pos - left
    if right >= 0:
        keep &= key <= pos + right
    return keep


def padded_key_mask(
    attention_mask: torch.Tensor | None,
    s_q: int,
    s_k: int,
    causal: bool,
    window: tuple[int, int] | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean mask broadcastable to ``[B, H, s_q, s_k]`` combining the padding mask ``[B, s_k]``
    (nonzero = keep) with :func:`allowed_mask`; ``None`` when nothing is masked."""
    band = allowed_mask(s_q, s_k, causal, window, device)
    if attention_mask is None:
        return None if band is None else band.view(1, 1, s_q, s_k)
    keys = (attention_mask != 0).view(attention_mask.shape[0], 1, 1, s_k)
    return keys if band is None else keys & band.view(1, 1, s_q, s_k)


def require_supported(kernel: str, reasons: tuple[str, ...], alternatives: str) -> None:
    """Raise ``UnsupportedOperation`` when ``reasons`` (from ``kernel.supports(spec)``) is non-empty,
    naming the kernel, each reason and the kernels to use instead (``alternatives``)."""
    if reasons:
        raise UnsupportedOperation(
            f"attention backend {kernel!r} cannot run this call: {'; '.join(reasons)}. Use "
            f"get_attention(spec=...) to pick a kernel that can, or UNDERLAY_ATTENTION={alternatives}"
        )


@dataclass(frozen=True)
class AttentionCall:
    """One validated attention call, normalised; what every kernel consumes.

    ``spec``: the call's ``AttentionSpec`` (for ``supports``); ``window``: normalised (``None`` = full);
    ``scale``: resolved (``D ** -0.5`` when the caller passed ``None``); ``softcap`` / ``sinks``: as given;
    ``lens_q`` / ``lens_k``: per-sequence lengths on the host (varlen; empty for padded).
    """

    spec: AttentionSpec
    causal: bool
    window: tuple[int, int] | None
    scale: float
    softcap: float | None
    sinks: torch.Tensor | None
    lens_q: tuple[int, ...] = ()
    lens_k: tuple[int, ...] = ()


def _call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Literal["varlen", "padded"],
    causal: bool,
    window: tuple[int, int] | None,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    lens: tuple[list[int], list[int]] | None,
) -> AttentionCall:
    window = check_options(causal, window, scale, softcap)
    spec = attention_spec(q, k, v, layout, causal, window, softcap, sinks)
    return AttentionCall(
        spec=spec,
        causal=causal,
        window=window,
        scale=float(scale) if scale is not None else float(q.shape[-1]) ** -0.5,
        softcap=softcap,
        sinks=sinks,
        lens_q=tuple(lens[0]) if lens else (),
        lens_k=tuple(lens[1]) if lens else (),
    )


def varlen_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> AttentionCall:
    """The validated entry of every kernel's ``varlen``: :func:`check_varlen` (shapes, dtypes, GQA, both
    ``cu_seqlens`` — read on the host once per tensor, see :func:`seqlens_from_cu`), the options
    (:func:`check_options`) and the sinks (:func:`check_sinks`). Raises ``InvalidInput``."""
    lens = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _call(q, k, v, "varlen", causal, window, scale, softcap, sinks, lens)


def padded_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> AttentionCall:
    """The validated entry of every kernel's ``padded``: :func:`check_padded`, the options and the sinks.
    Raises ``InvalidInput``."""
    check_padded(q, k, v, attention_mask)
    return _call(q, k, v, "padded", causal, window, scale, softcap, sinks, None)
