"""Sequence-length balancing: karmarkar_karp vs greedy_lpt vs contiguous chunks on GRPO-like lengths.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_balancing.py``. Prints, per (items, k,
workload), the max/mean load of each method (1.0 = perfect), the ratio of the slowest partition's load
under contiguous chunks to that under karmarkar_karp (the step-time gain of balancing) and the wall
times; writes the table into
``benchmarks/results/ops_cpu_<date>.md`` (section "balancing").
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

from underlay.ops import ATTENTION_WORKLOAD_A, greedy_lpt, karmarkar_karp, partition_loads

RESULTS = Path(__file__).resolve().parent / "results"


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


def best_time(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


def environment() -> str:
    """Hardware and versions, for the results file."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"- hardware: {cpu}, {os.cpu_count()} cores\n"
        f"- python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}\n"
        f"- load average at start: {os.getloadavg()[0]:.1f} (the machine is shared; timings are noisy)\n"
    )


def write_section(name: str, command: str, body: str) -> Path:
    """Replace (or append) section ``name`` of ``benchmarks/results/ops_cpu_<date>.md``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"ops_cpu_{_dt.date.today().isoformat()}.md"
    text = path.read_text() if path.exists() else "# ops benchmarks on CPU\n"
    section = (
        f"<!-- {name} -->\n## {name}\n\nCommand: `{command}`\n\n{environment()}\n{body}\n<!-- /{name} -->\n"
    )
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->\n", re.S)
    text = (
        pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    )
    path.write_text(text)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    cases = [(64, 8, 8), (256, 16, 32), (1024, 8, 64)]  # (prompts, responses per prompt, k)
    rows = []
    for prompts, responses, k in cases:
        lens = grpo_lengths(prompts, responses, seed=prompts + k)
        n = len(lens)
        for workload in ("linear", "attention"):
            w = [float(s) if workload == "linear" else ATTENTION_WORKLOAD_A * s + float(s) * s for s in lens]
            kk = karmarkar_karp(w, k)
            t_kk = best_time(lambda w=w, k=k: karmarkar_karp(w, k), args.repeats)
            t_lpt = best_time(lambda w=w, k=k: greedy_lpt(w, k), args.repeats)
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
    summary = (
        f"\n8192 items -> 64 partitions: karmarkar_karp best of {args.repeats} = "
        + ", ".join(f"{r[2]} {r[7]:.1f} ms" for r in big)
        + " (target < 50 ms)"
    )
    print(summary)
    if not args.no_write:
        body = (
            "GRPO-like lengths: per prompt a shared prompt length U(64, 1024) plus lognormal(6, 1) "
            "response lengths clipped to [16, 8192]. Loads are max/mean (1.0 = perfect); "
            "'attention' workload = a*s + s^2 with a = ATTENTION_WORKLOAD_A.\n\n"
            + table
            + "\n"
            + summary
            + "\n"
        )
        print("wrote", write_section("balancing", " ".join([Path(sys.executable).name, *sys.argv]), body))


if __name__ == "__main__":
    main()
