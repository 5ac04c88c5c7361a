"""``flash_attn`` attention backend: the flash-attn 2 package's ``flash_attn_varlen_func`` (packed input)
and ``flash_attn_func`` (padded input) on CUDA.

flash-attn has no binary wheel, so it is optional: the registry probes for it and this module imports it
only when the backend is built. Features that depend on the installed version (``window_size`` since 2.3,
``softcap`` since 2.6) are read from the function signatures and reported by ``supports``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

import torch

from underlay.interfaces import AttentionSpec, BackendUnavailable, Device, InvalidInput
from underlay.ops.attention import (
    padded_call,
    require_supported,
    varlen_call,
)

__all__ = ["FlashAttnKernel"]

_HALF = (torch.float16, torch.bfloat16)


def _first(out: Any) -> torch.Tensor:
    """The attention output of a flash-attn call (some versions return ``(out, lse, ...)``)."""
    return cast(torch.Tensor, out[0] if isinstance(out, tuple) else out)


def _params(fn: Callable[..., Any]) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


class FlashAttnKernel:
    """``flash_attn``: flash-attn 2 kernels (bf16/fp16, head_dim <= 256, compute capability >= 8.0).

    Causal masks are bottom-right aligned (flash-attn >= 2.1), as the ``AttentionKernel`` contract
    requires. GQA/MQA is native. ``padded`` with an ``attention_mask`` unpads the batch and runs the
    varlen kernel; it needs ``S_q == S_k`` (self-attention with one mask for queries and keys) and
    treats the kept tokens of each row as one contiguous sequence (left or right padding).

    Raises ``BackendUnavailable`` at construction when flash-attn cannot be imported.
    """

    def __init__(self, device: Device) -> None:
        self._device = device
        try:
            import flash_attn
        except ImportError as exc:
            raise BackendUnavailable(
                "attention",
                "flash_attn",
                f"importing flash_attn failed: {exc}",
                [],
                "install it with `pip install flash-attn --no-build-isolation` on a CUDA host",
            ) from exc
        self._varlen_fn: Callable[..., Any] = flash_attn.flash_attn_varlen_func
        self._dense_fn: Callable[..., Any] = flash_attn.flash_attn_func
        self._version = str(getattr(flash_attn, "__version__", "unknown"))
        self._varlen_params = _params(self._varlen_fn)
        self._dense_params = _params(self._dense_fn)

    @property
    def name(self) -> str:
        """``"flash_attn"``."""
        return "flash_attn"

    def supports(self, spec: AttentionSpec) -> tuple[str, ...]:
        """Reasons flash-attn cannot run ``spec``: device other than cuda, dtype other than bf16/fp16,
        head_dim > 256 or ``Dv != D``, a window or softcap this flash-attn version lacks, compute
        capability < 8.0."""
        reasons = []
        if spec.device_type != "cuda":
            reasons.append(f"flash-attn runs on cuda, not {spec.device_type}")
        if spec.dtype not in _HALF:
            reasons.append(f"flash-attn needs bf16/fp16, not {spec.dtype}")
        dv = spec.head_dim_v if spec.head_dim_v is not None else spec.head_dim
        if spec.head_dim > 256 or dv != spec.head_dim:
            reasons.append(f"flash-attn needs head_dim <= 256 and Dv == D (got D={spec.head_dim}, Dv={dv})")
        params = self._varlen_params if spec.layout == "varlen" else self._dense_params
        if spec.window is not None and "window_size" not in params:
            reasons.append(f"flash-attn {self._version} has no window_size (needs >= 2.3)")
        if spec.softcap is not None and "softcap" not in params:
            reasons.append(f"flash-attn {self._version} has no softcap (needs >= 2.6)")
        if spec.sinks:
            reasons.append("flash-attn 2 has no attention sinks (use eager)")
        if spec.device_type == "cuda":
            cap = self._device.capability()
            if cap is not None and cap < (8, 0):
                reasons.append(f"flash-attn 2 needs compute capability >= 8.0, got {cap}")
        return tuple(reasons)

    def _require(self, spec: AttentionSpec) -> None:
        require_supported(self.name, self.supports(spec), "torch")

    @staticmethod
    def _options(causal: bool, window: tuple[int, int] | None, softcap: float | None) -> dict[str, Any]:
        """Keyword arguments of the flash-attn call (``supports`` checked that this version has them)."""
        kwargs: dict[str, Any] = {"causal": causal}
        if window is not None:
            kwargs["window_size"] = window
        if softcap is not None:
            kwargs["softcap"] = softcap
        return kwargs

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
        """Packed attention through ``flash_attn_varlen_func`` (see ``AttentionKernel.varlen``). Raises
        ``InvalidInput`` on bad arguments, ``UnsupportedOperation`` when ``supports`` has reasons."""
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
        window = call.window
        cu_q = cu_seqlens_q.to(q.device, non_blocking=True)
        cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(q.device, non_blocking=True)
        out = self._varlen_fn(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale=scale,
            **self._options(causal, window, softcap),
        )
        return _first(out)

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
        """Padded attention (see ``AttentionKernel.padded``): ``flash_attn_func`` without a mask, unpad +
        ``flash_attn_varlen_func`` with one (padded query rows are 0). Raises ``InvalidInput`` on bad
        arguments or a mask with ``S_q != S_k``, ``UnsupportedOperation`` when ``supports`` has reasons."""
        call = padded_call(
            q, k, v, attention_mask, causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks
        )
        self._require(call.spec)
        window = call.window
        if attention_mask is None:
            out = self._dense_fn(q, k, v, softmax_scale=scale, **self._options(causal, window, softcap))
            return _first(out)
        b, s = int(q.shape[0]), int(q.shape[1])
        if k.shape[1] != s:
            raise InvalidInput(
                f"attention (padded, flash_attn): an attention_mask needs S_q == S_k, got S_q={s}, "
                f"S_k={k.shape[1]}; pass packed input to varlen() for cross-length attention"
            )
        keep = attention_mask.reshape(-1) != 0
        idx = keep.nonzero().squeeze(1)
        lens = (attention_mask != 0).sum(dim=1, dtype=torch.int32)
        cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        max_len = int(lens.max().item()) if b else 0
        out = self._varlen_fn(
            q.reshape(b * s, *q.shape[2:])[idx],
            k.reshape(b * s, *k.shape[2:])[idx],
            v.reshape(b * s, *v.shape[2:])[idx],
            cu,
            cu,
            max_len,
            max_len,
            softmax_scale=scale,
            **self._options(causal, window, softcap),
        )
        out = _first(out)
        full = out.new_zeros(b * s, *out.shape[1:])
        return full.index_copy(0, idx, out).view(b, s, *out.shape[1:])
