"""Disaggregated rollout weight sync on the cpu: a broadcast over a stateless gloo group (issue 21).

The same measurement as ``benchmarks/gpu/bench_weight_sync.py --mode disaggregated`` on the cpu: the
fsdp2 engine (one trainer rank, fp32) streams its weights through ``WeightSender.disaggregated`` (gloo,
its own TCPStore rendezvous) into an ``HFRolloutWorker`` process; reports sync GB/s against the memory
copy bandwidth measured in the same run.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_weight_sync_gloo.py --out /tmp/ws_gloo

Default model: ``small`` (Qwen2 shape, 6 layers, hidden 768, 75 M parameters, 0.3 GB fp32).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location(
        "bench_weight_sync", Path(__file__).parent / "gpu" / "bench_weight_sync.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = [
        "--device",
        "cpu",
        "--mode",
        "disaggregated",
        "--size",
        "small",
        "--bucket-mb",
        "64",
        *sys.argv[1:],
    ]
    sys.exit(bench.main(args))
