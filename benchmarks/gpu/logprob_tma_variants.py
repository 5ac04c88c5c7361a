"""Tile-loading variants of the fused log-prob kernels' logits GEMM, timed against cuBLAS (issue 23, item 4).

The fused log-prob kernel spends its time beyond the four-matmul floor in its two Triton GEMMs (the
forward statistics kernel and the backward dlogits kernel compute ``hidden @ weight.T`` tiles with
``tl.dot`` at about 520 TFLOP/s where cuBLAS reaches about 690). This script measures, in one run, whether
loading the operand tiles through Hopper's tensor-memory accelerator (host-side ``TensorDescriptor``s,
optionally a persistent grid) closes that gap, for both epilogues:

- ``stats``: the forward kernel (row max, sum exp, sum exp * z and the label logit per 256-column block),
  at ``N x H x V`` (default 32768 x 4096 x 152064 bf16);
- ``dlogits``: the backward kernel (recomputed logits -> bf16 dlogits of log-prob and entropy), on one
  block of the backward plan (8192 rows x 8192 vocabulary columns).

Each is compared with underlay's current kernel (``_logprob_triton``, autotuned) and with the cuBLAS matmul
of the same shape, and checked against the current kernel's output. Prints a table of ms and TFLOP/s and
writes ``$OUT/logprob_tma_variants.json``. Run on the GPU host from the repo root::

    PYTHONPATH=src python3 benchmarks/gpu/logprob_tma_variants.py [N H V]
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from underlay.backends.cuda import _logprob_triton as impl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_logprob

LOG2E = 1.4426950408889634


@triton.jit
def _tile(
    h_desc, w_desc, off_n, off_v, H, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr
):
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        a = h_desc.load([off_n, k * BLOCK_K])
        b = w_desc.load([off_v, k * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _stats_epilogue(
    z,
    offs_n,
    offs_v,
    pid_v,
    N,
    V,
    lab_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    zl_ptr,
    stride_ws,
    inv_t,
    BLOCK_V: tl.constexpr,
):
    z = z * inv_t
    n_mask = offs_n < N
    v_mask = offs_v < V
    z = tl.where(v_mask[None, :], z, float("-inf"))
    m = tl.max(z, 1)
    e = tl.exp2((z - m[:, None]) * 1.4426950408889634)
    ws = offs_n.to(tl.int64) * stride_ws + pid_v
    tl.store(m_ptr + ws, m, mask=n_mask)
    tl.store(s_ptr + ws, tl.sum(e, 1), mask=n_mask)
    tl.store(t_ptr + ws, tl.sum(e * tl.where(v_mask[None, :], z, 0.0), 1), mask=n_mask)
    local = tl.load(lab_ptr + offs_n, mask=n_mask, other=-1)
    lo = pid_v * BLOCK_V
    hit = n_mask & (local >= lo) & (local < lo + BLOCK_V) & (local < V)
    zl = tl.sum(tl.where(offs_v[None, :] == local[:, None], z, 0.0), 1)
    tl.store(zl_ptr + offs_n, zl, mask=hit)


@triton.jit
def _dlogits_epilogue(
    z, offs_n, offs_v, N, V, lab_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, d_ptr, stride_dn, inv_t
):
    z = z * inv_t
    n_mask = offs_n < N
    v_mask = offs_v < V
    lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=0.0)
    g_lp = tl.load(glp_ptr + offs_n, mask=n_mask, other=0.0)
    p = tl.exp2((z - lse[:, None]) * 1.4426950408889634)
    local = tl.load(lab_ptr + offs_n, mask=n_mask, other=-1)
    onehot = offs_v[None, :] == local[:, None]
    dz = tl.where(onehot, g_lp[:, None], 0.0) - p * g_lp[:, None]
    ez = tl.load(ez_ptr + offs_n, mask=n_mask, other=0.0)
    g_ent = tl.load(gent_ptr + offs_n, mask=n_mask, other=0.0)
    dz -= p * (z - ez[:, None]) * g_ent[:, None]
    d_ptrs = d_ptr + offs_n.to(tl.int64)[:, None] * stride_dn + offs_v[None, :]
    tl.store(d_ptrs, (dz * inv_t).to(d_ptr.dtype.element_ty), mask=n_mask[:, None] & v_mask[None, :])


@triton.jit
def _pid(tile, num_n, num_v, GROUP_N: tl.constexpr):
    per_group = GROUP_N * num_v
    first_n = (tile // per_group) * GROUP_N
    size = min(num_n - first_n, GROUP_N)
    pid_n = first_n + (tile % per_group) % size
    pid_v = (tile % per_group) // size
    return pid_n, pid_v


@triton.jit
def _tma_kernel(
    h_desc,
    w_desc,
    lab_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    e_ptr,
    out_ptr,
    N,
    V,
    H,
    stride,
    inv_t,
    EPILOGUE: tl.constexpr,
    PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    num_n = tl.cdiv(N, BLOCK_N)
    num_v = tl.cdiv(V, BLOCK_V)
    if PERSISTENT:
        for tile in tl.range(
            tl.program_id(0), num_n * num_v, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPEC
        ):
            pid_n, pid_v = _pid(tile, num_n, num_v, GROUP_N)
            z = _tile(h_desc, w_desc, pid_n * BLOCK_N, pid_v * BLOCK_V, H, BLOCK_N, BLOCK_V, BLOCK_K)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
            if EPILOGUE == 0:
                _stats_epilogue(
                    z,
                    offs_n,
                    offs_v,
                    pid_v,
                    N,
                    V,
                    lab_ptr,
                    a_ptr,
                    b_ptr,
                    c_ptr,
                    out_ptr,
                    stride,
                    inv_t,
                    BLOCK_V,
                )
            else:
                _dlogits_epilogue(
                    z, offs_n, offs_v, N, V, lab_ptr, a_ptr, b_ptr, c_ptr, d_ptr, out_ptr, stride, inv_t
                )
    else:
        pid_n, pid_v = _pid(tl.program_id(0), num_n, num_v, GROUP_N)
        z = _tile(h_desc, w_desc, pid_n * BLOCK_N, pid_v * BLOCK_V, H, BLOCK_N, BLOCK_V, BLOCK_K)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        if EPILOGUE == 0:
            _stats_epilogue(
                z, offs_n, offs_v, pid_v, N, V, lab_ptr, a_ptr, b_ptr, c_ptr, out_ptr, stride, inv_t, BLOCK_V
            )
        else:
            _dlogits_epilogue(
                z, offs_n, offs_v, N, V, lab_ptr, a_ptr, b_ptr, c_ptr, d_ptr, out_ptr, stride, inv_t
            )


CONFIGS = (
    # BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 5),
    (256, 128, 64, 8, 3),
    (64, 256, 64, 4, 4),
)


def configs_of(loop: str) -> tuple[tuple[int, ...], ...]:
    """Every config for the plain loops; the measured-best few for the flatten / warp-specialised ones."""
    if loop in ("tma", "tma-persist"):
        return CONFIGS
    return ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 5))


def event_ms(fn: Callable[[], Any], reps: int = 5, warm: int = 2) -> float:
    """Median CUDA-event ms of ``reps`` calls after ``warm`` untimed ones (``bench_logprob.event_ms``)."""
    for _ in range(warm):
        fn()
    return bench_logprob.event_ms(fn, reps)


LOOPS = {
    # name: (persistent, flatten, warp_specialize) of the tile loop
    "tma": (False, False, False),
    "tma-persist": (True, False, False),
    "tma-persist-flat": (True, True, False),
    "tma-persist-ws": (True, False, True),
    "tma-persist-flat-ws": (True, True, True),
}


def run_tma(
    epilogue: int,
    loop: str,
    cfg: tuple[int, ...],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bufs: dict[str, torch.Tensor],
) -> Callable[[], None]:
    """A closure launching the TMA variant ``loop`` (a key of ``LOOPS``) with ``cfg``."""
    persistent, flatten, warp_spec = LOOPS[loop]
    bn, bv, bk, warps, stages = cfg
    n, h = hidden.shape
    v = weight.shape[0]
    h_desc = TensorDescriptor.from_tensor(hidden, [bn, bk])
    w_desc = TensorDescriptor.from_tensor(weight, [bv, bk])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = triton.cdiv(n, bn) * triton.cdiv(v, bv)
    grid = (min(sms, tiles),) if persistent else (tiles,)
    if epilogue == 0:
        args = (bufs["m"], bufs["s"], bufs["t"], bufs["m"], bufs["m"], bufs["zl"], bufs["m"].stride(0))
    else:
        args = (bufs["lse"], bufs["ez"], bufs["glp"], bufs["gent"], bufs["d"], bufs["d"], bufs["d"].stride(0))
    a_, b_, c_, d_, e_, out_, stride = args

    def go() -> None:
        _tma_kernel[grid](
            h_desc, w_desc, labels, a_, b_, c_, d_, e_, out_, n, v, h, stride, 1.0,
            EPILOGUE=epilogue, PERSISTENT=persistent, FLATTEN=flatten, WARP_SPEC=warp_spec, NUM_SMS=sms,
            BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, GROUP_N=8, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    return go


def main() -> int:
    """Time every variant; print and write the table."""
    n, h, v = (int(a) for a in sys.argv[1:4]) if len(sys.argv) >= 4 else (32768, 4096, 152064)
    out_dir = os.environ.get("OUT", ".")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    weight = (torch.randn(v, h, device=dev) * (2.5 / h**0.5)).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), device=dev)
    rows: list[dict[str, Any]] = []

    def record(name: str, ms: float, flop: float, err: float | None = None) -> None:
        rows.append({"name": name, "ms": ms, "tflops": flop / ms / 1e9, "max_err": err})
        print(f"{name:44s} {ms:9.3f} ms {flop / ms / 1e9:7.1f} TFLOP/s  err {err}", flush=True)

    # --- forward statistics at N x H x V
    flop = 2.0 * n * h * v
    record("cublas mm N x H x V", event_ms(lambda: torch.mm(hidden, weight.T)), flop)
    torch.cuda.empty_cache()
    ref = impl._forward_stats(hidden, weight, labels, 0, 1.0, True, "fused")
    for tma in (False, True):
        record(
            f"lib _forward_stats tma={tma} (autotuned)",
            event_ms(
                lambda tma=tma: impl._forward_stats(
                    hidden, weight, labels, 0, 1.0, True, "fused", tma="load" if tma else "off"
                )
            ),
            flop,
        )
    nvb = triton.cdiv(v, 256)
    bufs = {k: torch.empty((n, nvb), device=dev, dtype=torch.float32) for k in ("m", "s", "t")}
    bufs["zl"] = torch.zeros(n, device=dev, dtype=torch.float32)
    for loop in LOOPS:
        for cfg in configs_of(loop):
            if cfg[1] != 256:
                continue  # the statistics workspace is laid out in 256-column blocks
            name = f"{loop} stats {cfg}"
            try:
                go = run_tma(0, loop, cfg, hidden, weight, labels, bufs)
                go()
                m = bufs["m"].max(dim=1).values
                s = (bufs["s"] * torch.exp(bufs["m"] - m[:, None])).sum(dim=1)
                err = float(((m + torch.log(s)) - (ref[0] + torch.log(ref[1]))).abs().max())
                record(name, event_ms(go), flop, err)
            except Exception as exc:  # one variant failing to compile must not hide the others
                print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    del bufs
    torch.cuda.empty_cache()

    # --- backward dlogits on one plan block
    rows_b, chunk = impl.plan_backward(n, h, 2)
    hb, wb, lb = hidden[:rows_b].contiguous(), weight[:chunk].contiguous(), labels[:rows_b] % chunk
    flop_b = 2.0 * rows_b * h * chunk
    record(f"cublas mm block {rows_b} x {h} x {chunk}", event_ms(lambda: torch.mm(hb, wb.T), reps=20), flop_b)
    m, s, t, _ = impl._forward_stats(hb, wb, lb, 0, 1.0, True, "fused")
    lse = (m + torch.log(s)).contiguous()
    ez = (t / s).contiguous()
    glp, gent = torch.randn(rows_b, device=dev), torch.randn(rows_b, device=dev)
    d_ref = torch.empty((rows_b, chunk), device=dev, dtype=torch.bfloat16)

    def lib_bwd(use_tma: bool, store: bool) -> Callable[[], None]:
        progs = impl._num_programs(hb)

        def go() -> None:
            h_op, w_op = impl._operands(hb, wb, use_tma)
            d_op = TensorDescriptor.from_tensor(d_ref, [16, 16]) if store else d_ref
            impl._bwd_dlogits_kernel[impl._grid(rows_b, chunk, progs if use_tma else None)](
                h_op, w_op, lb, lse, ez, glp, gent, d_op, rows_b, chunk, h, 0, 1.0,
                hb.stride(0), hb.stride(1), wb.stride(0), wb.stride(1), d_ref.stride(0),
                WITH_ENTROPY=True, PRECISION="tf32", FROM_LOGITS=False, USE_TMA=use_tma, TMA_STORE=store,
                NUM_PROGRAMS=progs,
            )  # fmt: skip

        return go

    record("lib _bwd_dlogits_kernel pointer (autotuned)", event_ms(lib_bwd(False, False), reps=20), flop_b)
    record("lib _bwd_dlogits_kernel TMA loads (autotuned)", event_ms(lib_bwd(True, False), reps=20), flop_b)
    record(
        "lib _bwd_dlogits_kernel TMA loads+store (autotuned)", event_ms(lib_bwd(True, True), reps=20), flop_b
    )
    d = torch.empty_like(d_ref)
    bufs = {"lse": lse, "ez": ez, "glp": glp, "gent": gent, "d": d}
    for loop in LOOPS:
        for cfg in configs_of(loop):
            name = f"{loop} dlogits {cfg}"
            try:
                go = run_tma(1, loop, cfg, hb, wb, lb, bufs)
                go()
                err = float((d.float() - d_ref.float()).abs().max())
                record(name, event_ms(go, reps=20), flop_b, err)
            except Exception as exc:
                print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    result = {
        "shape": [n, h, v],
        "plan": [rows_b, chunk],
        "triton": triton.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "rows": rows,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "logprob_tma_variants.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
