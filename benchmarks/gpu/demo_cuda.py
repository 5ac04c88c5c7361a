"""``UNDERLAY_DEVICE=cuda underlay demo`` on one GPU (issue 7): the same miniature GRPO loop as on CPU.

Run from the repository root on the GPU host::

    PYTHONPATH=src python benchmarks/gpu/demo_cuda.py

Writes ``$OUT/demo_cuda.json`` (the run's summary plus versions and the command) and the demo's outputs
under ``$OUT/demo_cuda/`` (metrics jsonl, TensorBoard events, the profiler trace, summary.json; the
checkpoint and HF export are deleted afterwards to keep the results small). Prints the demo's table
and a final ``check | result`` table. Exits non-zero when the demo fails (resume or export mismatch).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path


def main() -> int:
    os.environ["UNDERLAY_DEVICE"] = "cuda"
    out = Path(os.environ.get("OUT", "gpu_out"))
    run_dir = out / "demo_cuda"
    import torch
    import transformers

    from underlay.demo import DemoConfig, run_demo
    from underlay.demo.launch import format_summary

    cfg = DemoConfig(out_dir=str(run_dir), progress=False)
    t0 = time.perf_counter()
    summary = run_demo(cfg)
    wall = time.perf_counter() - t0
    print(format_summary(summary))
    for big in ("checkpoints", "hf_export"):
        shutil.rmtree(run_dir / big, ignore_errors=True)
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": "PYTHONPATH=src python benchmarks/gpu/demo_cuda.py",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "wall_s": wall,
        "summary": summary,
    }
    (out / "demo_cuda.json").write_text(json.dumps(record, indent=2, default=str))
    hist = summary["history"]
    rows = [
        ("device", f"{summary['world_size']} x {summary['device_model']} ({summary['param_dtype']})"),
        ("steps", str(len(hist))),
        ("reward first -> last", f"{hist[0]['reward/mean']:.3f} -> {hist[-1]['reward/mean']:.3f}"),
        ("tokens/s (last step)", f"{hist[-1]['tokens_per_s']:.0f}"),
        (
            "resume identical",
            f"{summary['resume']['identical']} (rel diff {summary['resume']['max_rel_diff']:.2g})",
        ),
        ("export max |dlogits|", f"{summary['export']['max_abs_logit_diff']:.3g}"),
        ("export max |dlogp| vs engine", f"{summary['export']['max_abs_logprob_diff_vs_engine']:.3g}"),
        ("trace", ", ".join(summary["traces"]) or "(none)"),
        ("wall time", f"{wall:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\ncheck".ljust(width + 1) + " | result")
    for k, v in rows:
        print(f"{k.ljust(width)} | {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
