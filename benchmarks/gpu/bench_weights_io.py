"""``benchmarks/bench_weights_io.py`` on one H200 (issue 23, item 5): ``load_hf`` / ``export_hf`` GB/s of a
3 GB Qwen2-shaped bf16 model against the raw file read and write speed of the same host, same run.

    PYTHONPATH=src python benchmarks/gpu/bench_weights_io.py [--out DIR] [more bench_weights_io args]

One rank (nccl, world 1): loading reads every file on that rank, copies each round to the GPU in one
transfer from pinned memory and converts there; export gathers nothing (world 1) and overlaps the
device-to-host copies with the writer thread. Defaults: ``--device cuda --world 1 --repeat 1
--out $OUT/weightsio`` (fits the ~120 s of the ``weightsio`` step of ``run_h200.sh``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1]))  # spawned ranks import it by name too
    import bench_weights_io as bench

    user = sys.argv[1:]
    args = ["--device", "cuda", "--world", "1", "--repeat", "1"]
    if "--out" not in user:
        args += ["--out", str(Path(os.environ.get("OUT", "/tmp/underlay_gpu_out")) / "weightsio")]
    sys.exit(bench.main([*args, *user]))
