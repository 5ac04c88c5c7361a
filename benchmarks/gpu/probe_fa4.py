"""FlashAttention-4 (``flash_attn.cute``, CuTe DSL) against torch's own flash kernel on one H200.

Three questions, each answered in the same run:

1. Does the ``fa4`` backend's activation (torch's FA4 glue over ``underlay.backends.portable._fa4_glue``,
   registered with ``torch.nn.attention.register_flash_attention_impl``), which routes ``aten::_flash_attention_forward/backward`` and so ``varlen_attn`` to FA4) work on this
   torch, and how long does the first call take (CuTe DSL compiles its kernels on first use)?
2. Accuracy: packed causal GQA attention, bf16, forward output and q/k/v gradients of the default
   kernel and of FA4, each against a float32 per-sequence reference (max and RMS error).
3. Speed: forward+backward milliseconds of both on the Qwen3-4B attention shape (32 q heads, 8 kv
   heads, head_dim 128) over a long-tailed length mix, the ratio printed against the default kernel
   measured in the same run; the same under ``torch.compile``.

Run from the repository root (``PYTHONPATH=src``); FA4 and its CuTe DSL need to be importable:

    PYTHONPATH=src python benchmarks/gpu/probe_fa4.py --tokens 16384 65536
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_attention import HK, HQ, D, direct_varlen, long_tailed_lengths  # this directory is sys.path[0]

from underlay.backends.portable.fa4_attention import _activate as activate_fa4

_varlen = direct_varlen("torch")  # varlen_attn, causal, native GQA where this torch has it


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, m: int) -> torch.Tensor:
    """Packed causal attention through torch's ``varlen_attn`` (whichever flash kernel is active)."""
    if _varlen is None:
        sys.exit(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
    return _varlen(q, k, v, cu, m)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """float32 causal attention one sequence at a time, ``[T, Hq, D]``."""
    outs, a = [], 0
    g = q.shape[1] // k.shape[1]
    for n in lens:
        qs = q[a : a + n].float().transpose(0, 1)
        ks = k[a : a + n].float().repeat_interleave(g, 1).transpose(0, 1)
        vs = v[a : a + n].float().repeat_interleave(g, 1).transpose(0, 1)
        s = (qs @ ks.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append((s.softmax(-1) @ vs).transpose(0, 1))
        a += n
    return torch.cat(outs)


def fwd_bwd_ms(fn: Callable[[], torch.Tensor], dout: torch.Tensor, grads: list[torch.Tensor]) -> float:
    """Median ms of forward+backward (triton's do_bench)."""
    from triton.testing import do_bench

    return float(
        do_bench(lambda: fn().backward(dout), warmup=25, rep=300, grad_to_none=grads, return_mode="median")
    )


def errors(dev: torch.device) -> dict[str, tuple[float, float]]:
    """Max and RMS error of out, dq, dk, dv against the float32 reference, for the active impl."""
    lens = long_tailed_lengths(4096, seed=1)
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(3)
    q, k, v = (
        torch.randn(total, h, D, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
        for h in (HQ, HK, HK)
    )
    dout = torch.randn(total, HQ, D, device=dev, generator=gen).to(torch.bfloat16)
    out = attend(q, k, v, cu, max(lens))
    got = [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref_out = reference(qf, kf, vf, lens)
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, (qf, kf, vf), dout.float())]
    res = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        d = a.float() - b
        res[name] = (float(d.abs().max()), float(d.pow(2).mean().sqrt() / b.pow(2).mean().sqrt()))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_fa4.py needs a CUDA GPU")
    dev = torch.device("cuda")
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cap {torch.cuda.get_device_capability()}"
    )
    import torch.nn.attention as tna

    print("list_flash_attention_impls:", getattr(tna, "list_flash_attention_impls", lambda: "n/a")())
    results: dict[str, Any] = {"default": {"errors": errors(dev)}}
    t0 = time.perf_counter()
    try:
        import flash_attn.cute.interface  # noqa: F401

        activate_fa4()
    except Exception as exc:  # report and stop: the rest needs FA4
        print(f"FA4 activation failed: {type(exc).__name__}: {exc}")
        print(results)
        return
    print(f"FA4 activated in {time.perf_counter() - t0:.1f} s; current: {tna.current_flash_attention_impl()}")
    t0 = time.perf_counter()
    results["fa4"] = {"errors": errors(dev)}
    print(f"FA4 first calls (compile) {time.perf_counter() - t0:.1f} s")
    for impl in ("default", "fa4"):
        for name, (mx, rms) in results[impl]["errors"].items():
            print(f"  {impl:8s} {name:3s} max abs err {mx:.3e}  rel RMS {rms:.3e}")

    for total in args.tokens:
        time_case(dev, total, compile_too=not args.no_compile)


def time_case(dev: torch.device, total: int, compile_too: bool) -> None:
    """Interleaved fwd+bwd timings of the default kernel, FA4 and FA4 under torch.compile."""

    lens = long_tailed_lengths(total)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    m = max(lens)
    q = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, HK, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, HK, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16)
    flops = 3.5 * sum(2.0 * s * s * D * HQ for s in lens)

    def eager() -> torch.Tensor:
        return attend(q, k, v, cu, m)

    compiled = torch.compile(eager)
    times: dict[str, list[float]] = {"default": [], "fa4": [], "fa4 compiled": []}
    for _ in range(3):  # interleaved rounds
        _deactivate()
        times["default"].append(fwd_bwd_ms(eager, dout, [q, k, v]))
        activate_fa4()
        times["fa4"].append(fwd_bwd_ms(eager, dout, [q, k, v]))
        if compile_too:
            times["fa4 compiled"].append(fwd_bwd_ms(compiled, dout, [q, k, v]))
    base = statistics.median(times["default"])
    print(f"\n{total} tokens in {len(lens)} sequences (max {m}); fwd+bwd:")
    for name, ts in times.items():
        if ts:
            t = statistics.median(ts)
            print(
                f"  {name:14s} {t:8.3f} ms  {flops / t / 1e9:6.1f} TFLOP/s  ratio to default {t / base:.3f}"
            )


def _deactivate() -> None:
    """Back to torch's built-in flash kernel."""
    from torch.nn.attention import _registry

    _registry.restore_flash_attention_impl(_raise_warn=False)


if __name__ == "__main__":
    main()
