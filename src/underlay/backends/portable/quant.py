"""The ``torch`` Fp8Quantizer: blockwise e4m3 quantisation in plain torch on any device."""

from __future__ import annotations

import torch

from underlay.interfaces import Device
from underlay.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

__all__ = ["TorchFp8Quantizer"]


class TorchFp8Quantizer:
    """``Fp8Quantizer`` over :mod:`underlay.ops.quant`; runs wherever the tensors are.

    Bit-identical to the ``triton`` quantiser (both divide in IEEE fp32 and round to nearest even).
    """

    def __init__(self, device: Device) -> None:
        self._device = device

    @property
    def name(self) -> str:
        """Registry name ``"torch"``."""
        return "torch"

    def quantize(
        self, weight: torch.Tensor, block: tuple[int, int] = (128, 128)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [M, K] float8_e4m3fn, scales [ceil(M/bm), ceil(K/bk)] float32)``; see
        :func:`underlay.ops.quant.quantize_fp8_blockwise` for the contract and errors."""
        return quantize_fp8_blockwise(weight, block)

    def dequantize(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        block: tuple[int, int] = (128, 128),
        dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """``q * scale`` per tile in ``dtype``; see :func:`underlay.ops.quant.dequantize_fp8_blockwise`."""
        return dequantize_fp8_blockwise(q, scales, block, dtype)
