"""Rotary position embedding over a whole packed (THD) micro-batch in a fixed number of kernels.

Why: megatron-core's unfused THD RoPE (``_apply_rotary_pos_emb_thd``, used without Transformer
Engine) splits the packed tensor per sequence and, in 0.19, computes cos/sin and applies the rotation
once per sequence (plus a host sync on ``cu_seqlens``): thousands of tiny launches per step. Here the
per-token positions are derived on the device from ``cu_seqlens`` (restarting at every sequence; under
context parallelism the positions of this rank's two load-balanced chunks), cos/sin are computed once
per micro-batch, and q/k are rotated with ``x * cos + rotate_half(x) * sin``.

Numerics match megatron's unfused path exactly: the angles are ``position * inv_freq`` in float32 with
megatron's own ``RotaryEmbedding.inv_freq`` (as ``torch.outer(arange, inv_freq)`` computes them),
cos/sin are taken in float32 and cast to the input dtype, and the rotation is the same expression.
Only non-interleaved RoPE over the full head dimension is supported (what the HF conversion produces).
"""

from __future__ import annotations

from typing import Any

import torch

from underlay.interfaces import ConfigError

__all__ = ["apply_rope", "packed_positions", "rope_cos_sin", "rope_inv_freq"]


def rope_inv_freq(config: Any, rotary_base: float) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies from megatron-core's ``RotaryEmbedding`` built as
    ``GPTModel`` builds it (``kv_channels``, ``rotary_percent=1``, ``rotary_base``, no scaling), on the
    CPU when ``config.use_cpu_initialization`` (the engine's setting), else on the current device.
    ``ConfigError`` for interleaved RoPE or an odd head dimension."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if bool(getattr(config, "rotary_interleaved", False)):
        raise ConfigError("mcore: interleaved RoPE (config.rotary_interleaved=True) is not supported")
    head_dim = int(config.kv_channels)
    if head_dim % 2:
        raise ConfigError(f"mcore: RoPE needs an even head dimension, got kv_channels={head_dim}")
    rotary = RotaryEmbedding(
        kv_channels=head_dim,
        rotary_percent=1.0,
        rotary_interleaved=False,
        rotary_base=rotary_base,
        use_cpu_initialization=bool(config.use_cpu_initialization),
        cp_group=None,
    )
    inv_freq: torch.Tensor = rotary.inv_freq
    return inv_freq


def packed_positions(
    cu_seqlens: torch.Tensor, tokens: int, cp_size: int = 1, cp_rank: int = 0
) -> torch.Tensor:
    """``[tokens]`` int64 rotary position of every local token of a packed micro-batch, on the device of
    ``cu_seqlens``, without a host sync.

    ``cu_seqlens``: ``[n + 1]`` integer GLOBAL cumulative lengths (under context parallelism the padded
    ones, every length a multiple of ``2 * cp_size``); ``tokens`` = ``cu_seqlens[-1] // cp_size`` (the
    local token count; not checked, to avoid a sync). Without CP sequence ``i`` holds positions
    ``0 .. L_i - 1``. With CP each sequence's local share is ``2c = L_i / cp_size`` tokens: the first
    ``c`` get positions ``[r c, (r + 1) c)`` and the last ``c`` get ``[L_i - (r + 1) c, L_i - r c)``
    (``r`` = ``cp_rank``), megatron's load-balanced layout (``_get_thd_freqs_on_this_cp_rank``)."""
    cu = cu_seqlens.to(torch.int64)
    idx = torch.arange(tokens, dtype=torch.int64, device=cu.device)
    if cp_size == 1:
        seq = torch.searchsorted(cu[1:], idx, right=True)
        return idx - cu[seq]
    local = torch.div(cu, cp_size, rounding_mode="floor")  # local cumulative lengths
    seq = torch.searchsorted(local[1:], idx, right=True)
    start = local[seq]
    half = torch.div(local[seq + 1] - start, 2, rounding_mode="floor")  # c
    a = idx - start
    full = cu[seq + 1] - cu[seq]  # L_i
    front = cp_rank * half + a
    back = full - (cp_rank + 1) * half + (a - half)
    return torch.where(a < half, front, back)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[*positions.shape, 1, 2 * len(inv_freq)]`` in ``dtype`` (a heads axis of
    1 to broadcast over ``[..., heads, head_dim]``): angles ``position * inv_freq`` in float32,
    duplicated over the two halves of the head dimension, cos/sin in float32, then cast."""
    inv = inv_freq.to(device=positions.device, dtype=torch.float32)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv
    emb = torch.cat((angles, angles), dim=-1).unsqueeze(-2)
    return torch.cos(emb).to(dtype), torch.sin(emb).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` over the last axis
    (``x1``/``x2`` its halves); ``x [..., heads, head_dim]``, ``cos``/``sin`` broadcastable to it, same
    dtype. Returns a tensor of ``x``'s shape and dtype."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out: torch.Tensor = (x * cos) + (rotated * sin)
    return out
