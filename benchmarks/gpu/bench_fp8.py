"""Blockwise FP8 (e4m3) quantisation on one GPU: bit-identity triton vs torch, round-trip error, and
throughput as a fraction of the measured copy bandwidth (issue 9, item 6; goal >= 70 %).

Correctness: several shapes (partial edge tiles included), dtypes and blocks, with tiles of widely
different magnitude and one all-zero tile; q bytes and scales must be bit-identical between
``get_quantizer("triton")`` and ``get_quantizer("torch")`` and so must the dequantised tensors; the
round-trip error per element must be within half an e4m3 step (2^-4 relative for normals, 2^-10 * scale
absolute for subnormals).

Throughput: a 16384 x 8192 bf16 weight (256 MiB); bytes moved = read + write (quantise: 2 + 1 bytes per
element + scales; dequantise: 1 + 2), against a 1 GiB device-to-device ``copy_`` (2 x size bytes).

Run (repo root): ``PYTHONPATH=src python3 benchmarks/gpu/bench_fp8.py``; writes ``$OUT/bench_fp8.json``.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch

from underlay import registry


def quantizer(name: str) -> Any:
    """The registry's quantiser ``name``, or the class itself when the registry lacks quant specs."""
    try:
        return registry.get_quantizer(name)
    except Exception as exc:
        print(f"registry.get_quantizer({name!r}) failed ({type(exc).__name__}); using the class directly")
        from underlay.backends.cuda.device import CudaDevice

        if name == "triton":
            from underlay.backends.cuda.fp8 import TritonFp8Quantizer

            return TritonFp8Quantizer(CudaDevice())
        from underlay.backends.portable.quant import TorchFp8Quantizer

        return TorchFp8Quantizer(CudaDevice())


def median_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median CUDA-event time of ``fn`` after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def sample(m: int, k: int, dtype: torch.dtype, block: tuple[int, int]) -> torch.Tensor:
    """Random weight whose tiles span ~16 binades, with one all-zero tile."""
    dev = torch.device("cuda")
    w = torch.randn(m, k, device=dev)
    mb, kb = -(-m // block[0]), -(-k // block[1])
    tile_scale = torch.exp2(torch.randint(-12, 4, (mb, kb), device=dev).float())
    w *= tile_scale.repeat_interleave(block[0], 0)[:m].repeat_interleave(block[1], 1)[:, :k]
    w[: block[0], : block[1]] = 0
    return w.to(dtype)


def check_case(m: int, k: int, dtype: torch.dtype, block: tuple[int, int]) -> dict[str, Any]:
    """Bit-identity and round-trip bound for one case."""
    tq, rq = quantizer("triton"), quantizer("torch")
    w = sample(m, k, dtype, block)
    q1, s1 = tq.quantize(w, block)
    q2, s2 = rq.quantize(w, block)
    d1 = tq.dequantize(q1, s1, block, torch.float32)
    d2 = rq.dequantize(q2, s2, block, torch.float32)
    db1 = tq.dequantize(q1, s1, block, dtype)
    db2 = rq.dequantize(q2, s2, block, dtype)
    scale = s2.repeat_interleave(block[0], 0)[:m].repeat_interleave(block[1], 1)[:, :k]
    err = (d2 - w.float()).abs()
    bound = torch.maximum(w.float().abs() * 2.0**-4, scale * 2.0**-10) * 1.0001
    return {
        "shape": [m, k],
        "dtype": str(dtype).replace("torch.", ""),
        "block": list(block),
        "q_identical": bool(torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))),
        "scales_identical": bool(torch.equal(s1, s2)),
        "deq_identical": bool(torch.equal(d1, d2) and torch.equal(db1, db2)),
        "zero_tile_scale_1": bool(s2[0, 0] == 1.0),
        "roundtrip_within_bound": bool((err <= bound).all()),
        "max_rel_err_normals": float(
            (err / w.float().abs().clamp(min=1e-30))[w.float().abs() >= scale * 2.0**-6].max()
        ),
    }


def main() -> None:
    """Checks, throughput, table and JSON."""
    from underlay.backends.cuda import fp8

    torch.manual_seed(0)
    shapes = [
        (4096, 4096, torch.bfloat16, (128, 128)),
        (1000, 3000, torch.bfloat16, (128, 128)),
        (777, 1313, torch.float16, (128, 128)),
        (513, 257, torch.float32, (128, 128)),
        (300, 500, torch.bfloat16, (64, 96)),
        (151936, 896, torch.bfloat16, (128, 128)),
    ]
    cases = []
    for manual in (False, True):  # hardware conversions, then the integer/fp32 rounding path
        fp8.MANUAL_ROUNDING = manual
        cases += [{**check_case(m, k, dt, b), "manual_rounding": manual} for m, k, dt, b in shapes]
    dev = torch.device("cuda")
    src = torch.empty(1 << 29, device=dev, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 2 / copy_ms / 1e6
    src = dst = torch.empty(0)
    m, k = 16384, 8192
    w = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    rows: dict[str, dict[str, float]] = {}
    for name in ("triton", "triton_manual_rounding", "torch"):
        fp8.MANUAL_ROUNDING = name == "triton_manual_rounding"
        qz = quantizer(name.split("_")[0])
        q, s = qz.quantize(w)
        qbytes = m * k * 3 + s.numel() * 4
        dbytes = m * k * 3 + s.numel() * 4
        t_q = median_ms(lambda qz=qz: qz.quantize(w))
        t_d = median_ms(lambda qz=qz, q=q, s=s: qz.dequantize(q, s))
        rows[name] = {
            "quant_ms": t_q,
            "quant_gbs": qbytes / t_q / 1e6,
            "quant_frac_of_copy": qbytes / t_q / 1e6 / copy_gbs,
            "dequant_ms": t_d,
            "dequant_gbs": dbytes / t_d / 1e6,
            "dequant_frac_of_copy": dbytes / t_d / 1e6 / copy_gbs,
        }
    fp8.MANUAL_ROUNDING = False
    info = {
        "torch": torch.__version__,
        "triton": fp8.triton.__version__,
        "gpu": torch.cuda.get_device_name(),
        "copy_gbs": copy_gbs,
        "throughput_shape": [m, k],
        "throughput": rows,
        "cases": cases,
    }
    print(f"torch {torch.__version__} triton {fp8.triton.__version__} {torch.cuda.get_device_name()}")
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    for name, r in rows.items():
        print(
            f"{name:>22}: quantise {r['quant_ms']:.3f} ms {r['quant_gbs']:.0f} GB/s "
            f"({100 * r['quant_frac_of_copy']:.0f}% of copy); dequantise {r['dequant_ms']:.3f} ms "
            f"{r['dequant_gbs']:.0f} GB/s ({100 * r['dequant_frac_of_copy']:.0f}%)"
        )
    for c in cases:
        flags = [key for key, val in c.items() if isinstance(val, bool) and not val]
        print(f"{c['shape']} {c['dtype']} {c['block']} manual={c['manual_rounding']}: "
              f"{'OK' if not flags else 'FAIL ' + ','.join(flags)} "
              f"max rel err {c['max_rel_err_normals']:.4f}")  # fmt: skip
    with open(os.path.join(os.environ.get("OUT", "."), "bench_fp8.json"), "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
