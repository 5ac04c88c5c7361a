"""Where does the GPU sit idle? Idle-gap attribution for a torch.profiler chrome trace.

    python -m underlay.profiling.trace_gaps TRACE.json [--top 25] [--min-gap-us 5]

The device is busy while any kernel, memcpy or memset runs (the union over all streams). Every idle gap
inside the traced span is charged to the host work that ended it: the launch (runtime or driver call)
of the first device event after the gap, and the stack of CPU ops and user annotations around that
launch on its thread. A gap that starts when a host synchronisation returns (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, ``cudaEventSynchronize`` or a device-to-host ``cudaMemcpy*``) is also counted
under the op that synchronised, so the report shows both what starved the device and which syncs
drained its queue.

Prints: busy and idle time, the gap-size histogram, and the top stacks by idle time charged.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
HOST_CATS = frozenset({"cpu_op", "user_annotation"})
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


@dataclass(frozen=True)
class Span:
    """One complete ("X") trace event: start and end in microseconds, its name and thread id."""

    start: float
    end: float
    name: str
    tid: Any


def _spans(events: list[dict[str, Any]], cats: frozenset[str]) -> list[Span]:
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in cats and "dur" in e:
            ts = float(e["ts"])
            out.append(Span(ts, ts + float(e["dur"]), str(e.get("name", "?")), e.get("tid")))
    return out


def busy_intervals(device: list[Span]) -> list[tuple[float, float]]:
    """Union of the device spans, sorted and merged."""
    merged: list[tuple[float, float]] = []
    for s in sorted(device, key=lambda x: x.start):
        if merged and s.start <= merged[-1][1]:
            if s.end > merged[-1][1]:
                merged[-1] = (merged[-1][0], s.end)
        else:
            merged.append((s.start, s.end))
    return merged


class HostStacks:
    """The CPU ops and annotations around a time on one thread. Spans nest per thread, so each gets
    its innermost enclosing span as parent (one sweep), and a lookup walks up from the last span that
    started before the time."""

    def __init__(self, host: list[Span]) -> None:
        by_tid: dict[Any, list[Span]] = defaultdict(list)
        for s in host:
            by_tid[s.tid].append(s)
        self._spans: dict[Any, list[Span]] = {}
        self._starts: dict[Any, list[float]] = {}
        self._parent: dict[Any, list[int]] = {}
        for tid, spans in by_tid.items():
            spans.sort(key=lambda x: (x.start, -x.end))
            parent: list[int] = []
            open_: list[int] = []
            for i, s in enumerate(spans):
                while open_ and spans[open_[-1]].end < s.start:
                    open_.pop()
                parent.append(open_[-1] if open_ else -1)
                open_.append(i)
            self._spans[tid], self._parent[tid] = spans, parent
            self._starts[tid] = [s.start for s in spans]

    def stack(self, tid: Any, t: float) -> list[str]:
        """Names of the spans on ``tid`` that contain ``t``, outermost first."""
        spans = self._spans.get(tid)
        if not spans:
            return []
        i = bisect.bisect_right(self._starts[tid], t) - 1
        parent = self._parent[tid]
        while i >= 0 and spans[i].end < t:
            i = parent[i]
        chain = []
        while i >= 0:
            chain.append(spans[i].name)
            i = parent[i]
        return chain[::-1]


def _label(stack: list[str], keep: int) -> str:
    """Outermost span, then the innermost ``keep``."""
    if not stack:
        return "(no host op around the launch)"
    if len(stack) <= keep + 1:
        return " > ".join(stack)
    return " > ".join([stack[0], "...", *stack[-keep:]])


def analyse(trace: dict[str, Any], top: int = 25, min_gap_us: float = 5.0, keep: int = 3) -> str:
    """The report (see the module docstring) for one loaded chrome trace."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device = _spans(events, DEVICE_CATS)
    if not device:
        return "no device events in the trace (was CUDA activity profiled?)"
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATS and isinstance(e.get("args"), dict) and "correlation" in e["args"]
    }
    first_device: dict[float, dict[str, Any]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS:
            ts = float(e["ts"])
            if ts not in first_device:
                first_device[ts] = e
    host = HostStacks(_spans(events, HOST_CATS))
    syncs = sorted(
        (s for s in _spans(events, LAUNCH_CATS) if s.name.startswith(SYNC_NAMES)), key=lambda s: s.end
    )
    sync_ends = [s.end for s in syncs]
    busy = busy_intervals(device)
    span_us = busy[-1][1] - busy[0][0]
    busy_us = sum(b - a for a, b in busy)
    starts_sorted = sorted(first_device)
    by_launch: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_sync: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    hist = [0.0] * 6  # <10us, <50us, <200us, <1ms, <5ms, >=5ms
    edges = (10, 50, 200, 1000, 5000)
    n_gaps = 0
    for (_, end_prev), (start_next, _) in itertools.pairwise(busy):
        gap = start_next - end_prev
        if gap < min_gap_us:
            continue
        n_gaps += 1
        hist[bisect.bisect_right(edges, gap)] += gap
        i = bisect.bisect_left(starts_sorted, start_next)
        ev = first_device[starts_sorted[min(i, len(starts_sorted) - 1)]]
        launch = launches.get((ev.get("args") or {}).get("correlation"))
        if launch is None:
            label = f"(launch not found) {ev.get('name', '?')[:60]}"
        else:
            label = _label(host.stack(launch.get("tid"), float(launch["ts"])), keep)
        by_launch[label][0] += gap
        by_launch[label][1] += 1
        j = bisect.bisect_left(sync_ends, end_prev)
        if j < len(syncs) and syncs[j].end - end_prev <= gap:
            s = syncs[j]
            key = _label([*host.stack(s.tid, s.start), s.name], keep)
            by_sync[key][0] += gap
            by_sync[key][1] += 1
    idle = span_us - busy_us
    lines = [
        f"span {span_us / 1e3:.1f} ms, device busy {busy_us / 1e3:.1f} ms ({busy_us / span_us:.1%}), "
        f"idle {idle / 1e3:.1f} ms in {n_gaps} gaps >= {min_gap_us:g} us",
        "idle by gap size: "
        + ", ".join(
            f"{name} {t / 1e3:.1f} ms"
            for name, t in zip(("<10us", "<50us", "<200us", "<1ms", "<5ms", ">=5ms"), hist)
        ),
        f"top {top} host stacks that ended a gap (idle ms, gaps):",
    ]
    for label, (t, n) in sorted(by_launch.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / 1e3:8.2f} ms {int(n):6d}  {label}")
    total_sync = sum(v[0] for v in by_sync.values())
    lines.append(f"gaps that began when a host sync returned: {total_sync / 1e3:.1f} ms; by syncing op:")
    for label, (t, n) in sorted(by_sync.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / 1e3:8.2f} ms {int(n):6d}  {label}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: print :func:`analyse` of the chrome trace file named in ``argv``; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    args = ap.parse_args(argv)
    print(analyse(json.loads(args.trace.read_text()), args.top, args.min_gap_us))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
