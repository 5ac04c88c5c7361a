"""Cost per call of ``prof.range(name)`` and ``prof.annotate``-wrapped calls, against bare baselines.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_profiler_overhead.py``. In one process it
times (best of ``--repeats`` runs of ``--calls`` iterations, nanoseconds per iteration with the empty
loop's cost subtracted): a bare function call, ``with`` on a shared ``contextlib.nullcontext()``, and
the same two operations through the ``off`` profiler, through the ``torch`` profiler on a step it does
not record, and (for information) while it records. Prints the table, the ratios of ``off`` to the
baselines and whether ``off`` stays under 1 microsecond per call (the contract of ``Profiler``); writes
the table into ``benchmarks/results/profiler_cpu_<date>.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from underlay import registry
from underlay.interfaces import Profiler

RESULTS = Path(__file__).resolve().parent / "results"
_NULL = contextlib.nullcontext()


def _best_ns(body: Callable[[int], None], calls: int, repeats: int) -> float:
    """Fastest of ``repeats`` runs of ``body(calls)``, in ns per iteration."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        body(calls)
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best


def _empty(n: int) -> None:
    for _ in range(n):
        pass


def _work(x: int) -> int:
    return x


def _calls(fn: Callable[[int], int]) -> Callable[[int], None]:
    def body(n: int) -> None:
        for i in range(n):
            fn(i)

    return body


def _with_null(n: int) -> None:
    for _ in range(n):
        with _NULL:
            pass


def _ranges(prof: Profiler) -> Callable[[int], None]:
    def body(n: int) -> None:
        rng = prof.range
        for _ in range(n):
            with rng("bench"):
                pass

    return body


def _measure(calls: int, repeats: int, out_dir: str) -> list[tuple[str, float]]:
    loop = _best_ns(_empty, calls, repeats)
    rows: list[tuple[str, float]] = []

    def add(label: str, body: Callable[[int], None], n: int = calls) -> None:
        rows.append((label, max(0.0, _best_ns(body, n, repeats) - loop)))

    add("baseline: bare function call", _calls(_work))
    add("baseline: with shared nullcontext()", _with_null)
    off = registry.get_profiler({"ranks": []}, name="off")
    add("off: with prof.range(name)", _ranges(off))
    add("off: annotate-wrapped call", _calls(off.annotate("bench")(_work)))
    idle = registry.get_profiler({"ranks": [], "steps": [10**9], "output_dir": out_dir}, name="torch")
    idle.start()
    add("torch, step not recorded: prof.range(name)", _ranges(idle))
    add("torch, step not recorded: annotate-wrapped call", _calls(idle.annotate("bench")(_work)))
    idle.stop()
    rec = registry.get_profiler({"ranks": [], "steps": [], "output_dir": out_dir}, name="torch")
    rec.start()
    small = max(1, calls // 50)
    add("torch, recording: prof.range(name)", _ranges(rec), small)
    add("torch, recording: annotate-wrapped call", _calls(rec.annotate("bench")(_work)), small)
    rec.stop()
    return rows


def _table(rows: list[tuple[str, float]]) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"| {'operation':<{width}} | ns/call |", f"|{'-' * (width + 2)}|--------:|"]
    lines += [f"| {label:<{width}} | {ns:7.1f} |" for label, ns in rows]
    return "\n".join(lines)


def main() -> None:
    """Measure, print, and record the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-record", action="store_true", help="do not write benchmarks/results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = _measure(args.calls, args.repeats, tmp)
    ns = dict(rows)
    off_range, off_ann = ns["off: with prof.range(name)"], ns["off: annotate-wrapped call"]
    null, bare = ns["baseline: with shared nullcontext()"], ns["baseline: bare function call"]
    table = _table(rows)
    summary = (
        f"off range / nullcontext = {off_range / max(null, 1e-9):.2f}x; "
        f"off annotate / bare call = {off_ann / max(bare, 1e-9):.2f}x; "
        f"off under 1 us per call: {'yes' if max(off_range, off_ann) < 1000 else 'NO'}"
    )
    print(table)
    print(summary)
    if args.no_record:
        return
    from underlay.backends.cpu.device import CpuDevice

    today = _dt.date.today().isoformat()
    cmd = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_profiler_overhead.py " + " ".join(sys.argv[1:])
    text = (
        f"# Profiler overhead on CPU ({today})\n\n"
        f"- hardware: {CpuDevice().model_name()}, {os.cpu_count()} logical cores, shared with other jobs "
        f"(1-min load average {os.getloadavg()[0]:.1f} at the end of the run)\n"
        f"- versions: Python {platform.python_version()}, torch {torch.__version__}\n"
        f"- command: `{cmd.strip()}`\n"
        f"- method: best of {args.repeats} runs of {args.calls} iterations (recording rows: "
        f"{max(1, args.calls // 50)}), empty-loop cost subtracted\n\n"
        f"{table}\n\n{summary}\n"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"profiler_cpu_{today}.md"
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
