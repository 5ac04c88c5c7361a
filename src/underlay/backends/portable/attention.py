"""Portable attention kernels in plain torch: ``eager`` (the fp32 reference) and ``torch`` (SDPA and
``torch.nn.attention.varlen.varlen_attn``).

Both follow the ``AttentionKernel`` contract of ``underlay.interfaces.kernels`` and the masking rules of
``underlay.ops.attention`` (bottom-right aligned causal mask and window).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from typing import Any, cast

import torch
import torch.nn.functional as F

from underlay.interfaces import AttentionSpec, ConfigError, Device
from underlay.ops.attention import (
    FLOAT_DTYPES,
    allowed_mask,
    effective_window,
    padded_call,
    padded_key_mask,
    require_supported,
    varlen_call,
)

__all__ = ["EagerAttention", "TorchAttention", "dense_causal", "eager_attention", "uniform_rows"]


def _per_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens_q: Sequence[int],
    lens_k: Sequence[int],
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Run ``attend(q_i, k_i, v_i)`` on each packed sequence, with ``[H, S, D]`` views, and concatenate
    the ``[H, S_q, Dv]`` results back to ``[T_q, Hq, Dv]``. Sequences without queries are skipped."""
    outs, qa, ka = [], 0, 0
    for nq, nk in zip(lens_q, lens_k):
        if nq:
            o = attend(
                q[qa : qa + nq].transpose(0, 1),
                k[ka : ka + nk].transpose(0, 1),
                v[ka : ka + nk].transpose(0, 1),
            )
            outs.append(o.transpose(0, 1))
        qa, ka = qa + nq, ka + nk
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    return torch.cat(outs, dim=0)


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Matmul-softmax attention over ``[..., H, S, D]`` tensors in fp32 (fp64 for fp64 input).

    ``q [..., Hq, S_q, D]``, ``k [..., Hk, S_k, D]``, ``v [..., Hk, S_k, Dv]`` with ``Hq % Hk == 0``
    (kv heads are repeated); ``keep`` a bool mask broadcastable to ``[..., Hq, S_q, S_k]`` or ``None``;
    ``sinks [Hq]`` per-head sink logits (an extra softmax column with a zero value, after the softcap)
    or ``None``. Rows with no visible key give 0. Returns ``[..., Hq, S_q, Dv]`` in q's dtype;
    differentiable (also in ``sinks``).
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[-3] // k.shape[-3]
    kc, vc = k.to(compute), v.to(compute)
    if group > 1:
        kc, vc = kc.repeat_interleave(group, dim=-3), vc.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.to(compute), kc.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if keep is not None:
        scores = scores.masked_fill(~keep, torch.finfo(compute).min)
    if sinks is not None:
        sink = sinks.to(compute).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if keep is not None:
        probs = probs * keep
    return torch.matmul(probs, vc).to(q.dtype)


class EagerAttention:
    """``eager``: the reference ``AttentionKernel``: fp32 (fp64 for fp64 input) matmul-softmax in plain
    torch on any device, one sequence at a time for packed input. Supports every feature of the
    contract (causal, GQA/MQA, window, softcap, sinks, scale, ``Dv != D``) and autograd; memory is
    ``O(H * S_q * S_k)`` per sequence, so it is meant for tests and small inputs."""

    def __init__(self, device: Device) -> None:
        self._device = device

    @property
    def name(self) -> str:
        """``"eager"``."""
        return "eager"

    def supports(self, spec: AttentionSpec) -> tuple[str, ...]:
        """Empty for every floating dtype of ``FLOAT_DTYPES``; a reason otherwise."""
        if spec.dtype not in FLOAT_DTYPES:
            return (f"dtype {spec.dtype} is not one of {[str(d) for d in FLOAT_DTYPES]}",)
        return ()

    def varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool = True,
        window: tuple[int, int] | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed attention ``q [T_q, Hq, D]``, ``k``/``v`` ``[T_k, Hk, D|Dv]`` -> ``[T_q, Hq, Dv]``
        (see ``AttentionKernel.varlen``). Raises ``InvalidInput`` on bad arguments."""
        call = varlen_call(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal=causal,
            window=window,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
        )

        def attend(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
            keep = allowed_mask(qs.shape[1], ks.shape[1], call.causal, call.window, q.device)
            return eager_attention(qs, ks, vs, keep, call.scale, call.softcap, call.sinks)

        return _per_sequence(q, k, v, call.lens_q, call.lens_k, attend)

    def padded(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        causal: bool = True,
        window: tuple[int, int] | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Padded attention ``[B, S, H, D]`` -> ``[B, S_q, Hq, Dv]`` (see ``AttentionKernel.padded``);
        queries that see no key give 0. Raises ``InvalidInput`` on bad arguments."""
        call = padded_call(
            q, k, v, attention_mask, causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks
        )
        keep = padded_key_mask(attention_mask, q.shape[1], k.shape[1], causal, call.window, q.device)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = eager_attention(qt, kt, vt, keep, call.scale, softcap, sinks)
        return out.transpose(1, 2).contiguous()


# --------------------------------------------------------------------------------------------- torch


@lru_cache(maxsize=1)
def _varlen_api() -> tuple[Callable[..., torch.Tensor] | None, frozenset[str]]:
    """``torch.nn.attention.varlen.varlen_attn`` and its keyword names, or ``(None, {})`` when this
    torch has no such function."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    try:
        params = frozenset(inspect.signature(varlen_attn).parameters)
    except (TypeError, ValueError):
        return None, frozenset()
    return cast(Callable[..., torch.Tensor], varlen_attn), params


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    causal_square: bool,
    scale: float | None,
) -> torch.Tensor:
    """SDPA over ``[B, H, S, D]``. ``causal_square``: plain top-left causal mask (only valid for
    ``S_q == S_k``) without ``keep``. With ``keep`` (bool, broadcastable to ``[B, H, S_q, S_k]``), rows
    with no visible key give 0 instead of NaN."""
    gqa = q.shape[1] != k.shape[1]
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal_square, scale=scale, enable_gqa=gqa)
    if gqa:  # masked SDPA kernels (memory-efficient) have no native GQA
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    seen = keep.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | ~seen, scale=scale)
    return out * seen.to(out.dtype)


def _call_varlen_attn(
    fn: Callable[..., torch.Tensor],
    has_window: bool,
    has_gqa: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float | None,
) -> torch.Tensor:
    """``varlen_attn`` with this torch's keyword names; GQA through ``enable_gqa`` or repeated heads; a
    value head dim below the q/k one (latent attention) is zero-padded up to it and the output sliced
    back (the padded value columns contribute zeros, and their gradient is dropped by the slice)."""
    dv = int(v.shape[-1])
    if dv < q.shape[-1]:
        v = F.pad(v, (0, int(q.shape[-1]) - dv))
    kwargs: dict[str, Any] = {"scale": scale}
    if has_window:
        kwargs["window_size"] = effective_window(causal, window)
    else:
        kwargs["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        if has_gqa:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    return out[..., :dv] if dv < out.shape[-1] else out


def _traced_varlen(
    fn: Callable[..., torch.Tensor],
    has_window: bool,
    has_gqa: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float | None,
) -> torch.Tensor:
    return _call_varlen_attn(
        fn,
        has_window,
        has_gqa,
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        causal,
        window,
        scale,
    )


def uniform_rows(total: int, cu_seqlens: torch.Tensor, max_seqlen: int) -> int | None:
    """How many sequences a packed batch of ``total`` tokens holds when all of them have length
    ``max_seqlen`` (then ``total == n * max_seqlen`` with ``n = len(cu_seqlens) - 1``, since no
    sequence is longer than ``max_seqlen``), else ``None``. Reads shapes only: no host sync, and
    traceable (a symbolic comparison under ``torch.compile``)."""
    n = cu_seqlens.shape[0] - 1
    if n >= 1 and max_seqlen >= 1 and total == n * max_seqlen:
        return int(n)
    return None


def dense_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, scale: float | None
) -> torch.Tensor:
    """Causal self-attention of ``rows`` packed sequences of equal length as one batched SDPA call:
    ``q [T, Hq, D]``, ``k``/``v`` ``[T, Hk, D|Dv]`` viewed as ``[rows, H, T / rows, D]`` (no copy;
    GQA through ``enable_gqa``) -> ``[T, Hq, Dv]``. Equal to the varlen path on the same batch."""
    t, hq = int(q.shape[0]), int(q.shape[1])
    length = t // rows

    def view(x: torch.Tensor) -> torch.Tensor:
        return x.view(rows, length, x.shape[1], x.shape[2]).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        view(q), view(k), view(v), is_causal=True, scale=scale, enable_gqa=hq != k.shape[1]
    )
    return out.transpose(1, 2).reshape(t, hq, v.shape[-1])


def _traced_dense_or_varlen(
    fn: Callable[..., torch.Tensor],
    has_window: bool,
    has_gqa: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float | None,
) -> torch.Tensor:
    """``_traced_varlen``, except that a causal batch of equal-length sequences runs ``dense_causal``
    (``TorchAttention(device, dense_uniform=True)``)."""
    rows = uniform_rows(q.shape[0], cu_seqlens, max_seqlen) if causal and window is None else None
    if rows is not None:
        return dense_causal(q, k, v, rows, scale)
    return _traced_varlen(fn, has_window, has_gqa, q, k, v, cu_seqlens, max_seqlen, causal, window, scale)


class TorchAttention:
    """``torch``: PyTorch's own kernels.

    - padded: ``F.scaled_dot_product_attention`` (flash/cuDNN/memory-efficient/math as torch picks),
      native GQA (``enable_gqa``) when there is no mask, an explicit boolean mask for padding, windows
      and bottom-right causal alignment when ``S_q != S_k``.
    - varlen: ``torch.nn.attention.varlen.varlen_attn`` (flash) on CUDA for bf16/fp16 when the installed
      torch has it and the case fits (see :meth:`varlen_path`); otherwise one SDPA call per sequence.
      With ``dense_uniform=True`` (a constructor option, off by default) a causal self-attention batch
      whose sequences all have the same length (full-length training rows) runs as one batched causal
      SDPA call instead (``dense_causal``; cuDNN or flash as torch picks), on any device; it equals the
      varlen path. An engine uses such a kernel when it is given as ``ModelConfig.attention``.

    ``softcap`` and ``sinks`` are not available in these kernels: ``supports`` reports them.
    """

    def __init__(self, device: Device, *, dense_uniform: bool = False) -> None:
        """``device``: the Device the kernel runs on; ``dense_uniform``: see the class docstring.
        Raises ``ConfigError`` when ``dense_uniform`` is not a bool."""
        if not isinstance(dense_uniform, bool):
            raise ConfigError(
                f"{type(self).__name__}(dense_uniform={dense_uniform!r}): give True (equal-length packed "
                "causal batches run as one batched SDPA call) or False (always the varlen path)"
            )
        self._device = device
        self._dense_uniform = dense_uniform

    @property
    def dense_uniform(self) -> bool:
        """Whether packed causal batches of equal-length sequences run as one batched SDPA call."""
        return self._dense_uniform

    @property
    def name(self) -> str:
        """``"torch"``."""
        return "torch"

    def supports(self, spec: AttentionSpec) -> tuple[str, ...]:
        """Reasons this kernel cannot run ``spec``: a softcap, a dtype outside ``FLOAT_DTYPES``, or a
        device type other than cuda/cpu."""
        reasons = []
        if spec.softcap is not None:
            reasons.append(f"softcap={spec.softcap} is not supported by torch SDPA/varlen_attn (use eager)")
        if spec.sinks:
            reasons.append("attention sinks are not supported by torch SDPA/varlen_attn (use eager)")
        if spec.dtype not in FLOAT_DTYPES:
            reasons.append(f"dtype {spec.dtype} is not one of {[str(d) for d in FLOAT_DTYPES]}")
        if spec.device_type not in ("cuda", "cpu"):
            reasons.append(f"device type {spec.device_type!r}: this kernel runs on cuda or cpu")
        return tuple(reasons)

    def varlen_path(self, spec: AttentionSpec) -> tuple[str, tuple[str, ...]]:
        """Which packed path runs ``spec``: ``("varlen_attn", ())`` or ``("sdpa_per_sequence", reasons
        varlen_attn cannot run it)``."""
        fn, params = _varlen_api()
        why: list[str] = []
        if fn is None:
            why.append(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
        if spec.device_type != "cuda":
            why.append(f"varlen_attn needs cuda, not {spec.device_type}")
        if spec.dtype not in (torch.float16, torch.bfloat16):
            why.append(f"varlen_attn needs bf16/fp16, not {spec.dtype}")
        dv = spec.head_dim_v if spec.head_dim_v is not None else spec.head_dim
        if spec.head_dim % 8 or spec.head_dim > 256 or dv > spec.head_dim:
            why.append(
                f"varlen_attn needs head_dim % 8 == 0, <= 256 and Dv <= D (Dv < D is zero-padded; got "
                f"D={spec.head_dim}, Dv={dv})"
            )
        if spec.window is not None and "window_size" not in params:
            why.append("this torch's varlen_attn has no window_size")
        if (
            not spec.causal
            and spec.window is None
            and "window_size" not in params
            and "is_causal" not in params
        ):
            why.append("this torch's varlen_attn has neither is_causal nor window_size")
        if spec.softcap is not None or spec.sinks:
            why.append("varlen_attn has no softcap or sinks")
        if spec.device_type == "cuda" and not why:
            cap = self._device.capability()
            if cap is not None and cap < (8, 0):
                why.append(f"varlen_attn (flash) needs compute capability >= 8.0, got {cap}")
        return ("sdpa_per_sequence", tuple(why)) if why else ("varlen_attn", ())

    def _require(self, spec: AttentionSpec) -> None:
        require_supported(self.name, self.supports(spec), "eager")

    def varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool = True,
        window: tuple[int, int] | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed attention (see ``AttentionKernel.varlen``). Raises ``InvalidInput`` on bad arguments and
        ``UnsupportedOperation`` when ``supports`` has reasons (e.g. softcap)."""
        call = varlen_call(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal=causal,
            window=window,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
        )
        self._require(call.spec)
        window, lens_q, lens_k = call.window, call.lens_q, call.lens_k
        if causal and window is None and cu_seqlens_k is cu_seqlens_q and self._dense_uniform:
            rows = uniform_rows(int(q.shape[0]), cu_seqlens_q, max_seqlen_q)
            if rows is not None:
                return dense_causal(q, k, v, rows, scale)
        path, _ = self.varlen_path(call.spec)
        if path == "varlen_attn":
            fn, params = _varlen_api()
            assert fn is not None  # varlen_path checked it
            cu_q = cu_seqlens_q.to(q.device, non_blocking=True)
            cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(q.device, non_blocking=True)
            has_window, has_gqa = "window_size" in params, "enable_gqa" in params
            return _call_varlen_attn(
                fn,
                has_window,
                has_gqa,
                q,
                k,
                v,
                cu_q,
                cu_k,
                max_seqlen_q,
                max_seqlen_k,
                causal,
                window,
                scale,
            )

        def attend(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
            sq, sk = qs.shape[1], ks.shape[1]
            square_causal = causal and window is None and sq == sk
            keep = None if square_causal else allowed_mask(sq, sk, causal, window, q.device)
            return _sdpa(qs[None], ks[None], vs[None], keep, square_causal, scale)[0]

        return _per_sequence(q, k, v, lens_q, lens_k, attend)

    def traceable_varlen(self, spec: AttentionSpec) -> Callable[..., torch.Tensor] | None:
        """For ``torch.compile``: a function ``(q, k, v, cu_seqlens, max_seqlen, causal, window, scale)
        -> out`` that runs ``spec`` through ``varlen_attn`` (a traceable custom op) with no host read
        and no validation, so a compiled decoder layer keeps attention inside its graph (GQA heads are
        repeated in-graph when this torch's ``varlen_attn`` lacks ``enable_gqa``). The caller must have
        validated the boundaries (:func:`underlay.ops.attention.check_varlen`). ``None`` when ``spec``
        takes the per-sequence SDPA path, which needs the lengths on the host. The function refers to
        module-level objects only, so every layer's compiled graph can share it."""
        if self.varlen_path(spec)[0] != "varlen_attn":
            return None
        fn, params = _varlen_api()
        assert fn is not None
        traced = _traced_dense_or_varlen if self._dense_uniform else _traced_varlen
        return partial(traced, fn, "window_size" in params, "enable_gqa" in params)

    def padded(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        causal: bool = True,
        window: tuple[int, int] | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Padded attention through SDPA (see ``AttentionKernel.padded``); queries that see no key give 0.
        Raises ``InvalidInput`` on bad arguments, ``UnsupportedOperation`` for a softcap."""
        call = padded_call(
            q, k, v, attention_mask, causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks
        )
        self._require(call.spec)
        window = call.window
        sq, sk = int(q.shape[1]), int(k.shape[1])
        square_causal = causal and window is None and attention_mask is None and sq == sk
        keep = None if square_causal else padded_key_mask(attention_mask, sq, sk, causal, window, q.device)
        out = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keep, square_causal, scale)
        return out.transpose(1, 2).contiguous()
