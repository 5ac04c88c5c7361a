"""Cost per call of ``prof.range(name)`` and ``prof.annotate``-wrapped calls, against bare baselines.

    OMP_NUM_THREADS=1 python -m benchmarks.cpu.bench_profiler_overhead [--out DIR]

In one process it times (best of ``--repeats`` runs of ``--calls`` iterations, nanoseconds per iteration with the empty
loop's cost subtracted): a bare function call, ``with`` on a shared ``contextlib.nullcontext()``, and
the same two operations through the ``off`` profiler, through the ``torch`` profiler on a step it does
not record, and (for information) while it records. Prints the table, the ratios of ``off`` to the
baselines and whether ``off`` stays under 1 microsecond per call (the contract of ``Profiler``); writes
``OUT/profiler_overhead.json``.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable

from benchmarks import _harness as harness
from underlay import registry
from underlay.interfaces import Profiler

_NULL = contextlib.nullcontext()


def _best_ns(body: Callable[[int], None], calls: int, repeats: int) -> float:
    """Fastest of ``repeats`` runs of ``body(calls)``, in ns per iteration."""
    return harness.timeit(lambda: body(calls), warmup=0, repeats=repeats).min / calls * 1e9


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
    """Measure, print the table, write the record."""
    ap = harness.parser(__doc__)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.set_defaults(repeats=7)
    args = ap.parse_args()
    out = harness.out_dir(args)
    with tempfile.TemporaryDirectory() as tmp:
        rows = _measure(args.calls, args.repeats, tmp)
    ns = dict(rows)
    off_range, off_ann = ns["off: with prof.range(name)"], ns["off: annotate-wrapped call"]
    null, bare = ns["baseline: with shared nullcontext()"], ns["baseline: bare function call"]
    print(_table(rows))
    summary = (
        f"off range / nullcontext = {harness.ratio(off_range, null):.2f}x; "
        f"off annotate / bare call = {harness.ratio(off_ann, bare):.2f}x; "
        f"off under 1 us per call: {'yes' if max(off_range, off_ann) < 1000 else 'NO'}"
    )
    result = {
        "ns_per_call": ns,
        "method": f"best of {args.repeats} runs of {args.calls} iterations (recording rows: "
        f"{max(1, args.calls // 50)}), empty-loop cost subtracted",
    }
    harness.report("profiler_overhead", result, summary, out)


if __name__ == "__main__":
    main()
