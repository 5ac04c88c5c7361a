"""The ``triton`` LogprobKernel: fused linear -> log-prob (+ entropy) on CUDA GPUs."""

from __future__ import annotations

from typing import Any, Literal

import torch

from underlay.interfaces import Device, InvalidInput, LogprobOutput
from underlay.ops.logprob import check_logprob_args, check_softcap

__all__ = ["TritonLogprobKernel"]


def _dtype_reasons(dtype: torch.dtype) -> tuple[str, ...]:
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        return ()
    if dtype == torch.float64:
        return (
            "the triton logprob kernel computes in fp32 and does not take float64; use the torch kernel "
            "(UNDERLAY_LOGPROB_KERNEL=torch), which computes float64 input in float64",
        )
    return (f"dtype {dtype} is not one of float32, bfloat16, float16",)


class TritonLogprobKernel:
    """``LogprobKernel`` backed by Triton kernels (see ``_logprob_triton``).

    Forward is one fused Triton pass (matmul tiles + online softmax statistics, workspace
    ``[N, ceil(V / 256)]`` fp32); backward recomputes logits tile-wise into a bounded dlogits chunk and
    uses cuBLAS for the two gradient matmuls. Workspace is bounded independently of ``V``.

    Tuning options, fixed for the object's life (the defaults are the measured fastest; benchmarks and
    tests construct kernels with the others): ``mode="hybrid"`` computes the logits blocks with cuBLAS
    (fp32 output) and reads them with the same kernels (default ``"fused"``: ``tl.dot`` tiles in Triton);
    ``tma`` is how the fused kernels move tiles on sm90+ GPUs: ``"store"`` (default) loads the GEMM tiles
    and stores the dlogits tiles through TMA descriptors, ``"load"`` only loads through them, ``"off"``
    uses pointer loads and stores. A value outside those raises ``ConfigError`` here. See
    ``_logprob_triton.fused_linear_logprobs``.

    Inputs must live on a CUDA device (or on CPU when Triton's interpreter is on, ``TRITON_INTERPRET=1``,
    for tests). ``vocab_group`` follows the protocol: ``weight``
    is rank ``r``'s shard ``[r * V_local, (r + 1) * V_local)``; statistics are all-reduced over the group
    and the hidden gradient is summed over it (each rank must call with the same hidden and labels).
    """

    def __init__(
        self,
        device: Device,
        mode: Literal["fused", "hybrid"] = "fused",
        tma: Literal["store", "load", "off"] = "store",
    ) -> None:
        from underlay.backends.cuda._logprob_triton import check_mode, check_tma

        self._device = device
        self._mode = check_mode(mode, "TritonLogprobKernel(mode=...)")
        self._tma = check_tma(tma, "TritonLogprobKernel(tma=...)")

    @property
    def mode(self) -> Literal["fused", "hybrid"]:
        """How the logits tiles are made: ``"fused"`` (``tl.dot`` in Triton) or ``"hybrid"`` (cuBLAS)."""
        return self._mode

    @property
    def tma(self) -> Literal["store", "load", "off"]:
        """How the fused kernels move tiles where TMA is usable: ``"store"``, ``"load"`` or ``"off"``."""
        return self._tma

    @property
    def name(self) -> str:
        """Registry name ``"triton"``."""
        return "triton"

    def supports(self, dtype: torch.dtype) -> tuple[str, ...]:
        """Empty for fp32, bf16 and fp16. fp64 is refused: the kernels compute in fp32 (``tl.dot`` has no
        fp64 path worth having); ``UNDERLAY_LOGPROB_KERNEL=torch`` computes fp64 input in fp64."""
        return _dtype_reasons(dtype)

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
        """Per-token fp32 log-probs ``[N]`` and entropy ``[N]`` (``None`` unless ``with_entropy``);
        ``softcap`` caps the logits inside the same tiles (see ``LogprobKernel``).

        Raises ``InvalidInput`` on mismatched shapes, dtypes or devices, labels outside ``[0, V)`` other
        than ``IGNORE_INDEX``, or a temperature that is not a finite positive number.
        """
        from underlay.backends.cuda import _logprob_triton as impl

        offset = self._validate(hidden, weight, labels, temperature, vocab_group, impl.INTERPRET)
        cap = check_softcap(softcap, "triton logprob kernel")
        lp, ent = impl.fused_linear_logprobs(
            hidden,
            weight,
            labels,
            temperature=temperature,
            with_entropy=with_entropy,
            group=vocab_group,
            label_offset=offset,
            mode=self._mode,
            tma=self._tma,
            softcap=cap,
        )
        return LogprobOutput(log_probs=lp, entropy=ent)

    @staticmethod
    def _validate(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        vocab_group: Any | None,
        interpret: bool,
    ) -> int:
        """The shared argument checks, plus: the tensors are on CUDA (or cpu under the interpreter)
        and labels are int64. Returns this rank's vocabulary offset."""
        rank, _ = check_logprob_args(
            hidden, weight, labels, temperature, vocab_group, "triton logprob kernel"
        )
        if reasons := _dtype_reasons(hidden.dtype):
            raise InvalidInput(f"triton logprob kernel: {'; '.join(reasons)}")
        if labels.dtype != torch.int64:
            raise InvalidInput(
                f"triton logprob kernel: labels must be int64, got {labels.dtype}; use labels.long()"
            )
        if hidden.device.type != "cuda" and not (interpret and hidden.device.type == "cpu"):
            raise InvalidInput(
                f"the triton logprob kernel needs CUDA tensors, got {hidden.device}; move them with "
                f".cuda() or select UNDERLAY_LOGPROB_KERNEL=torch"
            )
        return rank * weight.shape[0]
