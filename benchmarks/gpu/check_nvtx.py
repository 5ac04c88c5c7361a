"""Profilers and memory instruments on one CUDA GPU (issue 6, item 4): nvtx, torch, snapshots, timers.

Checks, on the selected cuda device:
1. ``nvtx``: a 6-step bf16 matmul loop with ``prof.range`` and an ``annotate``-d function, steps [2, 3]
   configured, runs without error (range_push/pop balanced, cudaProfilerStart/Stop around steps 2-3).
   nsys is not installed on the lent machine, so the NVTX ranges are emitted but not captured here;
   capture them with ``nsys profile --capture-range=cudaProfilerApi python ...`` elsewhere.
2. The cost of one ``prof.range`` while recording under nvtx vs the ``off`` profiler (host us/call).
3. ``torch`` profiler with CUDA activity: the chrome trace of step 1 holds the step's range and at least
   one CUDA kernel event, and no range of the other steps.
4. ``memory_snapshot`` after ``record_memory_history``: the pickle has segments and alloc events.
5. ``timer`` (synchronising) of a matmul agrees with CUDA-event timing within 20 % + 50 us.

Run (repo root): ``PYTHONPATH=src python3 benchmarks/gpu/check_nvtx.py``; prints a table and writes
``$OUT/check_nvtx.json`` (or ./check_nvtx.json without $OUT). Exit status 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("UNDERLAY_DEVICE", "cuda")

import torch

from underlay import profiling, registry


def check_nvtx(dev: Any) -> dict[str, Any]:
    """Run the nvtx profiler around 6 matmul steps (steps 2-3 recorded)."""
    prof = registry.get_profiler({"steps": [2, 3], "ranks": []}, name="nvtx")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    @prof.annotate()
    def mm(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ x / 64)

    recorded = []
    prof.start()
    for i in range(6):
        recorded.append(prof.recording)  # type: ignore[attr-defined]
        with prof.range(f"step_body{i}"):
            a = mm(a)
        prof.step()
    prof.stop()
    dev.synchronize()
    ok = bool(torch.isfinite(a).all()) and recorded == [False, False, True, True, False, False]
    return {"check": "nvtx ranges + capture range", "ok": ok, "recorded_steps": recorded}


def range_cost(name: str, calls: int = 20000) -> float:
    """Host microseconds per ``with prof.range(...)`` while recording (nvtx) or under ``off``."""
    cfg: dict[str, Any] = {"steps": [], "ranks": []}
    if name == "nvtx":
        cfg["options"] = {"capture_range": False}
    prof = registry.get_profiler(cfg, name=name)
    prof.start()
    rng = prof.range
    t0 = time.perf_counter()
    for _ in range(calls):
        with rng("r"):
            pass
    dt = (time.perf_counter() - t0) / calls * 1e6
    prof.stop()
    return dt


def check_torch_trace(out: Path) -> dict[str, Any]:
    """torch profiler with CUDA activity: step 1 only, kernels present."""
    prof = registry.get_profiler(
        {"steps": [1], "warmup": 1, "ranks": [], "output_dir": str(out)}, name="torch"
    )
    a = torch.randn(2048, 2048, device="cuda")
    prof.start()
    for i in range(3):
        with prof.range(f"work{i}"):
            a = torch.tanh(a @ a / 45)
        prof.step()
    prof.stop()
    traces = prof.traces  # type: ignore[attr-defined]
    if len(traces) != 1:
        return {"check": "torch trace with CUDA", "ok": False, "traces": [str(t) for t in traces]}
    events = json.loads(Path(traces[0]).read_text())["traceEvents"]
    works = sorted({e["name"] for e in events if str(e.get("name", "")).startswith("work")})
    kernels = sum(1 for e in events if e.get("cat") == "kernel")
    ok = works == ["work1"] and kernels > 0
    return {"check": "torch trace with CUDA", "ok": ok, "ranges": works, "kernel_events": kernels}


def check_snapshot(dev: Any, out: Path) -> dict[str, Any]:
    """Allocator history and snapshot."""
    profiling.record_memory_history(max_entries=10000, device=dev)
    x = [torch.empty(1 << 20, device="cuda") for _ in range(4)]
    path = profiling.memory_snapshot(out / "snap.pickle", device=dev)
    profiling.record_memory_history(False, device=dev)
    del x
    freed = profiling.aggressive_empty_cache(dev)
    with path.open("rb") as fh:
        snap = pickle.load(fh)
    allocs = sum(1 for t in snap["device_traces"] for e in t if e.get("action") == "alloc")
    ok = bool(snap["segments"]) and allocs >= 4
    return {"check": "memory snapshot", "ok": ok, "alloc_events": allocs, "freed_bytes": freed}


def check_timer(dev: Any) -> dict[str, Any]:
    """timer() against CUDA events for one large matmul."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum()
    metrics: dict[str, float] = {}
    start, end = dev.new_event(), dev.new_event()
    with profiling.timer("mm", metrics, device=dev):
        start.record()
        for _ in range(10):
            a @ a
        end.record()
    ev_s = start.elapsed_ms(end) / 1e3
    ok = abs(metrics["mm"] - ev_s) <= 0.2 * ev_s + 50e-6
    return {"check": "timer vs cuda events", "ok": ok, "timer_s": metrics["mm"], "events_s": ev_s}


def main() -> int:
    """Run every check, print the table, write the JSON."""
    dev = registry.get_device()
    if dev.name != "cuda":
        print(f"needs a cuda device, got {dev.name!r}")
        return 1
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        checks: list[tuple[str, Any]] = [
            ("nvtx ranges + capture range", lambda: check_nvtx(dev)),
            ("torch trace with CUDA", lambda: check_torch_trace(Path(tmp) / "trace")),
            ("memory snapshot", lambda: check_snapshot(dev, Path(tmp))),
            ("timer vs cuda events", lambda: check_timer(dev)),
        ]
        for label, fn in checks:
            try:
                rows.append(fn())
            except Exception as exc:  # report and continue with the other checks
                rows.append({"check": label, "ok": False, "error": repr(exc)})
    cost = {"nvtx_range_us": range_cost("nvtx"), "off_range_us": range_cost("off")}
    result = {
        "device": dev.model_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "nsys": "not available: NVTX ranges emitted, not captured",
        "checks": rows,
        "range_cost": cost,
    }
    print(f"{'check':<30} {'ok':<5} details")
    for r in rows:
        details = {k: v for k, v in r.items() if k not in ("check", "ok")}
        print(f"{r['check']:<30} {r['ok']!s:<5} {details}")
    print(f"range cost (host): nvtx {cost['nvtx_range_us']:.2f} us, off {cost['off_range_us']:.3f} us")
    path = Path(os.environ.get("OUT", ".")) / "check_nvtx.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
