"""HostOffloadAdamW on the device: bit-identical to torch's AdamW, its step time and device memory.

1. Equality: random fp32 parameters (several shapes) and gradients, ``--steps`` steps of torch's
   AdamW (fused on accelerators, foreach on cpu) against ``HostOffloadAdamW`` with small chunks (many
   streamed chunks); every parameter must be bit-identical after every step.
2. Throughput: ``--params-m`` million fp32 parameters in 64M-element tensors: the step time of torch's
   fused AdamW with its state on the device against the offloaded step (state in pinned host memory,
   streamed in ``chunk_bytes`` chunks), the host<->device bytes per second that implies, and the device
   memory each holds (peak during the step above the parameters and gradients).

    python benchmarks/gpu/check_optim_offload.py --out DIR            # cuda
    python benchmarks/gpu/check_optim_offload.py --device cpu --quick --out DIR

Writes ``DIR/optim_offload.json``; exit status 1 when equality fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from underlay.engines.fsdp2.optim_offload import HostOffloadAdamW

HP: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def equality(device: torch.device, steps: int, fused: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    shapes = [(257, 129), (1024,), (64, 64, 3), (3000, 17), (5,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    a = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    b = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    ref = torch.optim.AdamW(a, **HP, **({"fused": True} if fused else {"foreach": True}))
    off = HostOffloadAdamW(b, **HP, fused=fused, chunk_bytes=50_000, pin_memory=device.type != "cpu")
    equal_each = []
    for _ in range(steps):
        grads = [torch.randn(s, generator=g).to(device) for s in shapes]
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        ref.step()
        off.step()
        equal_each.append(all(torch.equal(p, q) for p, q in zip(a, b)))
    return {"equal_each_step": equal_each, "equal": all(equal_each), "chunks": len(off._chunks(b))}


def throughput(device: torch.device, params_m: int, chunk_mb: int, fused: bool) -> dict[str, Any]:
    numel = params_m * 1_000_000
    piece = 64 * 1024 * 1024
    sizes = [piece] * (numel // piece) + ([numel % piece] if numel % piece else [])
    out: dict[str, Any] = {"params": numel}
    for mode in ("device", "offload"):
        params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        if device.type != "cpu":
            torch.accelerator.synchronize()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        if mode == "device":
            opt: torch.optim.Optimizer = torch.optim.AdamW(
                params, **HP, **({"fused": True} if fused else {"foreach": True})
            )
        else:
            opt = HostOffloadAdamW(
                params, **HP, fused=fused, chunk_bytes=chunk_mb << 20, pin_memory=device.type != "cpu"
            )
        times = []
        for _ in range(4):
            if device.type != "cpu":
                torch.accelerator.synchronize()
            t = time.perf_counter()
            opt.step()
            if device.type != "cpu":
                torch.accelerator.synchronize()
            times.append(time.perf_counter() - t)
        step_s = sum(times[1:]) / len(times[1:])
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
        out[mode] = {"step_s": step_s, "times": times, "device_gib_above_params_grads": peak}
        if mode == "offload":
            moved = 2 * 2 * 4 * numel  # two states, there and back, fp32
            out[mode]["host_device_gb_per_s"] = moved / step_s / 1e9
        del opt, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--params-m", type=int, default=2000, help="million fp32 parameters (throughput part)")
    ap.add_argument("--chunk-mb", type=int, default=1024)
    args = ap.parse_args()
    device = torch.device(args.device)
    fused = device.type != "cpu"
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "equality": equality(device, args.steps, fused),
        "throughput": throughput(
            device, 20 if args.quick else args.params_m, 8 if args.quick else args.chunk_mb, fused
        ),
    }
    eq, tp = result["equality"], result["throughput"]
    print(f"equality over {args.steps} steps ({eq['chunks']} chunks): {eq['equal']} {eq['equal_each_step']}")
    d, o = tp["device"], tp["offload"]
    print(
        f"{tp['params'] / 1e9:.2f}B params: device-state AdamW {d['step_s'] * 1e3:.1f} ms "
        f"(+{d['device_gib_above_params_grads']} GiB), offloaded {o['step_s'] * 1e3:.1f} ms "
        f"(+{o['device_gib_above_params_grads']} GiB), {o['host_device_gb_per_s']:.1f} GB/s host<->device"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "optim_offload.json").write_text(json.dumps(result, indent=2))
    return 0 if eq["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
