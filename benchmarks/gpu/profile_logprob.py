"""Where the time of the fused log-prob kernel goes, at the issue-9 benchmark shape, on one GPU.

For each mode of the Triton kernel (``fused``, ``hybrid``): forward and backward timed apart (CUDA
events, median of 3), then one forward + backward under ``torch.profiler`` with the GPU kernels summed by
name. Then the cuBLAS matmuls that the backward plan issues, timed alone at their shapes, so that the
"cuBLAS floor" of that plan can be set against the measured backward.

Run (repo root): ``PYTHONPATH=src python3 benchmarks/gpu/profile_logprob.py [N H V]`` (``PROFILE_MODES=fused``
limits the modes); prints tables and
writes ``$OUT/profile_logprob.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from underlay.backends.cuda import _logprob_triton as impl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_gaps
from bench_logprob import event_ms, timed


def ms(fn: Callable[[], Any], reps: int = 3) -> float:
    """Median CUDA-event time of ``fn`` in ms (after one untimed call)."""
    fn()
    return event_ms(fn, reps)


def kernel_table(fn: Callable[[], Any]) -> tuple[list[dict[str, Any]], str]:
    """GPU kernels of one call of ``fn``, summed by name, longest first; and the idle-gap report."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            gaps = trace_gaps.analyse(json.load(f), top=6)
    total: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            row = total[ev.name[:90]]
            row[0] += 1
            row[1] += ev.device_time / 1000.0
    rows = [{"kernel": k, "count": int(c), "ms": t} for k, (c, t) in total.items()]
    return sorted(rows, key=lambda r: -r["ms"]), gaps


def main() -> None:
    n, h, v = (int(x) for x in sys.argv[1:4]) if len(sys.argv) >= 4 else (32768, 4096, 152064)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    hidden = (torch.randn(n, h, device=dev) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device=dev) * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device=dev)
    g_lp, g_ent = torch.randn(n, device=dev), torch.randn(n, device=dev)
    flop = 2.0 * n * h * v

    def clear() -> None:
        hidden.grad = weight.grad = None

    report: dict[str, Any] = {"shape": [n, h, v], "modes": {}}
    modes = [m for m in os.environ.get("PROFILE_MODES", ",".join(impl.MODES)).split(",") if m]
    for mode in modes:

        def fwd(mode: str = mode) -> tuple[torch.Tensor, torch.Tensor | None]:
            return impl.fused_linear_logprobs(hidden, weight, labels, mode=mode)

        def step(mode: str = mode) -> None:
            clear()
            lp, ent = fwd(mode)
            assert ent is not None
            torch.autograd.backward([lp, ent], [g_lp, g_ent])

        step()
        with torch.no_grad():
            t_fwd = ms(fwd)
        t_all = ms(step)
        table, gaps = kernel_table(step)
        report["modes"][mode] = {"fwd_ms": t_fwd, "fwd_bwd_ms": t_all, "kernels": table[:15]}
        print(f"== mode {mode}: forward {t_fwd:.1f} ms, forward+backward {t_all:.1f} ms "
              f"({4 * flop / t_all / 1e9:.0f} TFLOP/s over 4 GEMMs)")  # fmt: skip
        for r in table[:15]:
            print(f"  {r['ms']:8.2f} ms  x{r['count']:<5d} {r['kernel']}")
        print(gaps)

    report["plans"] = {}
    print("== backward plans: mode, rows per split x vocabulary chunk (None: the planned size)")
    plans = [("fused", None, None), ("fused", 4096, 16384), ("fused", 16384, 4096), ("hybrid", None, None)]
    plans += [("hybrid", 8192, c) for c in (2048, 3072, 4096)]
    plans = [p for p in plans if p[0] in modes]
    for md, rs, vc in plans:

        def plan_step(md: str = md, rs: int | None = rs, vc: int | None = vc) -> None:
            clear()
            lp, ent = impl.fused_linear_logprobs(hidden, weight, labels, row_split=rs, v_chunk=vc, mode=md)
            assert ent is not None
            torch.autograd.backward([lp, ent], [g_lp, g_ent])

        t, peak = timed(plan_step, clear, reps=3, warm=1)
        report["plans"][f"{md} {rs}x{vc}"] = {"ms": t, "peak_gib": peak}
        print(f"  {md} {rs} x {vc}: {t:.1f} ms, peak extra {peak:.2f} GiB")

    rows, chunk = impl.plan_backward(n, h, 2)
    chunk = min(chunk, v)
    nblk = -(-n // rows) * -(-v // chunk)
    hid, w = hidden.detach()[:rows], weight.detach()[:chunk]
    d = torch.randn(rows, chunk, device=dev).bfloat16()
    out32 = torch.empty(rows, chunk, device=dev)
    acc = torch.zeros(rows, h, device=dev)
    gw = torch.empty(chunk, h, device=dev, dtype=torch.bfloat16)
    gemm = {
        "full h @ W.T (bf16 out)": (lambda: hidden.detach() @ weight.detach().T, 1),
        "block h @ w.T (bf16 out)": (lambda: hid @ w.T, nblk),
        "block h @ w.T (fp32 out)": (lambda: impl.mm_fp32(hid, w.T, out32), nblk),
        "dW block d.T @ h (bf16 out)": (lambda: torch.mm(d.t(), hid, out=gw), nblk),
        "dW block += d.T @ h (bf16)": (lambda: gw.addmm_(d.t(), hid), nblk),
        "dh block acc += d @ w (fp32 out)": (lambda: impl._addmm_fp32(acc, d, w), nblk),
    }
    report["plan"] = {"row_split": rows, "v_chunk": chunk, "blocks": nblk}
    report["gemms"] = {}
    print(f"== cuBLAS alone (backward plan: {rows} rows x {chunk} columns, {nblk} blocks)")
    for name, (fn, count) in gemm.items():
        t = ms(fn, reps=10)
        blk_flop = flop if count == 1 else 2.0 * rows * chunk * h
        report["gemms"][name] = {"ms": t, "count": count, "total_ms": t * count}
        print(
            f"  {name:34s} {t:8.3f} ms x{count:<4d} = {t * count:7.1f} ms ({blk_flop / t / 1e9:.0f} TFLOP/s)"
        )
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "profile_logprob.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
