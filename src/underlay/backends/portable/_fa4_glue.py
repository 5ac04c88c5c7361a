"""FA4 behind ``aten::_flash_attention_forward/backward`` on CUDA: the implementations the ``fa4`` backend
registers through ``torch.nn.attention.register_flash_attention_impl``.

torch's ``varlen_attn`` (the ``torch`` backend's packed path, also inside compiled layers) calls these two
aten ops; overriding their CUDA kernels sends it to flash-attn-4 with the same shapes (``out [T, Hq, Dv]``,
``lse [Hq, T]`` fp32), so the ops' meta functions, hence ``torch.compile``, stay valid. torch ships its
own FA4 glue (``torch/nn/attention/_fa4.py``), but its versions lag flash-attn-4's: torch 2.11's rejects
the causal window ``(-1, 0)`` that ``varlen_attn`` passes to the backward, and expects two values where
flash-attn-4 4.0.0b36's forward returns five. SDPA's own flash op (padded input) is not overridden.

Imported only when the ``fa4`` backend activates FA4 (it imports ``flash_attn.cute``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from flash_attn.cute import interface as _fa4

__all__ = ["register"]


@dataclass
class _Handle:
    """Keeps the override alive; ``remove()`` drops it (torch's registry calls it on restore)."""

    library: torch.library.Library | None

    def remove(self) -> None:
        self.library = None


def _fa4_kwargs(
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    scale: float | None,
    is_causal: bool,
    left: int | None,
    right: int | None,
) -> dict[str, Any]:
    """aten's packing, scale and mask arguments as FA4's keywords. Windows: ``-1``/``None`` is
    unbounded; ``varlen_attn`` spells plain causal as the window ``(-1, 0)``, which is ``causal=True``."""
    lo = None if left is None or left < 0 else int(left)
    hi = None if right is None or right < 0 else int(right)
    if is_causal and lo is None and hi == 0:
        hi = None
    return {
        "cu_seqlens_q": cum_seq_q,
        "cu_seqlens_k": cum_seq_k,
        "max_seqlen_q": max_q if cum_seq_q is not None else None,
        "max_seqlen_k": max_k if cum_seq_k is not None else None,
        "softmax_scale": scale,
        "causal": bool(is_causal),
        "window_size_left": lo,
        "window_size_right": hi,
    }


def _check(
    query: torch.Tensor,
    dropout_p: float,
    *,
    return_debug_mask: bool = False,
    tensors: dict[str, torch.Tensor | None] | None = None,
    num_splits: int | None = None,
) -> None:
    """Refuse what FA4 does not do here (dropout, debug masks, ALiBi, paged or ``seqused_k`` KV,
    split-KV) and dtypes other than bf16/fp16, naming the argument."""
    if dropout_p != 0.0:
        raise RuntimeError(f"fa4: dropout_p={dropout_p} is not supported (FA4 has no dropout)")
    given = [name for name, t in (tensors or {}).items() if t is not None]
    if return_debug_mask:
        given.append("return_debug_mask=True")
    if num_splits not in (None, 0, 1):
        given.append(f"num_splits={num_splits}")
    if given:
        raise RuntimeError(
            f"fa4: {given} are not supported by underlay's FA4 override; use UNDERLAY_ATTENTION=torch"
        )
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"fa4: query dtype {query.dtype} is not bf16/fp16")


def _forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    return_debug_mask: bool,
    *,
    scale: float | None = None,
    window_size_left: int | None = None,
    window_size_right: int | None = None,
    seqused_k: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(
        query,
        dropout_p,
        return_debug_mask=return_debug_mask,
        tensors={"alibi_slopes": alibi_slopes, "seqused_k": seqused_k, "block_table": block_table},
        num_splits=num_splits,
    )
    out, lse = _fa4._flash_attn_fwd(
        query,
        key,
        value,
        return_lse=True,
        **_fa4_kwargs(
            cum_seq_q, cum_seq_k, max_q, max_k, scale, is_causal, window_size_left, window_size_right
        ),
    )[:2]
    device = query.device
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=device)
    philox_offset = torch.zeros((), dtype=torch.uint64, device=device)
    return out, lse.contiguous(), rng_state, philox_offset, torch.empty(0, dtype=query.dtype, device=device)


def _backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    rng_state: torch.Tensor,
    unused: torch.Tensor,
    *,
    scale: float | None = None,
    window_size_left: int | None = None,
    window_size_right: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(query, dropout_p)
    dq, dk, dv = _fa4._flash_attn_bwd(
        query,
        key,
        value,
        out,
        grad_out,
        logsumexp.contiguous(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        **_fa4_kwargs(
            cum_seq_q, cum_seq_k, max_q, max_k, scale, is_causal, window_size_left, window_size_right
        ),
    )[:3]
    return dq, dk, dv


def register() -> _Handle:
    """Override the CUDA kernels of ``aten::_flash_attention_forward/backward`` with FA4 (what
    ``register_flash_attention_impl`` calls on activation)."""
    # overriding aten's CUDA kernels is the point
    lib = torch.library.Library("aten", "IMPL", "CUDA")  # type: ignore[no-untyped-call]
    lib.impl("_flash_attention_forward", _forward, "CUDA")  # type: ignore[no-untyped-call]
    lib.impl("_flash_attention_backward", _backward, "CUDA")  # type: ignore[no-untyped-call]
    return _Handle(lib)
