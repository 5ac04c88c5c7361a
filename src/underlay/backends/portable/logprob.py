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
    any device as long as they agree). ``chunk_size`` bounds the fp32 ``[chunk, V_local]`` buffers.
    """

    def __init__(self, device: Device, chunk_size: int = 4096) -> None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise InvalidInput(f"TorchLogprobKernel: chunk_size={chunk_size!r} must be an int >= 1")
        self.device = device
        self.chunk_size = chunk_size

    @property
    def name(self) -> str:
        """Registry name ``"torch"``."""
        return "torch"

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float = 1.0,
        with_entropy: bool = True,
        vocab_group: Any | None = None,
    ) -> LogprobOutput:
        """Per-token fp32 log-probs ``[N]`` and entropy ``[N]`` (``None`` unless ``with_entropy``);
        contract of ``LogprobKernel.__call__`` (see ``underlay.ops.linear_logprobs``)."""
        return linear_logprobs(
            hidden,
            weight,
            labels,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=self.chunk_size,
            vocab_group=vocab_group,
        )

    def __repr__(self) -> str:
        return f"TorchLogprobKernel(device={getattr(self.device, 'name', self.device)!r}, chunk_size={self.chunk_size})"
