"""``fa4`` attention backend: FlashAttention-4 (the ``flash-attn-4`` package, CuTe DSL kernels) on Hopper
(sm90) and Blackwell (sm100) GPUs, through torch's own flash-attention dispatch.

torch lets a flash-attention implementation replace the CUDA kernels of
``aten::_flash_attention_forward/backward`` (``torch.nn.attention.register_flash_attention_impl`` and
``activate_flash_attention_impl``). This backend registers ``_fa4_glue``'s FA4 kernels as
``"underlay_fa4"``, activates them once, and then runs exactly the ``torch`` backend's code: packed input
through ``varlen_attn`` (FA4), padded input through SDPA (torch's own kernels: SDPA's flash op is not
overridden). Under ``torch.compile`` the compiled layer calls the same custom op as with ``torch``, and
the dispatcher sends it to FA4 at run time.

The activation is process-wide (that is how torch's registry works): from this kernel's first call (or
its first traceable function) on, every packed flash-attention call of the process, the ``torch``
backend's included, runs FA4. CuTe DSL compiles each kernel variant (dtype, head dim, causal, GQA
packing) on its first call, seconds each, once per process.

It lives with the portable kernels because its code is torch's API only (the FA4 package is imported
by name, by ``_fa4_glue``); ``supports`` confines it to cuda devices of those generations.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from underlay.backends.portable.attention import TorchAttention
from underlay.interfaces import AttentionSpec, BackendUnavailable, Device

__all__ = ["FA4Attention"]

_HALF = (torch.float16, torch.bfloat16)
_INSTALL = "install it with `pip install underlay[fa4]` (flash-attn-4 and its CuTe DSL) on a CUDA host"


class FA4Attention(TorchAttention):
    """``fa4``: FlashAttention-4 kernels for bf16/fp16 on compute capability 9.x and 10.x.

    Same call contract and code paths as ``torch`` (packed input through ``varlen_attn``, causal masks
    bottom-right aligned, native GQA), with FA4 behind torch's flash-attention ops. Head dims: on 9.x
    ``8 <= D, Dv <= 256``; on 10.x ``D, Dv <= 128`` or ``(D, Dv)`` in ``{(192, 128), (256, 256)}``; both
    multiples of 8. No softcap, sinks or dropout (as ``torch``).

    ``dense_uniform``: as ``TorchAttention``'s (equal-length packed causal batches through one batched
    SDPA call). Raises ``BackendUnavailable`` at construction when the device is not a CUDA GPU of compute
    capability 9.x or 10.x or flash-attn-4 cannot be imported, and at first use when this torch cannot
    register a flash-attention implementation (the registry's probe checks both packages first).
    """

    def __init__(self, device: Device, *, dense_uniform: bool = False) -> None:
        super().__init__(device, dense_uniform=dense_uniform)
        cap = device.capability() if device.name == "cuda" else None
        if cap is None or cap[0] not in (9, 10):
            raise BackendUnavailable(
                "attention",
                "fa4",
                f"FlashAttention-4 needs a CUDA GPU of compute capability 9.x or 10.x, this device is "
                f"{device.name!r} with capability {cap}",
                [],
                "use UNDERLAY_ATTENTION=torch or flash_attn on this device",
            )
        self._major = cap[0]
        try:  # the deeper check: the CuTe DSL and its MLIR libraries load
            importlib.import_module("flash_attn.cute.interface")
        except Exception as exc:
            raise BackendUnavailable(
                "attention",
                "fa4",
                f"importing flash_attn.cute failed: {type(exc).__name__}: {exc}",
                [],
                _INSTALL,
            ) from exc

    @property
    def name(self) -> str:
        """``"fa4"``."""
        return "fa4"

    def supports(self, spec: AttentionSpec) -> tuple[str, ...]:
        """The ``torch`` backend's reasons plus FA4's: cuda only, bf16/fp16 only, and its head dims."""
        reasons = list(super().supports(spec))
        if spec.device_type != "cuda":
            reasons.append(f"FA4 runs on cuda, not {spec.device_type}")
        if spec.dtype not in _HALF:
            reasons.append(f"FA4 needs bf16/fp16, not {spec.dtype}")
        d = spec.head_dim
        dv = spec.head_dim_v if spec.head_dim_v is not None else d
        if d % 8 or dv % 8:
            reasons.append(f"FA4 needs head dims that are multiples of 8 (got D={d}, Dv={dv})")
        elif self._major == 9 and not (8 <= d <= 256 and 8 <= dv <= 256):
            reasons.append(f"FA4 on compute capability 9.x needs 8 <= D, Dv <= 256 (got D={d}, Dv={dv})")
        elif self._major == 10 and not (d <= 128 and dv <= 128) and (d, dv) not in ((192, 128), (256, 256)):
            reasons.append(
                f"FA4 on compute capability 10.x needs D, Dv <= 128, (192, 128) or (256, 256) (got D={d}, Dv={dv})"
            )
        return tuple(reasons)

    def _require(self, spec: AttentionSpec) -> None:
        """``supports`` has no reason, then FA4 is activated (first use; see the module docstring)."""
        super()._require(spec)
        _activate()

    def traceable_varlen(self, spec: AttentionSpec) -> Callable[..., torch.Tensor] | None:
        """``torch``'s traceable ``varlen_attn`` call, with FA4 activated before any graph runs it."""
        fn = super().traceable_varlen(spec)
        if fn is not None:
            _activate()
        return fn


_IMPL = "underlay_fa4"  # aten's flash kernels overridden by ``_fa4_glue`` (see that module)


def _activate() -> None:
    """Route torch's flash-attention ops to FA4 in this process (once; idempotent)."""
    from torch.nn import attention

    if attention.current_flash_attention_impl() == _IMPL:
        return
    try:
        if _IMPL not in attention.list_flash_attention_impls():
            glue = importlib.import_module("underlay.backends.portable._fa4_glue")
            attention.register_flash_attention_impl(_IMPL, register_fn=glue.register)
        attention.activate_flash_attention_impl(_IMPL)
    except Exception as exc:  # an import or registration error of the optional package
        raise BackendUnavailable(
            "attention", "fa4", f"activating FA4 failed: {type(exc).__name__}: {exc}", [], _INSTALL
        ) from exc
