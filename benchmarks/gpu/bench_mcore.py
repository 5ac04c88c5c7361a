"""mcore vs fsdp2 training throughput on ``bench_fsdp2.py``'s workload, in the same run (issue 17).

The Qwen2-shaped 1.5B model and GRPO-like length mix of ``bench_fsdp2.py``; both engines bf16 compute /
fp32 master weights, packed micro-batches of at most 16384 tokens, the same sequences. mcore runs at
TP=1 (world size 1) with megatron's DDP + distributed optimizer; fsdp2 with its benchmark settings
(``--fsdp2-variant``, default ``none+layer@0.85``). Prints tokens/s of both and the ratio (goal:
mcore >= 0.9x fsdp2); writes ``$OUT/mcore_bench.json``. Needs megatron-core (the lead installs the
0.19.2 wheel from ``.whl/``); nothing else beyond torch/transformers/numpy.

    PYTHONPATH=src python benchmarks/gpu/bench_mcore.py --out OUT [--profile]

``--profile`` profiles one more step of each engine (torch profiler: the 30 costliest device ops and
``trace_gaps.py``'s idle-gap attribution) into ``OUT/mcore_profile_tp1.txt`` and
``OUT/fsdp2_profile_<variant>.txt``: the comparison that shows where mcore's step loses time. It also
counts the device->host synchronisations of one mcore ``forward_backward`` and one ``optimizer_step``
(``torch.cuda.set_sync_debug_mode("warn")``: every synchronising CUDA call warns; grouped by the
Python line that made it), for a batch given on the host and for the same batch on the device, into
``OUT/mcore_syncs_tp1.json`` (expected: forward_backward = the metrics read at its end plus
megatron's own, optimizer_step = the grad-norm read).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fsdp2 as bf

from underlay.interfaces import EngineConfig, ModelConfig, OptimConfig


def bench_mcore(cfg: Any, work: list[Any], args: Any, dev: Any) -> dict[str, Any]:
    """Time ``forward_backward`` + ``optimizer_step`` of the mcore engine over ``work``."""
    from underlay.registry import get_engine

    ec = EngineConfig(
        model=ModelConfig(hf_config=cfg, seed=0),
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
        micro_batch_max_tokens=bf.MAX_TOKENS if not args.quick else 256,
        param_dtype="bfloat16",
        reduce_dtype="float32",
        with_entropy=False,
        recompute=args.mcore_recompute,
    )
    t0 = time.perf_counter()
    engine = get_engine(ec, "mcore")
    build_s = time.perf_counter() - t0
    dev.synchronize()
    dev.reset_peak_memory_stats()
    times: list[float] = []
    for i, step in enumerate(work):
        dev.synchronize()
        t = time.perf_counter()
        engine.forward_backward(step.batch, bf.pg_loss)
        engine.optimizer_step()
        dev.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    peak = dev.memory_stats().peak_allocated
    if args.profile and dev.is_accelerator:
        profile_mcore_step(engine, work[-1].batch, args.out)
        syncs = count_syncs(engine, work[-1].batch)
        print(json.dumps(syncs, indent=1), flush=True)
        out_dir = Path(args.out) if args.out else None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "mcore_syncs_tp1.json").write_text(json.dumps(syncs, indent=1))
    del engine
    gc.collect()
    dev.empty_cache()
    return {"times": times, "peak": peak, "build_s": build_s}


def profile_mcore_step(engine: Any, batch: Any, out: str | None) -> None:
    """One mcore step (``forward_backward`` + ``optimizer_step``) under torch.profiler: its wall time,
    the 30 costliest device ops and the idle-gap attribution of ``trace_gaps.py``, printed and
    written to ``OUT/mcore_profile_tp1.txt`` (a temp dir without ``--out``); the fsdp2 step of the
    same run is profiled by ``bench_fsdp2.bench_engine`` (``fsdp2_profile_<variant>.txt``)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function
    from trace_gaps import analyse

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        with record_function("bench.forward_backward"):
            engine.forward_backward(batch, bf.pg_loss)
        with record_function("bench.optimizer_step"):
            engine.optimizer_step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="mcore_profile_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / "mcore_trace_tp1.json"
    prof.export_chrome_trace(str(trace))
    gaps = analyse(json.loads(trace.read_text()), top=22)
    trace.unlink()  # tens of MB; the report is what comes back
    text = f"profiled mcore step (tp1): wall {wall:.3f} s ('Self CUDA time total' is kernel time)\n{table}\n{gaps}"
    print(text, flush=True)
    (out_dir / "mcore_profile_tp1.txt").write_text(text)


def count_syncs(engine: Any, batch: Any) -> dict[str, Any]:
    """Synchronising CUDA calls of one ``forward_backward`` and one ``optimizer_step`` (under
    ``torch.cuda.set_sync_debug_mode("warn")``), for ``batch`` on the host and on the device: per
    phase the count and the ``file:line`` sites that made them (most frequent first)."""
    import warnings
    from collections import Counter
    from collections.abc import Callable

    result: dict[str, Any] = {}
    for where, b in (
        ("host_batch", batch.to(torch.device("cpu"))),
        ("device_batch", batch.to(engine.device.torch_device())),
    ):
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("forward_backward", lambda b=b: engine.forward_backward(b, bf.pg_loss)),
            ("optimizer_step", engine.optimizer_step),
        ]
        for phase, call in calls:
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    call()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            sites = Counter(
                f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"
                for w in rec
                if "synchroniz" in str(w.message)
            )
            result[f"{where}/{phase}"] = {"count": sum(sites.values()), "sites": dict(sites.most_common())}
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--same-batch", action="store_true")
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one more step of mcore and of fsdp2 (top ops, idle gaps)",
    )
    p.add_argument("--fsdp2-variant", default="none+layer@0.85")
    p.add_argument("--mcore-recompute", default="none", choices=["none", "full", "selective"])
    args = p.parse_args()
    from underlay.registry import get_device

    dev = get_device()
    cfg = bf.model_config(args.quick)
    work = bf.workload(cfg, args, 0)
    tokens = [sum(s.lens) for s in work[args.warmup :]]
    results: dict[str, Any] = {}
    results["mcore"] = bench_mcore(cfg, work, args, dev)
    m = results["mcore"]
    print(f"mcore  {sum(tokens) / sum(m['times']):10.0f} tokens/s (before the fsdp2 run)", flush=True)
    results["fsdp2"] = bf.bench_engine(cfg, work, args, dev, args.fsdp2_variant)
    rows = {}
    for name, r in results.items():
        tps = sum(tokens) / sum(r["times"])
        rows[name] = {"tokens_per_s": tps, "peak_gib": r["peak"] / 2**30, "build_s": r["build_s"]}
        print(f"{name:6s} {tps:10.0f} tokens/s  peak {r['peak'] / 2**30:6.1f} GiB", flush=True)
    ratio = rows["mcore"]["tokens_per_s"] / rows["fsdp2"]["tokens_per_s"]
    print(f"mcore / fsdp2 tokens/s = {ratio:.3f} (goal >= 0.9)", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "mcore_bench.json").write_text(json.dumps({"rows": rows, "ratio": ratio}, indent=1))
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
