"""mcore engine step time with and without megatron's gradient-reduce / parameter-gather overlap.

Model and workload: ``bench_fsdp2``'s (``--model``, default ``qwen2-1.5b`` random init; the GRPO-like
length mix, ``--sequences`` per rank and step, new sequences every step), bf16 compute with fp32
master weights and reduction, packed micro-batches of at most 16384 tokens, TP=1, megatron's
distributed optimizer. Variants (``--variants``, one engine each, in this order, on the same steps):

- ``off``: no overlap (the reduce-scatter runs in ``optimizer_step``, the all-gather at its end);
- ``grad``: ``overlap_grad_reduce=True`` (bucketed reduce-scatter started during the backward of the
  last micro-batch);
- ``both``: ``overlap_grad_reduce=True, overlap_param_gather=True`` (the updated shards all-gathered
  in the next forward's pre-hooks).

Per variant: seconds per step (``forward_backward`` + ``optimizer_step``, median over ``--steps`` timed
steps after ``--warmup``), real tokens/s, peak allocated memory, and the step losses. The losses of
every variant must equal ``off``'s bit for bit (same sums, started earlier): the record says whether
they do (``losses_equal``). At world size 1 (one GPU) the collectives are over a group of one, so the
figure is the overlap machinery's own cost (hooks, bucketing); under
``torchrun --nproc_per_node N`` (dp=N) it is the overlap's gain.

Run on the GPU host from the repo root (needs megatron-core; one H200, about 2 minutes)::

    python -m benchmarks.gpu.bench_mcore_overlap [--out DIR]
    torchrun --nproc_per_node 2 -m benchmarks.gpu.bench_mcore_overlap [--out DIR]

Writes ``OUT/mcore_overlap.json`` (``mcore_overlap_dp<N>.json`` under torchrun) and prints one line per
variant and a summary.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import _harness as harness
from benchmarks.gpu.bench_fsdp2 import MAX_TOKENS, MODELS, Step, model_config, pg_loss, workload
from underlay.interfaces import EngineConfig, ModelConfig, OptimConfig

VARIANTS: dict[str, dict[str, bool]] = {
    "off": {},
    "grad": {"overlap_grad_reduce": True},
    "both": {"overlap_grad_reduce": True, "overlap_param_gather": True},
}


def run_variant(cfg: Any, work: list[Step], args: Any, dev: Any, name: str) -> dict[str, Any]:
    """Build the mcore engine with ``VARIANTS[name]`` and time ``forward_backward`` +
    ``optimizer_step`` over ``work`` (the first ``args.warmup`` steps untimed)."""
    from underlay.registry import get_engine

    ec = EngineConfig(
        model=ModelConfig(hf_config=cfg, seed=0),
        optim=OptimConfig(lr=1e-5, grad_clip=1.0),
        micro_batch_max_tokens=MAX_TOKENS if not args.quick else 256,
        param_dtype="bfloat16",
        reduce_dtype="float32",
        with_entropy=False,
        options=dict(VARIANTS[name]),
    )
    engine = get_engine(ec, "mcore")
    dev.synchronize()
    dev.reset_peak_memory_stats()
    times: list[float] = []
    losses: list[float] = []
    for i, step in enumerate(work):
        dev.synchronize()
        t = time.perf_counter()
        res = engine.forward_backward(step.batch, pg_loss)
        engine.optimizer_step()
        dev.synchronize()
        losses.append(float(res.metrics["loss"]))
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    peak = dev.memory_stats().peak_allocated
    del engine
    gc.collect()
    dev.empty_cache()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return {"times": times, "losses": losses, "peak": peak}


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen2-1.5b", choices=sorted(MODELS), help="model shape (random init)")
    ap.add_argument("--quick", action="store_true", help="a 2-layer toy model (smoke run)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sequences", type=int, default=64, help="sequences per rank and step")
    ap.add_argument("--variants", default="off,grad,both", help=f"comma-separated, of {sorted(VARIANTS)}")
    ap.set_defaults(warmup=2, same_batch=False)
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or names[0] != "off":
        ap.error(f"--variants {args.variants!r}: names of {sorted(VARIANTS)}, the first 'off' (the baseline)")
    out = harness.out_dir(args)
    from underlay.parallel.distributed import init_distributed
    from underlay.registry import get_device

    dev = get_device(args.device)
    env = init_distributed(dev)
    rank, world = env.rank, env.world_size
    cfg = model_config(args.quick, args.model)
    work = workload(cfg, args, rank)
    tokens = [sum(s.lens) for s in work[args.warmup :]]
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        r = run_variant(cfg, work, args, dev, name)
        step_s = statistics.median(r["times"])
        if world > 1:  # the slowest rank sets the pace
            t = torch.tensor([step_s], dtype=torch.float64, device=dev.torch_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            step_s = float(t.item())
        rows[name] = {
            "step_s": step_s,
            "tokens_per_s_per_rank": sum(tokens) / sum(r["times"]),
            "peak_gib": r["peak"] / 2**30,
            "losses": r["losses"],
            "losses_equal": r["losses"] == rows.get("off", r)["losses"],
        }
        row = rows[name]
        print(
            f"{name:5s} {row['step_s']:.3f} s/step  {row['tokens_per_s_per_rank']:9.0f} tokens/s/rank  "
            f"peak {row['peak_gib']:5.1f} GiB  losses equal to off: {row['losses_equal']}",
            flush=True,
        )
    base = rows["off"]["step_s"]
    ratios = {n: harness.ratio(r["step_s"], base) for n, r in rows.items() if n != "off"}
    label = f"{args.model}{' (quick toy)' if args.quick else ''}"
    summary = f"{label} dp={world}: off {base:.3f} s/step; " + ", ".join(
        f"{n} {rows[n]['step_s']:.3f} s ({ratios[n]:.3f}x, losses equal {rows[n]['losses_equal']})"
        for n in ratios
    )
    if rank == 0:
        name = "mcore_overlap" if world == 1 else f"mcore_overlap_dp{world}"
        harness.report(
            name, {"rows": rows, "ratios": ratios, "world_size": world, "args": vars(args)}, summary, out
        )
    return 0 if all(r["losses_equal"] for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
