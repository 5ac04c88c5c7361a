"""Sequence-length balancing: karmarkar_karp vs greedy_lpt vs contiguous chunks on GRPO-like lengths.

    OMP_NUM_THREADS=1 python -m benchmarks.cpu.bench_balancing [--out DIR]

Prints, per (items, k, workload), the max/mean load of each method (1.0 = perfect), the ratio of the
slowest partition's load under contiguous chunks (the baseline) to that under karmarkar_karp (the
step-time gain of balancing) and the wall times (best of ``--repeats``); writes ``OUT/balancing.json``.
"""

from __future__ import annotations

import numpy as np

from benchmarks import _harness as harness
from underlay.ops import ATTENTION_WORKLOAD_A, greedy_lpt, karmarkar_karp, partition_loads


def grpo_lengths(prompts: int, responses: int, seed: int) -> list[int]:
    """``prompts * responses`` sequence lengths: a shared prompt length per group plus lognormal
    response lengths (median ~400 tokens, long tail) clipped to 8192, as in GRPO rollouts."""
    rng = np.random.default_rng(seed)
    prompt = np.repeat(rng.integers(64, 1024, size=prompts), responses)
    response = np.clip(rng.lognormal(6.0, 1.0, size=prompts * responses), 16, 8192)
    return (prompt + response).astype(int).tolist()


def contiguous(n: int, k: int) -> list[list[int]]:
    """The baseline: k chunks of consecutive items in batch order."""
    bounds = np.linspace(0, n, k + 1).astype(int)
    return [list(range(bounds[j], bounds[j + 1])) for j in range(k)]


def imbalance(weights: list[float], parts: list[list[int]]) -> float:
    """max load / mean load."""
    loads = partition_loads(weights, parts)
    return max(loads) / (sum(loads) / len(loads))


def main() -> None:
    args = harness.parser(__doc__).parse_args()
    out = harness.out_dir(args)
    cases = [(64, 8, 8), (256, 16, 32), (1024, 8, 64)]  # (prompts, responses per prompt, k)
    rows = []
    for prompts, responses, k in cases:
        lens = grpo_lengths(prompts, responses, seed=prompts + k)
        n = len(lens)
        for workload in ("linear", "attention"):
            w = [float(s) if workload == "linear" else ATTENTION_WORKLOAD_A * s + float(s) * s for s in lens]
            kk = karmarkar_karp(w, k)
            t_kk = harness.timeit(lambda w=w, k=k: karmarkar_karp(w, k), warmup=0, repeats=args.repeats).min
            t_lpt = harness.timeit(lambda w=w, k=k: greedy_lpt(w, k), warmup=0, repeats=args.repeats).min
            eq = karmarkar_karp(w, k, equal_size=True)
            rows.append(
                (
                    n,
                    k,
                    workload,
                    imbalance(w, kk),
                    imbalance(w, eq),
                    imbalance(w, greedy_lpt(w, k)),
                    imbalance(w, contiguous(n, k)),
                    t_kk * 1e3,
                    t_lpt * 1e3,
                )
            )
    header = (
        "| items | k | workload | KK max/mean | KK equal-size | greedy LPT | contiguous "
        "| slowest rank: contiguous / KK | KK ms | LPT ms |"
    )
    lines = [header, "|" + "---|" * 10]
    for n, k, wl, kk, eq, lpt, cont, tkk, tlpt in rows:
        lines.append(
            f"| {n} | {k} | {wl} | {kk:.6f} | {eq:.6f} | {lpt:.6f} | {cont:.4f} | {cont / kk:.3f}x "
            f"| {tkk:.1f} | {tlpt:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    big = [r for r in rows if r[0] == 8192 and r[1] == 64]
    summary = "8192 items -> 64 parts, max/mean: " + "; ".join(
        f"{r[2]} KK {r[3]:.6f} vs contiguous {r[6]:.3f} vs LPT {r[5]:.5f}, KK {r[7]:.1f} ms" for r in big
    )
    keys = ("items", "k", "workload", "kk", "kk_equal_size", "greedy_lpt", "contiguous", "kk_ms", "lpt_ms")
    harness.report("balancing", {"rows": [dict(zip(keys, r)) for r in rows]}, summary, out)


if __name__ == "__main__":
    main()
