"""``flex`` attention backend: ``torch.nn.attention.flex_attention`` with block masks, so attention that
torch's fused kernels cannot run (a logit softcap: Gemma 2) still runs fused, in ``O(T)`` memory, on cuda.

Packed (varlen) input is one flex call over the whole stream ``[1, H, T, D]`` with a block mask that
keeps each query inside its own sequence (document masking), bottom-right aligned causal and
sliding-window bands as :mod:`underlay.ops.attention` defines them; a softcap is a ``score_mod``. The
block mask of a batch layout is built once and kept on the ``cu_seqlens_q`` tensor the caller owns (every
decoder layer of one packed forward, and its recomputation in backward, passes that same tensor), keyed
by the sequence lengths, causality, window and device; so no process-wide state but the one compiled
``flex_attention`` (:func:`underlay.ops.flex.flex_attention_fn`).

On the cpu flex runs unfused and forward only (torch has no cpu backward for it): ``supports`` refuses
cpu calls that need gradients; the registry lists this backend for cuda only, so ``auto`` never picks
it on a cpu host (``eager`` keeps the cpu's softcap cases).
"""

from __future__ import annotations

from typing import Any

import torch

from underlay.interfaces import AttentionSpec, Device
from underlay.ops.attention import (
    FLOAT_DTYPES,
    effective_window,
    padded_call,
    require_supported,
    varlen_call,
)
from underlay.ops.flex import flex_attention_fn, softcap_score_mod

__all__ = ["FlexAttention"]

_MASKS_ATTR = "_underlay_flex_block_masks"
"""Attribute of a ``cu_seqlens_q`` (varlen) or ``attention_mask`` (padded) tensor holding the flex
block masks built for it: ``{key: BlockMask}``. It belongs to the caller's tensor and dies with it."""

_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256)


def _positions(
    lens: tuple[int, ...], shift: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Per token of a packed stream: ``(sequence index, position)`` int32, where the position of token
    ``i`` of sequence ``b`` is ``i + shift[b]``."""
    n = len(lens)
    lengths = torch.tensor(lens, dtype=torch.int64)
    total = int(lengths.sum())
    doc = torch.repeat_interleave(torch.arange(n), lengths, output_size=total)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(total) - starts[doc] + torch.tensor(shift, dtype=torch.int64)[doc]
    return doc.to(device, torch.int32), pos.to(device, torch.int32)


_UNBOUNDED = 1 << 30
"""An offset no sequence reaches: the bound of an unbounded window side."""


def _band(left: int, right: int, shift: int, device: torch.device) -> torch.Tensor:
    """``[lo, hi, shift]`` int32 on ``device``: a key at offset ``d = pos_q - pos_k`` is kept when
    ``lo <= d <= hi`` (``lo = -right``, ``hi = left``; ``-1`` = unbounded). A tensor, not Python
    constants, so that every window (Gemma 2's sliding and global layers) gives the same ``mask_mod``
    code to the compiled flex, which then does not recompile per window."""
    lo = -right if right >= 0 else -_UNBOUNDED
    hi = left if left >= 0 else _UNBOUNDED
    return torch.tensor([lo, hi, shift], dtype=torch.int32, device=device)


def _varlen_block_mask(
    lens_q: tuple[int, ...], lens_k: tuple[int, ...], left: int, right: int, device: torch.device
) -> Any:
    """The flex ``BlockMask`` ``[1, 1, T_q, T_k]`` of a packed batch: query ``i`` of sequence ``b`` (at
    key position ``i + S_k - S_q``, bottom-right aligned) sees key ``j`` of the same sequence when
    ``-right <= pos_q - j <= left`` (``-1``: that side unbounded)."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc_q, pos_q = _positions(lens_q, tuple(nk - nq for nq, nk in zip(lens_q, lens_k)), device)
    doc_k, pos_k = _positions(lens_k, (0,) * len(lens_k), device)
    band = _band(left, right, 0, device)

    def mask_mod(b: Any, h: Any, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        d = pos_q[qi] - pos_k[ki]
        return (doc_q[qi] == doc_k[ki]) & (d >= band[0]) & (d <= band[1])

    return create_block_mask(mask_mod, None, None, sum(lens_q), sum(lens_k), device=device)


def _padded_block_mask(
    keep: torch.Tensor | None, batch: int, s_q: int, s_k: int, left: int, right: int, device: torch.device
) -> Any:
    """The flex ``BlockMask`` ``[B, 1, S_q, S_k]`` of a padded batch (``[1, 1, S_q, S_k]`` without
    ``keep``): key ``j`` is visible from query ``i`` when ``keep[b, j]`` (``None``: every key) and
    ``-right <= i + S_k - S_q - j <= left``."""
    from torch.nn.attention.flex_attention import create_block_mask

    # (flex evaluates mask_mod with every batch index, also for a mask built for B = 1)
    keys = (
        keep if keep is not None else torch.ones(1, s_k, dtype=torch.bool, device=device).expand(batch, s_k)
    )
    band = _band(left, right, s_k - s_q, device)

    def mask_mod(b: Any, h: Any, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        d = qi + band[2] - ki
        return keys[b, ki] & (d >= band[0]) & (d <= band[1])

    return create_block_mask(mask_mod, batch if keep is not None else None, None, s_q, s_k, device=device)


def _cached(owner: torch.Tensor | None, key: tuple[Any, ...], build: Any) -> Any:
    """``build()``, remembered on ``owner`` (a tensor of the caller's batch) under ``key``; rebuilt
    when ``owner`` was modified in place since (its version is part of the key)."""
    if owner is None:
        return build()
    masks: dict[tuple[Any, ...], Any] | None = getattr(owner, _MASKS_ATTR, None)
    if masks is None:
        masks = {}
        setattr(owner, _MASKS_ATTR, masks)
    full = (owner._version, *key)
    found = masks.get(full)
    if found is None:
        found = masks[full] = build()
    return found


class FlexAttention:
    """``flex``: ``torch.nn.attention.flex_attention`` (compiled Triton kernels on cuda; unfused,
    forward-only on the cpu).

    Contract as ``AttentionKernel``: causal and bidirectional, bottom-right alignment when ``S_q != S_k``,
    sliding windows, GQA/MQA (``enable_gqa``), ``scale``, ``softcap`` (a ``score_mod``), ``Dv != D``;
    queries that see no key give 0. Not supported (``supports`` says so): attention sinks; on cuda,
    float64 and head dims other than 16/32/64/128/256; on the cpu, gradients. Memory is ``O(T)`` plus the
    block mask (``O((T / 128) ** 2)`` ints), built once per batch layout (see the module docstring).
    """

    def __init__(self, device: Device) -> None:
        self._device = device

    @property
    def name(self) -> str:
        """``"flex"``."""
        return "flex"

    def supports(self, spec: AttentionSpec) -> tuple[str, ...]:
        """Reasons this kernel cannot run ``spec``: sinks; a device other than cuda/cpu; on cuda a dtype
        outside fp16/bf16/fp32, a head dim (q/k or v) not in 16/32/64/128/256, or compute capability
        below 8.0; on the cpu, ``requires_grad`` (no cpu backward) or a non-float dtype."""
        reasons: list[str] = []
        if spec.sinks:
            reasons.append("attention sinks are not supported by the flex kernel (use eager)")
        dv = spec.head_dim_v if spec.head_dim_v is not None else spec.head_dim
        if spec.device_type == "cuda":
            if spec.dtype not in _CUDA_DTYPES:
                reasons.append(
                    f"dtype {spec.dtype}: flex_attention on cuda runs {[str(d) for d in _CUDA_DTYPES]}"
                )
            if spec.head_dim not in _HEAD_DIMS or dv not in _HEAD_DIMS:
                reasons.append(
                    f"head dims D={spec.head_dim}, Dv={dv}: the flex kernel here takes {list(_HEAD_DIMS)}"
                )
            cap = self._device.capability() if self._device.name == "cuda" else None
            if cap is not None and cap < (8, 0):
                reasons.append(f"flex_attention's Triton kernels need compute capability >= 8.0, got {cap}")
        elif spec.device_type == "cpu":
            if spec.dtype not in FLOAT_DTYPES:
                reasons.append(f"dtype {spec.dtype} is not one of {[str(d) for d in FLOAT_DTYPES]}")
            if spec.requires_grad:
                reasons.append(
                    f"torch {torch.__version__} has no cpu backward for flex_attention (use eager on the cpu)"
                )
        else:
            reasons.append(
                f"device type {spec.device_type!r}: this kernel runs on cuda (or cpu, forward only)"
            )
        return tuple(reasons)

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
        """Packed attention ``q [T_q, Hq, D]``, ``k``/``v`` ``[T_k, Hk, D|Dv]`` -> ``[T_q, Hq, Dv]`` in q's
        dtype (see ``AttentionKernel.varlen``): one flex call over the stream with a document block mask
        (cached on ``cu_seqlens_q``). Raises ``InvalidInput`` on bad arguments, ``UnsupportedOperation``
        when ``supports`` has reasons."""
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
        require_supported(self.name, self.supports(call.spec), "eager")
        left, right = effective_window(call.causal, call.window)  # keep -right <= pos_q - pos_k <= left
        lens_q, lens_k = call.lens_q, call.lens_k
        key = ("varlen", lens_q, lens_k, left, right, str(q.device))
        block = _cached(cu_seqlens_q, key, lambda: _varlen_block_mask(lens_q, lens_k, left, right, q.device))
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = self._run(qh, kh, vh, block, call.scale, call.softcap)
        return out[0].transpose(0, 1)

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
        """Padded attention ``[B, S, H, D]`` -> ``[B, S_q, Hq, Dv]`` (see ``AttentionKernel.padded``); the
        key-padding mask is part of the block mask (cached on ``attention_mask``); queries that see no key
        give 0. Raises ``InvalidInput`` on bad arguments, ``UnsupportedOperation`` when ``supports`` has
        reasons."""
        call = padded_call(
            q, k, v, attention_mask, causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks
        )
        require_supported(self.name, self.supports(call.spec), "eager")
        left, right = effective_window(call.causal, call.window)  # keep -right <= pos_q - pos_k <= left
        b, s_q, s_k = int(q.shape[0]), int(q.shape[1]), int(k.shape[1])
        keep = None if attention_mask is None else attention_mask != 0
        key = ("padded", b, s_q, s_k, left, right, str(q.device))
        block = _cached(
            attention_mask, key, lambda: _padded_block_mask(keep, b, s_q, s_k, left, right, q.device)
        )
        out = self._run(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block, call.scale, call.softcap
        )
        return out.transpose(1, 2).contiguous()

    @staticmethod
    def _run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block: Any,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        """One flex call over ``[B, H, S, D]`` tensors -> ``[B, Hq, S_q, Dv]``; rows with no visible key
        give 0 (flex's convention, compiled and unfused alike)."""
        fn = flex_attention_fn(q.device.type)
        return fn(
            q,
            k,
            v,
            score_mod=softcap_score_mod(float(softcap)) if softcap is not None else None,
            block_mask=block,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
