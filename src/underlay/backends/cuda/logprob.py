"""The ``triton`` LogprobKernel: fused linear -> log-prob (+ entropy) on CUDA GPUs."""

from __future__ import annotations

import math
from typing import Any

import torch

from underlay.interfaces import IGNORE_INDEX, Device, InvalidInput, LogprobOutput

__all__ = ["TritonLogprobKernel"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _group_rank_size(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInput(
            "vocab_group was given but torch.distributed is not initialised; call "
            "underlay.parallel.init_distributed() first or pass vocab_group=None"
        )
    return dist.get_rank(group=group), dist.get_world_size(group=group)


class TritonLogprobKernel:
    """``LogprobKernel`` backed by Triton kernels (see ``_logprob_triton``).

    Forward is one fused Triton pass (matmul tiles + online softmax statistics, workspace
    ``[N, ceil(V / 256)]`` fp32); backward recomputes logits tile-wise into a bounded dlogits chunk and
    uses cuBLAS for the two gradient matmuls. Inputs must live on a CUDA device (or on CPU when Triton's
    interpreter is on, ``TRITON_INTERPRET=1``, for tests). ``vocab_group`` follows the protocol: ``weight`` is
    rank ``r``'s shard ``[r * V_local, (r + 1) * V_local)``; statistics are all-reduced over the group and
    the hidden gradient is summed over it (each rank must call with the same hidden and labels).
    ``UNDERLAY_TRITON_LOGPROB_MODE=hybrid`` computes the logits blocks with cuBLAS instead (see
    ``_logprob_triton.fused_linear_logprobs``); an unknown value raises ``ConfigError``.
    """

    def __init__(self, device: Device) -> None:
        self._device = device

    @property
    def name(self) -> str:
        """Registry name ``"triton"``."""
        return "triton"

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
        """Per-token fp32 log-probs ``[N]`` and entropy ``[N]`` (``None`` unless ``with_entropy``).

        Raises ``InvalidInput`` on mismatched shapes, dtypes or devices, labels outside ``[0, V)`` other
        than ``IGNORE_INDEX``, or a temperature that is not a finite positive number.
        """
        from underlay.backends.cuda import _logprob_triton as impl

        offset, world = 0, 1
        if vocab_group is not None:
            rank, world = _group_rank_size(vocab_group)
            offset = rank * weight.shape[0] if weight.dim() == 2 else 0
        self._validate(hidden, weight, labels, temperature, world, impl.INTERPRET)
        lp, ent = impl.fused_linear_logprobs(
            hidden,
            weight,
            labels,
            temperature=temperature,
            with_entropy=with_entropy,
            group=vocab_group,
            label_offset=offset,
        )
        return LogprobOutput(log_probs=lp, entropy=ent)

    @staticmethod
    def _validate(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        world: int,
        interpret: bool,
    ) -> None:
        if hidden.dim() != 2 or weight.dim() != 2:
            raise InvalidInput(
                f"hidden must be [N, H] and weight [V, H]; got hidden {tuple(hidden.shape)}, "
                f"weight {tuple(weight.shape)}. Flatten batch dimensions into N first"
            )
        if hidden.shape[1] != weight.shape[1]:
            raise InvalidInput(
                f"hidden size mismatch: hidden has H={hidden.shape[1]}, weight has H={weight.shape[1]}"
            )
        if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
            raise InvalidInput(
                f"labels must be [N] with N={hidden.shape[0]}; got shape {tuple(labels.shape)}"
            )
        if labels.dtype != torch.int64:
            raise InvalidInput(f"labels must be int64, got {labels.dtype}; use labels.long()")
        if hidden.dtype not in _DTYPES or weight.dtype != hidden.dtype:
            raise InvalidInput(
                f"hidden and weight must share one dtype among bf16/fp16/fp32; got {hidden.dtype} and "
                f"{weight.dtype}"
            )
        devices = {hidden.device, weight.device, labels.device}
        if len(devices) != 1:
            raise InvalidInput(
                f"hidden, weight and labels must be on one device, got {sorted(map(str, devices))}"
            )
        if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
            raise InvalidInput(f"temperature must be a finite number > 0, got {temperature!r}")
        if weight.shape[0] == 0 or hidden.shape[1] == 0:
            raise InvalidInput(
                f"weight must have at least one vocabulary row and H >= 1; got {tuple(weight.shape)}"
            )
        if labels.numel():
            v_total = weight.shape[0] * world
            bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= v_total)
            if bool(bad.any()):
                first = int(labels[bad][0])
                raise InvalidInput(
                    f"labels must lie in [0, {v_total}) or equal {IGNORE_INDEX}; found {first}"
                )
        if hidden.device.type != "cuda" and not (interpret and hidden.device.type == "cpu"):
            raise InvalidInput(
                f"the triton logprob kernel needs CUDA tensors, got {hidden.device}; move them with "
                f".cuda() or select UNDERLAY_LOGPROB_KERNEL=torch"
            )
