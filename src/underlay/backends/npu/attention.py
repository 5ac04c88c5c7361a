"""``npu`` attention backend: ``torch_npu.npu_fusion_attention`` on Ascend NPUs.

Packed input uses ``input_layout="TND"`` with ``actual_seq_qlen``/``actual_seq_kvlen`` (cumulative
lengths without the leading 0, host ints); padded input uses ``"BSND"``. Masks follow torch_npu's
documented ``sparse_mode``s: 0 (no mask, or an explicit ``atten_mask``), 3 (causal aligned to the
bottom-right, with the 2048x2048 compressed upper-triangular mask) and 4 (band: ``pre_tockens`` keys
before and ``next_tockens`` after the bottom-right aligned diagonal, same compressed mask). In
``atten_mask`` True means "masked out". torch_npu is imported only when a kernel runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import torch

from underlay.interfaces import AttentionSpec, BackendUnavailable, Device
from underlay.ops.attention import (
    effective_window,
    padded_call,
    padded_key_mask,
    require_supported,
    varlen_call,
)

__all__ = ["FusionMask", "NpuFusionAttention", "fusion_mask"]

UNBOUNDED = 2147483647
"""``pre_tockens``/``next_tockens`` value meaning "no limit" (torch_npu's default)."""
COMPRESSED_MASK_SIZE = 2048
"""Side of the compressed causal/band mask that sparse modes 2, 3 and 4 take."""


@dataclass(frozen=True)
class FusionMask:
    """How ``npu_fusion_attention`` masks one call: ``sparse_mode``, ``pre_tockens``, ``next_tockens``,
    and whether the 2048x2048 compressed upper-triangular ``atten_mask`` is needed."""

    sparse_mode: int
    pre_tockens: int
    next_tockens: int
    compressed_mask: bool


def fusion_mask(causal: bool, window: tuple[int, int] | None) -> FusionMask:
    """The sparse mode for ``causal``/``window`` (normalised, see ``ops.attention``) without an
    explicit mask: 0 for full attention, 3 for plain causal, 4 (band) for any window."""
    if window is None and not causal:
        return FusionMask(0, UNBOUNDED, UNBOUNDED, False)
    if window is None:
        return FusionMask(3, UNBOUNDED, 0, True)
    left, right = effective_window(causal, window)
    return FusionMask(4, left if left >= 0 else UNBOUNDED, right if right >= 0 else UNBOUNDED, True)


@lru_cache(maxsize=1)
def _fusion_attention() -> Callable[..., Any]:
    try:
        import torch_npu
    except ImportError as exc:
        raise BackendUnavailable(
            "attention",
            "npu",
            f"importing torch_npu failed: {exc}",
            [],
            "install it with `pip install underlay[npu]` on an Ascend host",
        ) from exc
    return cast(Callable[..., Any], torch_npu.npu_fusion_attention)


class NpuFusionAttention:
    """``npu``: ``torch_npu.npu_fusion_attention`` (fp16/bf16/fp32, head_dim <= 512, ``Dv == D``).

    GQA/MQA is native (kv heads must divide q heads). ``scale`` defaults to ``D ** -0.5`` (the op's
    own default is 1.0, so it is always passed). ``keep_prob`` is 1 (no dropout). No softcap.
    """

    def __init__(self, device: Device) -> None:
        self._device = device
        self._masks: dict[torch.device, torch.Tensor] = {}

    @property
    def name(self) -> str:
        """``"npu"``."""
        return "npu"

    def supports(self, spec: AttentionSpec) -> tuple[str, ...]:
        """Reasons ``npu_fusion_attention`` cannot run ``spec``: device other than npu, dtype other than
        fp16/bf16/fp32, head_dim > 512, ``Dv != D``, softcap."""
        reasons = []
        if spec.device_type != "npu":
            reasons.append(f"npu_fusion_attention runs on npu, not {spec.device_type}")
        if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"npu_fusion_attention needs fp16/bf16/fp32, not {spec.dtype}")
        dv = spec.head_dim_v if spec.head_dim_v is not None else spec.head_dim
        if spec.head_dim > 512 or dv != spec.head_dim:
            reasons.append(
                f"npu_fusion_attention needs head_dim <= 512 and Dv == D (D={spec.head_dim}, Dv={dv})"
            )
        if spec.softcap is not None:
            reasons.append("npu_fusion_attention has no softcap")
        if spec.sinks:
            reasons.append("npu_fusion_attention has no attention sinks (use eager)")
        return tuple(reasons)

    def _require(self, spec: AttentionSpec) -> None:
        require_supported(self.name, self.supports(spec), "eager")

    def _compressed(self, device: torch.device) -> torch.Tensor:
        if device not in self._masks:
            n = COMPRESSED_MASK_SIZE
            self._masks[device] = torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)
        return self._masks[device]

    def _mask_kwargs(
        self, causal: bool, window: tuple[int, int] | None, device: torch.device
    ) -> dict[str, Any]:
        m = fusion_mask(causal, window)
        return {
            "atten_mask": self._compressed(device) if m.compressed_mask else None,
            "sparse_mode": m.sparse_mode,
            "pre_tockens": m.pre_tockens,
            "next_tockens": m.next_tockens,
        }

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
        """Packed attention with ``input_layout="TND"`` (see ``AttentionKernel.varlen``). Raises
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
        fa = _fusion_attention()
        cum_q = torch.tensor(call.lens_q).cumsum(0).tolist()
        cum_k = torch.tensor(call.lens_k).cumsum(0).tolist()
        out = fa(
            q,
            k,
            v,
            int(q.shape[1]),
            "TND",
            scale=call.scale,
            keep_prob=1.0,
            actual_seq_qlen=cum_q,
            actual_seq_kvlen=cum_k,
            **self._mask_kwargs(causal, window, q.device),
        )
        return cast(torch.Tensor, out[0])

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
        """Padded attention with ``input_layout="BSND"`` (see ``AttentionKernel.padded``). With an
        ``attention_mask`` the full ``[B, 1, S_q, S_k]`` mask goes to ``atten_mask`` (sparse mode 0) and
        queries that see no key give 0. Raises ``InvalidInput``/``UnsupportedOperation``."""
        call = padded_call(
            q, k, v, attention_mask, causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks
        )
        self._require(call.spec)
        window = call.window
        fa = _fusion_attention()
        sc = call.scale
        if attention_mask is None:
            mask_kwargs = self._mask_kwargs(causal, window, q.device)
            seen = None
        else:
            keep = padded_key_mask(attention_mask, q.shape[1], k.shape[1], causal, window, q.device)
            assert keep is not None  # a padding mask is given
            seen = keep.any(dim=-1, keepdim=True)
            b, sq, sk = int(q.shape[0]), int(q.shape[1]), int(k.shape[1])
            masked = (~(keep | ~seen)).expand(b, 1, sq, sk).contiguous()  # B1SS, True = masked out
            mask_kwargs = {"atten_mask": masked, "sparse_mode": 0}
        out = cast(
            torch.Tensor, fa(q, k, v, int(q.shape[2]), "BSND", scale=sc, keep_prob=1.0, **mask_kwargs)[0]
        )
        if seen is not None:
            out = out * seen.view(seen.shape[0], -1, 1, 1).to(out.dtype)
        return out
