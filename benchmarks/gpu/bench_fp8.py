"""Blockwise FP8 (e4m3) quantise / dequantise on one GPU: the library's Triton quantiser as a fraction of
the device copy bandwidth measured in the same run (goal >= 70 %), against the torch quantiser.

On a ``--shape M K`` (default 16384 x 8192) bf16 weight, block (128, 128): bytes moved = read + write
(quantise: 2 + 1 bytes per element + scales; dequantise: 1 + 2 + scales); the baseline is a
device-to-device ``copy_`` of 1 GiB (2 x size bytes). Each time is the median of ``--repeats`` (15)
timings of 10 back-to-back calls, per call (host launch overhead hidden, as in a pipeline), after
``--warmup`` calls (autotuning included), plus one isolated call. Quantisers:
``TritonFp8Quantizer(device, autotune=True)`` (the default), ``autotune=False`` and the torch
quantiser; each Triton result must equal the torch one bit for bit.

    python -m benchmarks.gpu.bench_fp8 [--shape M K] [--out DIR]

Writes ``OUT/fp8.json``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks import _harness as harness
from underlay.backends.cuda.device import CudaDevice
from underlay.backends.cuda.fp8 import TritonFp8Quantizer
from underlay.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

BLOCK = (128, 128)


def per_call_ms(fn: Callable[[], object], warmup: int, repeats: int, batch: int = 10) -> float:
    """Median over ``repeats`` of the time of ``batch`` back-to-back calls, per call, in ms."""

    def calls() -> None:
        for _ in range(batch):
            fn()

    return harness.timeit(calls, warmup=warmup, repeats=repeats, device="cuda").median / batch * 1e3


def copy_gbs(warmup: int, repeats: int) -> float:
    """GB/s of a 1 GiB device-to-device ``copy_`` (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = per_call_ms(lambda: dst.copy_(src), warmup, repeats)
    return 2 * src.numel() / ms / 1e6


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--shape", type=int, nargs=2, default=(16384, 8192), metavar=("M", "K"))
    ap.set_defaults(warmup=3, repeats=15)
    args = ap.parse_args()
    m, k = args.shape
    torch.manual_seed(0)
    w = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    scale_bytes = 4 * -(-m // BLOCK[0]) * -(-k // BLOCK[1])
    moved = {"quantize": 3 * m * k + scale_bytes, "dequantize": 3 * m * k + scale_bytes}
    base = copy_gbs(args.warmup, args.repeats)
    q_ref, s_ref = quantize_fp8_blockwise(w, BLOCK)
    deq_ref = dequantize_fp8_blockwise(q_ref, s_ref, BLOCK, torch.bfloat16)
    rows: dict[str, dict[str, Any]] = {}
    device = CudaDevice()
    contenders: dict[str, Any] = {
        "triton": TritonFp8Quantizer(device),
        "triton_untuned": TritonFp8Quantizer(device, autotune=False),
    }
    for name, quant in contenders.items():
        q, s = quant.quantize(w, BLOCK)
        exact = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        exact &= torch.equal(quant.dequantize(q_ref, s_ref, BLOCK, torch.bfloat16), deq_ref)
        row: dict[str, Any] = {"bit_identical_to_torch": bool(exact)}
        for op, fn in (
            ("quantize", lambda quant=quant: quant.quantize(w, BLOCK)),
            ("dequantize", lambda quant=quant: quant.dequantize(q_ref, s_ref, BLOCK, torch.bfloat16)),
        ):
            ms = per_call_ms(fn, args.warmup, args.repeats)
            one = harness.timeit(fn, warmup=0, repeats=args.repeats, device="cuda").median * 1e3
            gbs = moved[op] / ms / 1e6
            row[op] = {"ms": ms, "gbs": gbs, "of_copy": harness.ratio(gbs, base), "isolated_call_ms": one}
        rows[name] = row
    torch_ms = per_call_ms(lambda: quantize_fp8_blockwise(w, BLOCK), 1, max(3, args.repeats // 3))
    rows["torch"] = {"quantize": {"ms": torch_ms, "gbs": moved["quantize"] / torch_ms / 1e6}}
    tri = rows["triton"]
    summary = (
        f"{m}x{k} bf16: quantise {tri['quantize']['of_copy']:.0%} / dequantise "
        f"{tri['dequantize']['of_copy']:.0%} of copy ({base:.0f} GB/s); "
        f"{harness.ratio(torch_ms, tri['quantize']['ms']):.1f}x the torch quantiser; "
        f"bit-identical {tri['bit_identical_to_torch']}"
    )
    harness.report(
        "fp8",
        {"copy_gbs": base, "shape": [m, k], "block": BLOCK, "rows": rows},
        summary,
        harness.out_dir(args),
    )


if __name__ == "__main__":
    main()
