"""Kernel protocols: attention and fused linear -> log-prob."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from underlay.interfaces.types import AttentionSpec, LogprobOutput

__all__ = ["IGNORE_INDEX", "AttentionKernel", "Fp8Quantizer", "LogprobKernel"]

IGNORE_INDEX = -100
"""Label value that gives log-prob 0, entropy 0 and no gradient."""


@runtime_checkable
class AttentionKernel(Protocol):
    """Scaled dot-product attention over packed (varlen) or padded input.

    Shapes: varlen ``q [T, Hq, D]``, ``k``/``v`` ``[T, Hk, D]`` (``Dv`` for v), ``cu_seqlens_*`` int32
    ``[B + 1]`` starting at 0 and ending at ``T``; padded ``[B, S, H, D]``. ``Hq % Hk == 0`` (GQA/MQA).
    ``causal`` aligns the causal mask to the bottom-right when query and key lengths differ.
    ``window = (left, right)`` limits keys to ``[i - left, i + right]`` (``-1`` = unbounded).
    ``scale`` defaults to ``D ** -0.5``; ``softcap`` applies ``softcap * tanh(s / softcap)`` to the
    scores. ``sinks`` (``[Hq]``, any float dtype) adds to every query row of head ``h`` one extra
    logit ``sinks[h]`` whose key has a zero value (an attention sink, as gpt-oss): the softmax runs over
    the visible keys plus the sink, and the sink's share of the probability is dropped. Output has the
    dtype of ``q``; gradients flow to q, k, v (and ``sinks``).

    Every call validates its arguments and raises ``InvalidInput`` before launching anything.
    """

    @property
    def name(self) -> str:
        """Registry name, e.g. ``"torch"``."""

    def supports(self, spec: AttentionSpec) -> tuple[str, ...]:
        """Reasons this kernel cannot run ``spec``; empty when it can."""

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
        """Attention within each packed sequence; returns ``[T, Hq, Dv]``."""

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
        """Attention over ``[B, S, H, D]``; ``attention_mask`` ``[B, S_k]`` (1 = keep) masks padded keys.
        Returns ``[B, S_q, Hq, Dv]``; rows of padded queries are unspecified (finite)."""


@runtime_checkable
class LogprobKernel(Protocol):
    """Fused ``hidden @ weight.T / temperature -> log_softmax -> gather(labels)`` (+ entropy) that never
    materialises the ``[N, V]`` logits.

    ``hidden [N, H]`` (bf16, fp16 or fp32, any strides; fp64 where ``supports(torch.float64)`` is empty),
    ``weight [V_local, H]`` of the same dtype, ``labels [N]`` int64 in ``[0, V)`` or ``IGNORE_INDEX``.
    Math is fp32 (fp64 for fp64 input, whose outputs are then fp64). With ``vocab_group`` the
    weight is this rank's contiguous vocabulary shard (rank ``r`` holds rows
    ``[r * V_local, (r + 1) * V_local)``), labels are global ids, and the result equals the unsharded
    one on every rank of the group. Backward gives gradients of ``hidden`` and ``weight``.
    """

    @property
    def name(self) -> str:
        """Registry name, e.g. ``"triton"``."""

    def supports(self, dtype: torch.dtype) -> tuple[str, ...]:
        """Reasons this kernel cannot run inputs of ``dtype``; empty when it can."""

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float = 1.0,
        with_entropy: bool = True,
        vocab_group: Any | None = None,
        softcap: float | None = None,
    ) -> LogprobOutput:
        """Per-token fp32 log-probs ``[N]`` and entropy ``[N]`` (``None`` unless ``with_entropy``).
        ``softcap`` ``c`` (Gemma 2/3's final-logit cap; ``None`` or 0: none) makes the logits
        ``c * tanh(hidden @ weight.T / c)`` before the temperature, still without an ``[N, V]`` buffer.
        Raises ``InvalidInput`` on mismatched shapes/dtypes/devices, ``temperature <= 0`` or a negative
        or non-finite ``softcap``."""


@runtime_checkable
class Fp8Quantizer(Protocol):
    """Blockwise FP8 (e4m3) weight quantisation for rollout weight sync.

    ``weight [M, K]`` (bf16/fp16/fp32) is cut into ``block = (bm, bk)`` tiles (edge tiles may be
    partial); each tile gets one fp32 scale ``amax / 448`` (1 for an all-zero tile) and its values are
    ``weight / scale`` rounded to nearest-even e4m3. Every backend produces bit-identical output.
    """

    @property
    def name(self) -> str:
        """Registry name: ``"triton"``, ``"torch"``."""

    def quantize(
        self, weight: torch.Tensor, block: tuple[int, int] = (128, 128)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(q [M, K] float8_e4m3fn, scales [ceil(M/bm), ceil(K/bk)] float32)``."""

    def dequantize(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        block: tuple[int, int] = (128, 128),
        dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """``q * scale`` per tile, in ``dtype`` (bf16/fp16/fp32; a backend may also offer fp64, computed
        exactly, and otherwise refuses it with ``InvalidInput``)."""
