"""Triton kernels and the autograd function behind :class:`TritonLogprobKernel`.

Forward: one program per ``[BLOCK_N, BLOCK_V]`` tile of ``z = hidden @ weight.T / T`` (fp32 ``tl.dot``
accumulation over ``H``); each program writes its per-row partial statistics (max ``m``, ``sum exp(z - m)``,
``sum exp(z - m) * z``) into an ``[N, cdiv(V, BLOCK_V)]`` fp32 workspace and the label logit of the rows
whose label falls inside its columns. A few torch reductions combine the partials (and, with a vocabulary
group, all-reduce them). The ``[N, V]`` logits never exist.

Backward: the vocabulary is walked in chunks of ``v_chunk`` columns and the rows in splits of ``row_split``
rows. A Triton kernel recomputes the logits tile by tile and writes ``dlogits`` for one ``[rows, v_chunk]``
chunk (dtype of the inputs); two cuBLAS matmuls turn it into ``grad_weight[chunk]`` and a fp32 accumulator of
``grad_hidden[rows]``. Workspace: one dlogits chunk plus the fp32 accumulator, both bounded by
``_BWD_BUDGET_BYTES`` independently of ``V`` (in hybrid mode the fp32 logits block and the dlogits chunk
share one budget).

Operand tiles of the ``tl.dot`` GEMMs are loaded through Hopper's tensor-memory accelerator (host-side
``TensorDescriptor``s, a persistent grid of one program per multiprocessor walking the tiles) where the
device and the operands allow it (:func:`tma_usable`), and through pointer loads otherwise; the TMA loads
brought both kernels from about 540 / 430 TFLOP/s to about 650 on the H200 (``benchmarks/results/logprob.md``
holds the current figures of every ``tma`` setting). The ``tma`` option (:data:`TMA_SETTINGS`): ``store`` (the default)
also stores the dlogits tiles through a TMA descriptor (a masked pointer store cannot vectorise with
unspecialised N and V); ``load`` loads the GEMM tiles through TMA and stores dlogits with masked pointer
stores; ``off`` uses pointer loads and stores. All three pass the same float64 bounds.

The ``mode`` option (:data:`MODES`) picks how the logits tiles are made: ``fused`` (the default) computes
them with ``tl.dot`` inside the kernels; ``hybrid`` computes cuBLAS ``[rows, v_chunk]`` logits blocks with
fp32 output, read by the same kernels (``FROM_LOGITS``). Both options are arguments of
:func:`fused_linear_logprobs` and of ``TritonLogprobKernel``, fixed per kernel object, never process state.

Setting ``TRITON_INTERPRET=1`` before this module is imported runs every kernel in Triton's interpreter on
CPU tensors (slow; small shapes only) with one small tile configuration instead of autotuning.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3: host-side descriptors for Hopper's tensor-memory accelerator
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

from underlay.backends.cuda._interpret import triton_interprets
from underlay.interfaces import ConfigError

__all__ = [
    "DEFAULT_MODE",
    "DEFAULT_TMA",
    "INTERPRET",
    "MODES",
    "TMA_SETTINGS",
    "LogprobMode",
    "TmaSetting",
    "check_mode",
    "check_tma",
    "fused_linear_logprobs",
    "mm_fp32",
    "mm_path",
    "plan_backward",
    "tma_usable",
]

LogprobMode = Literal["fused", "hybrid"]
"""Values of the ``mode`` option."""
TmaSetting = Literal["store", "load", "off"]
"""Values of the ``tma`` option."""

MODES: tuple[LogprobMode, ...] = ("hybrid", "fused")
"""Ways to produce the logits tiles: cuBLAS blocks read by Triton ("hybrid") or ``tl.dot`` in Triton."""
DEFAULT_MODE: LogprobMode = "fused"
"""The default mode. Hybrid's fp32 logits blocks cost memory traffic per FLOP in proportion to 1/H, so it
can only win at large hidden sizes; fused is the one that does not lose inside a training step at the
hidden sizes RL actors use (``benchmarks/results/logprob.md``; inside the Qwen2-1.5B fsdp2 step,
H=1536, hybrid cost 2 MFU points)."""

INTERPRET = triton_interprets()
"""Whether the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET`` as Triton reads it).
Read at import on purpose: Triton decides this when the kernels below are defined, so a later change
cannot take effect in this process."""

_UPCAST = tl.constexpr(INTERPRET)
"""The interpreter's ``tl.dot`` mishandles 16-bit floats: upcast operands to fp32 there (exact products)."""
_BWD_BUDGET_BYTES = 128 << 20
"""Target size of each backward buffer (dlogits chunk, fp32 grad_hidden accumulator)."""


_SHAPES = (
    # BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (64, 256, 64, 4, 4),
    (128, 256, 32, 8, 5),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 64, 32, 4, 3),
    (64, 64, 32, 4, 3),
)


_READ_SHAPES = (
    # BLOCK_N, BLOCK_V, num_warps: tiles for reading an fp32 logits buffer (no K loop, so no stages).
    # Few rows per tile keep the fp32 tile and its exponentials in registers; the matmul tiles above hold
    # too many rows for that and read the buffer at a fraction of memory bandwidth (measured on the
    # H200 when these tiles were chosen; benchmarks/results/logprob.md has the kernel's current figures).
    (8, 256, 4),
    (16, 256, 4),
    (32, 256, 8),
    (16, 64, 4),
    (32, 64, 4),
    (64, 64, 4),
    (16, 128, 4),
    (32, 128, 4),
)


_TMA_SHAPES = (
    # BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages: tiles of the TMA-loaded persistent kernels
    # (the best of the tile shapes measured on the H200; figures: benchmarks/results/logprob.md)
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 8, 5),
    (256, 128, 64, 8, 3),
)


def _set_block_shapes(nargs: dict[str, Any]) -> None:
    """Autotune pre-hook of the TMA configs: a descriptor's block shape is the config's tile."""
    if TensorDescriptor is None:
        return
    shapes = {
        "h_ptr": [nargs["BLOCK_N"], nargs["BLOCK_K"]],
        "w_ptr": [nargs["BLOCK_V"], nargs["BLOCK_K"]],
        "d_ptr": [nargs["BLOCK_N"], nargs["BLOCK_V"]],
    }
    for name, shape in shapes.items():
        if isinstance(nargs.get(name), TensorDescriptor):
            nargs[name].block_shape = shape


def _configs() -> list[triton.Config]:
    if INTERPRET:  # one config (the interpreter cannot time configs); the pre-hook serves both load paths
        return [
            triton.Config(
                {"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_K": 16, "GROUP_N": 2}, pre_hook=_set_block_shapes
            )
        ]
    tma = [
        triton.Config(
            {"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk, "GROUP_N": 8},
            num_warps=w,
            num_stages=s,
            pre_hook=_set_block_shapes,
        )
        for bn, bv, bk, w, s in _TMA_SHAPES
    ]
    matmul = [
        triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk, "GROUP_N": 8}, num_warps=w, num_stages=s)
        for bn, bv, bk, w, s in _SHAPES
    ]
    read = [
        triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": 16, "GROUP_N": 8}, num_warps=w, num_stages=1)
        for bn, bv, w in _READ_SHAPES
    ]
    return tma + matmul + read


def fwd_block_v(dtype: torch.dtype) -> int:
    """BLOCK_V of the forward kernel for ``dtype``; fixes the partial-statistics workspace width."""
    if INTERPRET:
        return 32
    return 64 if dtype == torch.float32 else 256


def _dtype(arg: Any) -> torch.dtype:
    """The dtype of a kernel operand: a tensor or a ``TensorDescriptor`` over one."""
    tensor = arg.base if TensorDescriptor is not None and isinstance(arg, TensorDescriptor) else arg
    dtype: torch.dtype = tensor.dtype
    return dtype


def _from_logits(nargs: dict[str, Any], kwargs: dict[str, Any]) -> bool:
    return bool(kwargs.get("FROM_LOGITS", nargs.get("FROM_LOGITS", False)))


def _prune_fwd(configs: list[triton.Config], nargs: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """Keep the configs of the right kind whose BLOCK_V matches the workspace allocated for this dtype."""
    dtype = _dtype(nargs["w_ptr"])
    bv = fwd_block_v(dtype)
    return [c for c in _of_kind(configs, nargs, kwargs) if c.kwargs["BLOCK_V"] == bv]


def _of_kind(
    configs: list[triton.Config], nargs: dict[str, Any], kwargs: dict[str, Any]
) -> list[triton.Config]:
    """The read-tile configs (``num_stages == 1``) when reading a logits buffer; else the TMA configs
    (those with the block-shape pre-hook) when the operands are descriptors, the pointer matmul ones
    when not."""
    if INTERPRET:
        return configs
    if _from_logits(nargs, kwargs):
        return [c for c in configs if c.num_stages == 1]
    tma = bool(kwargs.get("USE_TMA", nargs.get("USE_TMA", False)))
    return [c for c in configs if c.num_stages > 1 and (c.pre_hook is not None) == tma]


def _prune_bwd(configs: list[triton.Config], nargs: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """The configs of the right kind; fp32 matmul tiles need half the block size to fit shared memory."""
    keep = _of_kind(configs, nargs, kwargs)
    if _from_logits(nargs, kwargs) or _dtype(nargs["w_ptr"]) != torch.float32 or INTERPRET:
        return keep
    return [c for c in keep if c.kwargs["BLOCK_K"] == 32]


# The token count N changes with every micro-batch, and so does the backward's vocabulary chunk (its width
# follows from N) and with it V of the chunk kernels. Neither may cost a one-time compilation or tuning in
# the middle of a training run (a slow step each time a new value comes):
# - the autotune key is the hidden size, the flags and (implicitly) the dtypes, never N or V, so a config
#   is tuned once per model; the tiles do not depend on V;
# - N, V and the label offset only bound masks and shift ids, so the kernels are compiled without Triton's
#   specialisation of integer arguments divisible by 16 (or equal to 1), which would compile again the
#   first time such a value comes.
_NO_SPECIALISE = ("N", "V", "label_offset")
_TUNE_KEY = ["H", "WITH_ENTROPY", "FROM_LOGITS", "USE_TMA"]

_EVEN_K = {"EVEN_K": lambda args: bool(args.get("FROM_LOGITS")) or args["H"] % args["BLOCK_K"] == 0}
"""No K masking when H is a multiple of BLOCK_K (and no K loop at all when reading a logits buffer)."""


@triton.jit  # type: ignore[untyped-decorator]
def _tile_of(tile, N, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, GROUP_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """``(pid_n, pid_v)`` of linear tile number ``tile``: tiles are grouped by ``GROUP_N`` row blocks so
    neighbours share weight tiles in L2."""
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_N * tl.cdiv(V, BLOCK_V)
    first_n = (tile // per_group) * GROUP_N
    size = min(num_n - first_n, GROUP_N)
    return first_n + (tile % per_group) % size, (tile % per_group) // size


@triton.jit  # type: ignore[untyped-decorator]
def _program_logits(  # type: ignore[no-untyped-def]
    h_ptr,
    w_ptr,
    pid_n,
    pid_v,
    N,
    V,
    H,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    inv_t,
    cap,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
    USE_TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Tile ``(pid_n, pid_v)``: ``(offs_n, offs_v, z)`` with ``z = hidden[offs_n] @ weight[offs_v].T *
    inv_t`` (with ``SOFTCAP``: ``cap * tanh(hidden @ weight.T / cap) * inv_t``) in fp32 (masked rows/columns read zeros). With ``USE_TMA`` ``h_ptr``/``w_ptr`` are
    ``TensorDescriptor``s (out-of-bounds blocks read zeros); with ``FROM_LOGITS`` the tile is read from an
    fp32 logits buffer at ``h_ptr`` (strides ``stride_hn``, ``stride_hk``) instead of being computed."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    n_mask = offs_n < N
    v_mask = offs_v < V
    if FROM_LOGITS:
        ptrs = h_ptr + offs_n.to(tl.int64)[:, None] * stride_hn + offs_v[None, :] * stride_hk
        acc = tl.load(ptrs, mask=n_mask[:, None] & v_mask[None, :], other=0.0)
    elif USE_TMA:
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            a = h_ptr.load([pid_n * BLOCK_N, k * BLOCK_K])
            b = w_ptr.load([pid_v * BLOCK_V, k * BLOCK_K])
            if _UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + offs_n.to(tl.int64)[:, None] * stride_hn + offs_k[None, :] * stride_hk
        w_ptrs = w_ptr + offs_v.to(tl.int64)[None, :] * stride_wv + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            if EVEN_K:
                a = tl.load(h_ptrs, mask=n_mask[:, None], other=0.0)
                b = tl.load(w_ptrs, mask=v_mask[None, :], other=0.0)
            else:
                k_left = H - k * BLOCK_K
                a = tl.load(h_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(w_ptrs, mask=v_mask[None, :] & (offs_k[:, None] < k_left), other=0.0)
            if _UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            h_ptrs += BLOCK_K * stride_hk
            w_ptrs += BLOCK_K * stride_wk
    z = acc * inv_t
    if SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without inf - inf
        z = (1.0 - 2.0 / (tl.exp(2.0 * (acc / cap)) + 1.0)) * (cap * inv_t)
    return offs_n, offs_v, z


@triton.jit  # type: ignore[untyped-decorator]
def _fwd_tile(  # type: ignore[no-untyped-def]
    tile, h_ptr, w_ptr, lab_ptr, m_ptr, s_ptr, t_ptr, zl_ptr, N, V, H, label_offset, inv_t, cap,
    stride_hn, stride_hk, stride_wv, stride_wk, stride_ws,
    WITH_ENTROPY: tl.constexpr, PRECISION: tl.constexpr, FROM_LOGITS: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One tile's softmax partials: row max, sum exp, sum exp * z into column ``pid_v`` of the
    workspace, and the label logit of the rows whose label falls inside the tile."""
    pid_n, pid_v = _tile_of(tile, N, V, BLOCK_N, BLOCK_V, GROUP_N)
    offs_n, offs_v, z = _program_logits(
        h_ptr, w_ptr, pid_n, pid_v, N, V, H, stride_hn, stride_hk, stride_wv, stride_wk, inv_t, cap,
        BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, PRECISION, FROM_LOGITS, USE_TMA, SOFTCAP,
    )  # fmt: skip
    n_mask = offs_n < N
    v_mask = offs_v < V
    z = tl.where(v_mask[None, :], z, float("-inf"))
    m = tl.max(z, 1)
    e = tl.exp2((z - m[:, None]) * 1.4426950408889634)
    ws = offs_n.to(tl.int64) * stride_ws + pid_v
    tl.store(m_ptr + ws, m, mask=n_mask)
    tl.store(s_ptr + ws, tl.sum(e, 1), mask=n_mask)
    if WITH_ENTROPY:
        tl.store(t_ptr + ws, tl.sum(e * tl.where(v_mask[None, :], z, 0.0), 1), mask=n_mask)
    local = tl.load(lab_ptr + offs_n, mask=n_mask, other=-1) - label_offset
    lo = pid_v * BLOCK_V
    hit = n_mask & (local >= lo) & (local < lo + BLOCK_V) & (local < V)
    zl = tl.sum(tl.where(offs_v[None, :] == local[:, None], z, 0.0), 1)
    tl.store(zl_ptr + offs_n, zl, mask=hit)


@triton.autotune(
    configs=_configs(),
    key=_TUNE_KEY,
    prune_configs_by={"early_config_prune": _prune_fwd},
)  # type: ignore[untyped-decorator]
@triton.heuristics(_EVEN_K)  # type: ignore[untyped-decorator]
@triton.jit(do_not_specialize=_NO_SPECIALISE)  # type: ignore[untyped-decorator]
def _fwd_kernel(  # type: ignore[no-untyped-def]
    h_ptr,
    w_ptr,
    lab_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    zl_ptr,
    N,
    V,
    H,
    label_offset,
    inv_t,
    cap,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    stride_ws,
    WITH_ENTROPY: tl.constexpr,
    PRECISION: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
    USE_TMA: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
):
    """With ``USE_TMA`` a persistent grid of ``NUM_PROGRAMS`` programs walks all tiles; else one
    program per tile."""
    if USE_TMA:
        for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_N) * tl.cdiv(V, BLOCK_V), NUM_PROGRAMS):
            _fwd_tile(
                tile, h_ptr, w_ptr, lab_ptr, m_ptr, s_ptr, t_ptr, zl_ptr, N, V, H, label_offset, inv_t, cap,
                stride_hn, stride_hk, stride_wv, stride_wk, stride_ws, WITH_ENTROPY, PRECISION, FROM_LOGITS,
                USE_TMA, BLOCK_N, BLOCK_V, BLOCK_K, GROUP_N, EVEN_K, SOFTCAP,
            )  # fmt: skip
    else:
        _fwd_tile(
            tl.program_id(0), h_ptr, w_ptr, lab_ptr, m_ptr, s_ptr, t_ptr, zl_ptr, N, V, H, label_offset, inv_t,
            cap, stride_hn, stride_hk, stride_wv, stride_wk, stride_ws, WITH_ENTROPY, PRECISION, FROM_LOGITS,
            USE_TMA, BLOCK_N, BLOCK_V, BLOCK_K, GROUP_N, EVEN_K, SOFTCAP,
        )  # fmt: skip


@triton.jit  # type: ignore[untyped-decorator]
def _bwd_tile(  # type: ignore[no-untyped-def]
    tile, h_ptr, w_ptr, lab_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, d_ptr, N, V, H, label_offset, inv_t, cap,
    stride_hn, stride_hk, stride_wv, stride_wk, stride_dn,
    WITH_ENTROPY: tl.constexpr, PRECISION: tl.constexpr, FROM_LOGITS: tl.constexpr, USE_TMA: tl.constexpr,
    TMA_STORE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One tile of ``dlogits = (onehot - p) * g_lp - p * (z - E[z]) * g_ent`` (times ``inv_t``; with
    ``SOFTCAP`` times ``(1 - tanh**2) * inv_t``, the derivative of the capped logit)."""
    pid_n, pid_v = _tile_of(tile, N, V, BLOCK_N, BLOCK_V, GROUP_N)
    offs_n, offs_v, z = _program_logits(
        h_ptr, w_ptr, pid_n, pid_v, N, V, H, stride_hn, stride_hk, stride_wv, stride_wk, inv_t, cap,
        BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, PRECISION, FROM_LOGITS, USE_TMA, SOFTCAP,
    )  # fmt: skip
    n_mask = offs_n < N
    v_mask = offs_v < V
    lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=0.0)
    g_lp = tl.load(glp_ptr + offs_n, mask=n_mask, other=0.0)
    p = tl.exp2((z - lse[:, None]) * 1.4426950408889634)
    local = tl.load(lab_ptr + offs_n, mask=n_mask, other=-1) - label_offset
    onehot = offs_v[None, :] == local[:, None]
    dz = tl.where(onehot, g_lp[:, None], 0.0) - p * g_lp[:, None]
    if WITH_ENTROPY:
        ez = tl.load(ez_ptr + offs_n, mask=n_mask, other=0.0)
        g_ent = tl.load(gent_ptr + offs_n, mask=n_mask, other=0.0)
        dz -= p * (z - ez[:, None]) * g_ent[:, None]
    if SOFTCAP:
        th = z / (cap * inv_t)
        dz = dz * ((1.0 - th * th) * inv_t)
    else:
        dz = dz * inv_t
    if TMA_STORE:  # the descriptor clips the tile at the edges: full-width stores without masks
        d_ptr.store([pid_n * BLOCK_N, pid_v * BLOCK_V], dz.to(d_ptr.dtype))
    else:
        d_ptrs = d_ptr + offs_n.to(tl.int64)[:, None] * stride_dn + offs_v[None, :]
        tl.store(d_ptrs, dz.to(d_ptr.dtype.element_ty), mask=n_mask[:, None] & v_mask[None, :])


@triton.autotune(
    configs=_configs(),
    key=_TUNE_KEY,
    prune_configs_by={"early_config_prune": _prune_bwd},
)  # type: ignore[untyped-decorator]
@triton.heuristics(_EVEN_K)  # type: ignore[untyped-decorator]
@triton.jit(do_not_specialize=_NO_SPECIALISE)  # type: ignore[untyped-decorator]
def _bwd_dlogits_kernel(  # type: ignore[no-untyped-def]
    h_ptr,
    w_ptr,
    lab_ptr,
    lse_ptr,
    ez_ptr,
    glp_ptr,
    gent_ptr,
    d_ptr,
    N,
    V,
    H,
    label_offset,
    inv_t,
    cap,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    stride_dn,
    WITH_ENTROPY: tl.constexpr,
    PRECISION: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
    USE_TMA: tl.constexpr,
    TMA_STORE: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
):
    """Grid as :func:`_fwd_kernel`'s."""
    if USE_TMA:
        for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_N) * tl.cdiv(V, BLOCK_V), NUM_PROGRAMS):
            _bwd_tile(
                tile, h_ptr, w_ptr, lab_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, d_ptr, N, V, H, label_offset,
                inv_t, cap, stride_hn, stride_hk, stride_wv, stride_wk, stride_dn, WITH_ENTROPY, PRECISION,
                FROM_LOGITS, USE_TMA, TMA_STORE, BLOCK_N, BLOCK_V, BLOCK_K, GROUP_N, EVEN_K, SOFTCAP,
            )  # fmt: skip
    else:
        _bwd_tile(
            tl.program_id(0), h_ptr, w_ptr, lab_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, d_ptr, N, V, H,
            label_offset, inv_t, cap, stride_hn, stride_hk, stride_wv, stride_wk, stride_dn, WITH_ENTROPY, PRECISION,
            FROM_LOGITS, USE_TMA, TMA_STORE, BLOCK_N, BLOCK_V, BLOCK_K, GROUP_N, EVEN_K, SOFTCAP,
        )  # fmt: skip


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products ("ieee"), not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _grid(n: int, v: int, programs: int | None = None) -> Any:
    """One program per tile, or at most ``programs`` programs (the persistent TMA grid)."""

    def grid(meta: dict[str, Any]) -> tuple[int]:
        tiles = triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(v, meta["BLOCK_V"])
        return (max(1, min(tiles, programs)) if programs else tiles,)

    return grid


def _num_programs(t: torch.Tensor) -> int:
    """Programs of the persistent grid: one per multiprocessor (a few in the interpreter)."""
    if INTERPRET or not t.is_cuda:
        return 3
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


_SMS: dict[int, int] = {}


def _tma_operand(t: torch.Tensor) -> bool:
    """A row-major matrix whose rows and base a TMA descriptor can address (16-byte aligned)."""
    size = t.element_size()
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0


TMA_SETTINGS: tuple[TmaSetting, ...] = ("store", "load", "off")
"""Values of the ``tma`` option (see the module docstring)."""
DEFAULT_TMA: TmaSetting = "store"
"""The default ``tma`` option: the fastest of the three on the H200 (``benchmarks/results/logprob.md``);
where TMA cannot be used (:func:`tma_usable`) every setting falls back to pointer loads and stores."""


def tma_usable(hidden: torch.Tensor, weight: torch.Tensor, tma: str = DEFAULT_TMA) -> bool:
    """Whether the ``tl.dot`` kernels load ``hidden``/``weight`` tiles through TMA descriptors.

    ``tma="off"`` forces pointer loads. Else TMA needs Triton's ``TensorDescriptor``, a compute-capability
    >= 9.0 GPU and 16-bit operands (fp32 operands keep the measured pointer path; the interpreter takes
    every dtype, so CPU tests run this code), and row-major operands with 16-byte aligned rows and base.
    Anything else: pointer loads."""
    if tma == "off" or TensorDescriptor is None:
        return False
    if not INTERPRET:
        if not hidden.is_cuda or torch.cuda.get_device_capability(hidden.device) < (9, 0):
            return False
        if hidden.dtype not in (torch.bfloat16, torch.float16):
            return False
    return _tma_operand(hidden) and _tma_operand(weight)


def _operands(hidden: torch.Tensor, weight: torch.Tensor, use_tma: bool) -> tuple[Any, Any]:
    """The two GEMM operands as the kernels take them: tensors, or descriptors whose block shape the
    autotune pre-hook sets per config."""
    if not use_tma:
        return hidden, weight
    return TensorDescriptor.from_tensor(hidden, [16, 16]), TensorDescriptor.from_tensor(weight, [16, 16])


def _forward_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    label_offset: int,
    inv_t: float,
    with_entropy: bool,
    mode: str,
    row_split: int | None = None,
    v_chunk: int | None = None,
    tma: str = DEFAULT_TMA,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row max, sum-exp relative to it, sum exp * z relative to it, and label logit (0 where not local)."""
    n, h = hidden.shape
    v = weight.shape[0]
    nvb = triton.cdiv(v, fwd_block_v(hidden.dtype))
    dev = hidden.device
    m_ws = torch.empty((n, nvb), device=dev, dtype=torch.float32)
    s_ws = torch.empty_like(m_ws)
    t_ws = torch.empty_like(m_ws) if with_entropy else m_ws
    zl = torch.zeros(n, device=dev, dtype=torch.float32)
    if n == 0:
        return zl, zl.clone(), zl.clone(), zl.clone()
    if mode == "fused":
        use_tma = tma_usable(hidden, weight, tma)
        progs = _num_programs(hidden)
        h_op, w_op = _operands(hidden, weight, use_tma)
        _fwd_kernel[_grid(n, v, progs if use_tma else None)](
            h_op, w_op, labels, m_ws, s_ws, t_ws, zl, n, v, h, label_offset, inv_t, softcap or 1.0,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), m_ws.stride(0),
            WITH_ENTROPY=with_entropy, PRECISION=_precision(hidden.dtype), FROM_LOGITS=False,
            USE_TMA=use_tma, NUM_PROGRAMS=progs, SOFTCAP=softcap is not None,
        )  # fmt: skip
    else:
        bv = fwd_block_v(hidden.dtype)
        rows, chunk = plan_backward(n, h, 4)
        rows = row_split or rows
        chunk = min(_round_down(v_chunk or chunk, bv), triton.cdiv(v, bv) * bv)
        buf = torch.empty(min(rows, n) * chunk, device=dev, dtype=torch.float32)
        for r0, r1, v0, v1 in _tiles(n, v, rows, chunk):
            z = buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)
            mm_fp32(hidden[r0:r1], weight[v0:v1].T, z)
            c0 = v0 // bv
            _fwd_kernel[_grid(r1 - r0, v1 - v0)](
                z, weight, labels[r0:r1], m_ws[r0:, c0:], s_ws[r0:, c0:], t_ws[r0:, c0:], zl[r0:],
                r1 - r0, v1 - v0, h, label_offset + v0, inv_t, softcap or 1.0,
                z.stride(0), z.stride(1), 0, 0, m_ws.stride(0),
                WITH_ENTROPY=with_entropy, PRECISION=_precision(hidden.dtype), FROM_LOGITS=True,
                USE_TMA=False, NUM_PROGRAMS=1, SOFTCAP=softcap is not None,
            )  # fmt: skip
    m = m_ws.max(dim=1).values
    rescale = torch.exp(m_ws - m[:, None])
    s = (s_ws * rescale).sum(dim=1)
    t = (t_ws * rescale).sum(dim=1) if with_entropy else torch.zeros_like(s)
    return m, s, t, zl


def plan_backward(n: int, h: int, elem_bytes: int, mode: str = "fused") -> tuple[int, int]:
    """``(row_split, v_chunk)`` for the backward so each buffer stays near ``_BWD_BUDGET_BYTES``.

    ``row_split`` rows get one fp32 ``[row_split, H]`` grad-hidden accumulator; the dlogits chunk is
    ``[row_split, v_chunk]`` of ``elem_bytes``. In ``"hybrid"`` mode an fp32 logits block of the same
    shape is live beside it, and the two share the budget. Both are multiples of 256 (at least 256).
    """
    per_elem = elem_bytes + (4 if mode == "hybrid" else 0)
    rows = max(256, (_BWD_BUDGET_BYTES // max(1, 4 * h)) // 256 * 256)
    rows = min(rows, max(n, 1))
    chunk = max(256, (_BWD_BUDGET_BYTES // max(1, rows * per_elem)) // 256 * 256)
    return rows, chunk


def _round_down(chunk: int, multiple: int) -> int:
    """``chunk`` rounded down to a multiple of ``multiple`` (at least ``multiple``)."""
    return max(multiple, chunk // multiple * multiple)


def _tiles(n: int, v: int, rows: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """``(r0, r1, v0, v1)`` blocks, vocabulary-inner."""
    return [
        (r0, min(n, r0 + rows), v0, min(v, v0 + chunk))
        for r0 in range(0, n, rows)
        for v0 in range(0, v, chunk)
    ]


def _out_dtype_mm_works(a: torch.Tensor) -> bool:
    """Whether this torch has ``mm``/``addmm`` with ``out_dtype`` (fp32 output from 16-bit operands) for
    ``a``'s device; probed once per process and device type, cached (a property of the install, not a
    setting)."""
    key = a.device.type
    if key not in _OUT_DTYPE_OK:
        try:
            x = torch.zeros((1, 1), device=a.device, dtype=a.dtype)
            torch.mm(x, x, out_dtype=torch.float32)
            _OUT_DTYPE_OK[key] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_OK[key] = False
    return _OUT_DTYPE_OK[key]


_OUT_DTYPE_OK: dict[str, bool] = {}


def mm_path(a: torch.Tensor) -> str:
    """How :func:`mm_fp32` reaches fp32 output for operands like ``a``: ``"fp32"`` (fp32 operands),
    ``"out_dtype"`` (cuBLAS with fp32 output) or ``"upcast"`` (operands converted to fp32 first: the CPU
    interpreter, or a torch without ``out_dtype``)."""
    if a.dtype == torch.float32:
        return "fp32"
    return "out_dtype" if a.is_cuda and _out_dtype_mm_works(a) else "upcast"


def mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` in fp32 (contiguous ``out``); bf16/fp16 operands keep their exact products."""
    path = mm_path(a)
    if path == "fp32":
        torch.mm(a, b, out=out)
    elif path == "out_dtype":
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with fp32 accumulation and output; ``a``/``b`` may be bf16/fp16/fp32."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _out_dtype_mm_works(a):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(a, b).float())


def _backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ez: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    label_offset: int,
    inv_t: float,
    need_hidden: bool,
    need_weight: bool,
    row_split: int | None,
    v_chunk: int | None,
    mode: str,
    tma: str = DEFAULT_TMA,
    softcap: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    n, h = hidden.shape
    v = weight.shape[0]
    hybrid = mode == "hybrid"
    progs = _num_programs(hidden)
    auto_rows, auto_chunk = plan_backward(n, h, hidden.element_size(), mode)
    rows = row_split or auto_rows
    chunk = min(v_chunk or auto_chunk, v)
    z_buf = torch.empty(min(rows, n) * chunk, device=hidden.device, dtype=torch.float32) if hybrid else None
    grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else None
    grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else None
    d_buf = torch.empty((min(rows, n), chunk), device=hidden.device, dtype=hidden.dtype)
    # TMA loads of row/vocabulary slices keep the operands' alignment; a dlogits chunk stored through a
    # descriptor needs a 16-byte aligned row pitch too
    use_tma = not hybrid and tma_usable(hidden, weight, tma)
    tma_store = use_tma and tma == "store" and _tma_operand(d_buf)
    fp32_acc = hidden.dtype != torch.float32
    acc = (
        torch.empty((min(rows, n), h), device=hidden.device, dtype=torch.float32)
        if need_hidden and fp32_acc
        else None
    )
    with_entropy = g_ent is not None
    if n == 0 and grad_w is not None:
        grad_w.zero_()
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        hid = hidden[r0:r1]
        target = None
        if need_hidden:
            assert grad_h is not None
            target = acc[: r1 - r0] if acc is not None else grad_h[r0:r1]
        for v0 in range(0, v, chunk):
            v1 = min(v, v0 + chunk)
            w = weight[v0:v1]
            d = d_buf[: r1 - r0, : v1 - v0]
            src = hid
            if z_buf is not None:
                src = z_buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)
                mm_fp32(hid, w.T, src)
            src_op, w_op = _operands(src, w, use_tma)
            d_op = TensorDescriptor.from_tensor(d, [16, 16]) if tma_store else d
            _bwd_dlogits_kernel[_grid(r1 - r0, v1 - v0, progs if use_tma else None)](
                src_op, w_op, labels[r0:r1], lse[r0:r1], ez[r0:r1], g_lp[r0:r1],
                (g_ent if g_ent is not None else g_lp)[r0:r1], d_op,
                r1 - r0, v1 - v0, h, label_offset + v0, inv_t, softcap or 1.0,
                src.stride(0), src.stride(1), w.stride(0), w.stride(1), d.stride(0),
                WITH_ENTROPY=with_entropy, PRECISION=_precision(hidden.dtype), FROM_LOGITS=hybrid,
                USE_TMA=use_tma, TMA_STORE=tma_store, NUM_PROGRAMS=progs, SOFTCAP=softcap is not None,
            )  # fmt: skip
            if grad_w is not None:
                if r0 == 0:
                    torch.mm(d.t(), hid, out=grad_w[v0:v1])
                else:
                    grad_w[v0:v1].addmm_(d.t(), hid)
            if target is not None:
                if v0 == 0:  # the first chunk writes the accumulator: no zero fill, no read of it
                    mm_fp32(d, w, target)
                else:
                    _addmm_fp32(target, d, w)
        if acc is not None and grad_h is not None:
            grad_h[r0:r1].copy_(acc[: r1 - r0])
    return grad_h, grad_w


class _FusedLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        group: Any,
        label_offset: int,
        row_split: int | None,
        v_chunk: int | None,
        mode: str,
        tma: str,
        softcap: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_t = 1.0 / temperature
        m, s, t, zl = _forward_stats(
            hidden, weight, labels, label_offset, inv_t, with_entropy, mode, row_split, v_chunk, tma, softcap
        )
        if group is not None:
            import torch.distributed as dist

            m_glob = m.clone()
            dist.all_reduce(m_glob, op=dist.ReduceOp.MAX, group=group)
            rescale = torch.exp(m - m_glob)
            packed = torch.stack([s * rescale, t * rescale, zl])
            dist.all_reduce(packed, group=group)
            s, t, zl = packed[0], packed[1], packed[2]
            m = m_glob
        lse = m + torch.log(s)
        valid = labels != -100
        log_probs = torch.where(valid, zl - lse, 0.0)
        ez = t / s
        entropy = torch.where(valid, lse - ez, 0.0) if with_entropy else torch.zeros_like(lse)
        ctx.save_for_backward(hidden, weight, labels, lse, ez)
        ctx.cfg = (inv_t, with_entropy, group, label_offset, row_split, v_chunk, mode, tma, softcap)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, labels, lse, ez = ctx.saved_tensors
        inv_t, with_entropy, group, label_offset, row_split, v_chunk, mode, tma, softcap = ctx.cfg
        valid = labels != -100
        g_lp = torch.where(valid, g_lp, 0.0) if g_lp is not None else torch.zeros_like(lse)
        g_ent = torch.where(valid, g_ent, 0.0) if (g_ent is not None and with_entropy) else None
        grad_h, grad_w = _backward(
            hidden, weight, labels, lse, ez, g_lp.float().contiguous(),
            g_ent.float().contiguous() if g_ent is not None else None,
            label_offset, inv_t, ctx.needs_input_grad[0], ctx.needs_input_grad[1], row_split, v_chunk,
            mode, tma, softcap,
        )  # fmt: skip
        if group is not None and grad_h is not None:
            import torch.distributed as dist

            dist.all_reduce(grad_h, group=group)
        return grad_h, grad_w, None, None, None, None, None, None, None, None, None, None


def check_mode(mode: str, source: str = "mode") -> LogprobMode:
    """``mode`` if it is one of :data:`MODES`; else ``ConfigError`` naming ``source`` and the choices."""
    for m in MODES:
        if mode == m:
            return m
    raise ConfigError(
        f"{source} must be one of {', '.join(MODES)}, got {mode!r}; leave it out for the default "
        f"({DEFAULT_MODE!r})"
    )


def check_tma(tma: str, source: str = "tma") -> TmaSetting:
    """``tma`` if it is one of :data:`TMA_SETTINGS`; else ``ConfigError`` naming ``source`` and the
    choices."""
    for t in TMA_SETTINGS:
        if tma == t:
            return t
    raise ConfigError(
        f"{source} must be one of {', '.join(TMA_SETTINGS)}, got {tma!r}; leave it out for the default "
        f"({DEFAULT_TMA!r})"
    )


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    group: Any | None = None,
    label_offset: int = 0,
    row_split: int | None = None,
    v_chunk: int | None = None,
    mode: str = DEFAULT_MODE,
    tma: str = DEFAULT_TMA,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused ``log_softmax(hidden @ weight.T / temperature)[labels]`` and entropy, fp32 ``[N]`` each;
    with ``softcap`` ``c`` the logits are ``c * tanh(hidden @ weight.T / c)`` before the temperature
    (Gemma 2/3's final-logit cap), inside the same tiles: no ``[N, V]`` buffer either way.

    No validation here (the caller, :class:`TritonLogprobKernel`, validates). ``label_offset`` is the
    global id of ``weight``'s first row (vocabulary shard start); with ``group`` the statistics are
    all-reduced over it and the hidden gradient is summed over it. ``row_split`` / ``v_chunk`` override the
    backward's planned buffer sizes (tests use them to exercise several chunks at small shapes).

    ``mode`` (:data:`MODES`, default :data:`DEFAULT_MODE`): ``"fused"`` computes the logits inside the
    Triton kernels (``tl.dot``); ``"hybrid"`` computes each ``[rows, v_chunk]`` logits block with cuBLAS
    (fp32 output) and runs the Triton statistics / dlogits kernels on it. Both keep workspace bounded
    independently of ``V`` and agree up to fp32 rounding; which one is faster depends on ``H`` (see
    :data:`DEFAULT_MODE`). ``tma`` (:data:`TMA_SETTINGS`, default :data:`DEFAULT_TMA`): how the fused
    mode's tiles move where TMA is usable (:func:`tma_usable`); ``"off"`` forces pointer loads and stores.
    A ``mode`` or ``tma`` outside its choices raises ``ConfigError``.
    """
    mode = check_mode(mode)
    tma = check_tma(tma)
    lp, ent = _FusedLinearLogprob.apply(  # type: ignore[no-untyped-call]
        hidden, weight, labels.contiguous(), float(temperature), bool(with_entropy), group, int(label_offset),
        row_split, v_chunk, mode, tma, softcap,
    )  # fmt: skip
    return lp, (ent if with_entropy else None)
