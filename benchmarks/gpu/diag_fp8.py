"""Which FP8 quantiser disagrees, and where: triton (manual and hardware rounding), torch on CUDA, torch on
CPU, each against an exact reference (IEEE fp32 division on the CPU, then round-to-nearest-even onto the
e4m3 grid in float64). Prints mismatch counts and the first disagreeing elements. Run on the GPU host:

    PYTHONPATH=src python3 benchmarks/gpu/diag_fp8.py
"""

from __future__ import annotations

import torch

from underlay.backends.cuda import fp8 as tfp8
from underlay.backends.cuda.device import CudaDevice
from underlay.ops.quant import _expand, quantize_fp8_blockwise


def e4m3_grid() -> torch.Tensor:
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    vals = vals[torch.isfinite(vals)]
    return torch.unique(vals)


def exact_rne(x: torch.Tensor) -> torch.Tensor:
    grid = e4m3_grid()
    xd = x.double().flatten()
    idx = torch.searchsorted(grid, xd).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    dlo, dhi = xd - lo, hi - xd
    lo_bits = lo.to(torch.float8_e4m3fn).view(torch.uint8)
    even_lo = (lo_bits & 1) == 0
    pick_lo = (dlo < dhi) | ((dlo == dhi) & even_lo)
    r = torch.where(pick_lo, lo, hi)
    r = torch.copysign(r.abs(), xd)  # the grid's zero may be -0.0; rounding keeps the sign of x
    return r.view(x.shape).to(torch.float8_e4m3fn)


def main() -> None:
    dev = torch.device("cuda")
    q = tfp8.TritonFp8Quantizer(CudaDevice())
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        w = (torch.randn(1000, 3000, device=dev) * torch.logspace(-5, 2, 3000, device=dev)).to(dtype)
        block = (128, 128)
        q_tr, s_tr = q.quantize(w, block)
        q_tc, s_tc = quantize_fp8_blockwise(w, block)
        q_cpu, s_cpu = quantize_fp8_blockwise(w.cpu(), block)
        x_cpu = w.cpu().float() / _expand(s_cpu, w.shape, *block)
        q_ex = exact_rne(x_cpu)
        print(
            f"== {dtype}: scales triton==torch-cuda {torch.equal(s_tr.cpu(), s_tc.cpu())}, "
            f"torch-cuda==cpu {torch.equal(s_tc.cpu(), s_cpu)}"
        )
        for name, val in (("triton", q_tr.cpu()), ("torch-cuda", q_tc.cpu()), ("torch-cpu", q_cpu)):
            bad = (val.view(torch.uint8) != q_ex.view(torch.uint8)).nonzero()
            print(f"{name:>11}: {len(bad)} of {w.numel()} differ from exact RNE")
            for i, j in bad[:6].tolist():
                print(
                    f"     [{i},{j}] w={w[i, j].item()!r} x={x_cpu[i, j].item()!r} got={val[i, j].float().item()} "
                    f"exact={q_ex[i, j].float().item()}"
                )


if __name__ == "__main__":
    main()
