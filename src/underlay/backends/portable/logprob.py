"""The ``torch`` LogprobKernel: chunked plain-torch ``hidden @ W^T -> log-prob (+ entropy)``.

Default on cpu and npu and the fallback elsewhere; it delegates to ``underlay.ops.linear_logprobs``.
"""

from __future__ import annotations

from typing import Any

import torch

from underlay.interfaces import Device, InvalidInput, LogprobOutput
from underlay.ops.logprob import linear_logprobs

__all__ = ["TorchLogprobKernel"]


class TorchLogprobKernel:
    """``LogprobKernel`` in plain torch, chunked over ``chunk_size`` tokens (forward and backward).

    ``device`` is the underlay ``Device`` the kernel runs on (kept for reporting; inputs may live on
    any device as long as they agree). ``chunk_size`` is the number of tokens per chunk; ``None``
    (default) picks ``CHUNK_ELEMENTS // V_local`` tokens (at least 1, at most 16384) so that one fp32
    ``[chunk, V_local]`` buffer is about 256 MiB whatever the vocabulary size.
    """

    CHUNK_ELEMENTS = 1 << 26

    def __init__(self, device: Device, chunk_size: int | None = None) -> None:
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise InvalidInput(f"TorchLogprobKernel: chunk_size={chunk_size!r} must be an int >= 1 or None")
        self.device = device
        self.chunk_size = chunk_size

    @property
    def name(self) -> str:
        """Registry name ``"torch"``."""
        return "torch"

    def supports(self, dtype: torch.dtype) -> tuple[str, ...]:
        """Empty for fp32, bf16, fp16 and fp64 (computed in fp64); a reason for any other dtype."""
        if dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            return ()
        return (f"dtype {dtype} is not a floating dtype this kernel computes in (fp32, bf16, fp16, fp64)",)

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
        """Per-token fp32 log-probs ``[N]`` and entropy ``[N]`` (``None`` unless ``with_entropy``; fp64
        for fp64 input);
        contract of ``LogprobKernel.__call__`` (see ``underlay.ops.linear_logprobs``)."""
        return linear_logprobs(
            hidden,
            weight,
            labels,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=self.chunk_for(weight),
            vocab_group=vocab_group,
            softcap=softcap,
        )

    def chunk_for(self, weight: torch.Tensor) -> int:
        """Tokens per chunk for a ``[V_local, H]`` weight (the fixed ``chunk_size`` when given)."""
        if self.chunk_size is not None:
            return self.chunk_size
        vocab = int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 1
        return min(16384, max(1, self.CHUNK_ELEMENTS // max(vocab, 1)))

    def __repr__(self) -> str:
        return f"TorchLogprobKernel(device={getattr(self.device, 'name', self.device)!r}, chunk_size={self.chunk_size})"
