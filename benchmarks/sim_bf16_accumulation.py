"""How much a bf16 weight-gradient accumulation across row chunks costs in precision (CPU, float64).

A loss-fused linear -> cross-entropy kernel (Liger's design) computes ``grad_W += dlogits_c.T @ h_c`` for
each chunk ``c`` of rows and keeps ``grad_W`` in the weight dtype; every chunk rounds the running sum to
bf16 once. This script measures the normwise relative error of that against the float64 gradient, for 1
to 64 chunks, with ``h`` already bf16 (as in training) and ``dlogits`` rounded to bf16 once (as any kernel
does before a bf16 matmul). The baseline in the same run is the error of rounding the float64 gradient to
bf16 once (the floor), and the bound used by ``benchmarks/gpu/check_logprob.py`` is 2^-8.

Run: ``python benchmarks/sim_bf16_accumulation.py``.
"""

from __future__ import annotations

import torch


def main() -> None:
    torch.manual_seed(0)
    n, h, v = 8192, 256, 2048
    hid = torch.randn(n, h).bfloat16().double()
    w = (torch.randn(v, h) * 0.05).bfloat16().double()
    p = torch.softmax(hid @ w.T, -1)
    labels = torch.randint(0, v, (n,))
    g = torch.randn(n, dtype=torch.float64)
    dl = -p * g[:, None]
    dl[torch.arange(n), labels] += g
    ref = dl.T @ hid
    dlb = dl.bfloat16().double()

    def rel(a: torch.Tensor) -> float:
        return float((a.double() - ref).norm() / ref.norm())

    floor = rel(ref.bfloat16())
    print(
        f"N={n} H={h} V={v}; floor (float64 gradient rounded to bf16 once): {floor:.2e}; bound 2^-8 = {2**-8:.2e}"
    )
    for chunks in (1, 2, 4, 8, 16, 32, 64):
        rows = n // chunks
        acc = torch.zeros(v, h, dtype=torch.bfloat16)
        for c in range(chunks):
            part = dlb[c * rows : (c + 1) * rows].T @ hid[c * rows : (c + 1) * rows]
            acc = (acc.double() + part).bfloat16()
        err = rel(acc)
        print(
            f"{chunks:3d} chunks: {err:.2e} ({err / floor:.2f}x the floor){'  over the bound' if err > 2**-8 else ''}"
        )


if __name__ == "__main__":
    main()
