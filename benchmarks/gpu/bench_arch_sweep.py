"""Every popular architecture of the matrix through the fsdp2 engine with its defaults (issue 35, goal 2).

Shapes (``SHAPES``; random init from a ``transformers`` config, nothing downloaded): Gemma-2-2B,
Gemma-3-4B (text), Phi-3-mini, a Mixtral-style MoE scaled to fit one H200 (``mixtral-s``: Mixtral's
layout, 8 experts top-2, hidden 2048, 12 layers, expert width 5632: 3.4 B parameters, 1.1 B active per
token), Qwen3-4B, Llama-3.2-3B (with its llama3 RoPE scaling), Qwen2-7B (a 7B dense shape) and
Qwen3-8B. Each is built with ``EngineConfig`` and **no engine option at all** (the ``defaults`` variant of
``bench_fsdp2``: the engine's per-device choices and its memory policy), bf16 compute / fp32 master
weights and reduction, ``micro_batch_max_tokens=16384``.

Workload: ``bench_fsdp2``'s: 64 sequences per step from the long-tailed GRPO-like length mix (prompt
U[64, 512] + log-normal response with median 700, at most 8192 tokens a sequence), new sequences every
step, a policy-gradient token-mean loss over the response tokens. ``--warmup`` untimed steps (default 1:
compilation happens there), then ``--steps`` timed steps (default 2); steps in which torch.compile or
Triton compiled anything are left out of the mean, as in ``bench_fsdp2``.

MFU (the formula of ``bench_fsdp2``): ``ops.FlopsCounter(config).estimate_flops(lengths)`` of the real
(non-padding) tokens of a step / step seconds / the device's dense bf16 peak (``Device.peak_flops``:
989.4 TFLOP/s for an H200). ``estimate_flops`` is ``6 * N * tokens`` (``N``: every weight matrix a token
passes through, embedding and head included, MoE: router + top-k experts) plus the causal attention term
``6 * heads * (qk_dim + v_dim) * pairs`` per layer (sliding-window layers count only the pairs inside
their window).

Baseline in the same run (``--baseline``, default ``llama-3.2-3b``; ``none`` skips it): ``bench_fsdp2``'s
plain-transformers step (fp32 model under bf16 autocast, SDPA, padded micro-batches of the same sequences,
``log_softmax`` of fp32 logits, fused AdamW) on that shape; when it runs out of memory it is retried
with transformers' gradient checkpointing (the row says so). The ratio printed is fsdp2 tokens/s over
the baseline's for that shape.

Every configuration runs in its own Python process (``--child``), so an out-of-memory error, a crash or
a hang of one (``--timeout-s`` each) is recorded as that row's error and the sweep goes on; the parent
stops starting new ones when less than ``--min-left-s`` of ``--budget-s`` is left (rows ``skipped``).
Per configuration one line ``arch_sweep[NAME]: ...``; at the end the table, ``OUT/arch_sweep.json`` and
the summary line.

Run on the GPU host from the repository root (one H200, about 6 minutes for all eight)::

    python -m benchmarks.gpu.bench_arch_sweep [--only gemma-2-2b,qwen3-8b] [--steps N] [--out DIR]
    python -m benchmarks.gpu.bench_arch_sweep --attention gemma-2-2b=eager  # one row's kernel named
    python -m benchmarks.gpu.bench_arch_sweep --device cpu --quick   # smoke run: tiny models of each family
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import _harness as harness

_COLUMNS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# name: transformers config class, the public shape in ``_COLUMNS`` order (head_dim None: the config's
# own), and the keys only that family has
_TABLE: dict[str, tuple[str, tuple[Any, ...], dict[str, Any]]] = {
    "gemma-2-2b": (
        "Gemma2Config",
        (2304, 26, 8, 4, 256, 9216, 256000, True),
        dict(
            sliding_window=4096,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            query_pre_attn_scalar=256,
        ),
    ),
    "gemma-3-4b": (
        "Gemma3TextConfig",
        (2560, 34, 8, 4, 256, 10240, 262208, True),
        dict(sliding_window=1024, query_pre_attn_scalar=256),
    ),
    "phi-3-mini": ("Phi3Config", (3072, 32, 32, 32, None, 8192, 32064, False), {}),
    "mixtral-s": (
        "MixtralConfig",
        (2048, 12, 16, 8, 128, 5632, 32000, False),
        dict(num_local_experts=8, num_experts_per_tok=2),
    ),
    "qwen3-4b": ("Qwen3Config", (2560, 36, 32, 8, 128, 9728, 151936, True), dict(rope_theta=1_000_000.0)),
    "llama-3.2-3b": (
        "LlamaConfig",
        (3072, 28, 24, 8, 128, 8192, 128256, True),
        dict(rope_parameters=_LLAMA3_ROPE),
    ),
    "qwen2-7b": ("Qwen2Config", (3584, 28, 28, 4, 128, 18944, 152064, False), dict(rope_theta=1_000_000.0)),
    "qwen3-8b": ("Qwen3Config", (4096, 36, 32, 8, 128, 12288, 151936, False), dict(rope_theta=1_000_000.0)),
}

# name: (transformers config class, public shape); the keys are the config's own
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    name: (cls, {**{k: v for k, v in zip(_COLUMNS, row, strict=True) if v is not None}, **own})
    for name, (cls, row, own) in _TABLE.items()
}

# the sizes of a --quick (CPU smoke) model; every other key of the shape (softcaps, windows, experts,
# rope scaling, tying) is kept so the same code paths run
_QUICK = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    query_pre_attn_scalar=16,
)


def model_config(name: str, quick: bool) -> Any:
    """The random-init ``transformers`` config of shape ``name`` (``SHAPES``); ``quick``: a 2-layer toy of
    the same family and features. ``KeyError`` for an unknown name (the parser refuses those first)."""
    import transformers

    cls_name, shape = SHAPES[name]
    kwargs = dict(shape)
    if quick:
        kwargs.update({k: v for k, v in _QUICK.items() if k != "query_pre_attn_scalar" or k in shape})
        if "sliding_window" in shape:
            kwargs["sliding_window"] = 32
        if "num_local_experts" in shape:
            kwargs["num_local_experts"] = 4
        kwargs["pad_token_id"] = 0  # the families' default pad ids lie outside the toy vocabulary
    kwargs.setdefault("max_position_embeddings", 32768)
    return getattr(transformers, cls_name)(attention_dropout=0.0, **kwargs)


def _child_args(args: argparse.Namespace) -> argparse.Namespace:
    """The namespace ``bench_fsdp2``'s workload and engine loop read."""
    return argparse.Namespace(
        warmup=args.warmup,
        steps=args.steps,
        same_batch=False,
        sequences=args.sequences,
        quick=args.quick,
        memory_trace=False,
        profile=False,
        baseline_act_ckpt=False,
        out=args.out,
    )


def run_child(args: argparse.Namespace) -> int:
    """``--child NAME``: measure one configuration (fsdp2 defaults, or ``--hf`` the plain-transformers
    baseline) and write ``OUT/row.json``: the ``bench_fsdp2.summarise`` row, or ``{"error": ...}``."""
    from benchmarks.gpu import bench_fsdp2 as f2
    from underlay.registry import get_device

    out = harness.out_dir(args)
    row: dict[str, Any]
    try:
        dev = get_device(args.device)
        f2.count_triton_compiles()
        cfg = model_config(args.child, args.quick)
        cargs = _child_args(args)
        work = f2.workload(cfg, cargs, 0)
        peak = dev.peak_flops(torch.bfloat16)
        if args.hf:
            try:
                r = f2.bench_hf(cfg, work, cargs, dev)
                label = "hf"
            except torch.OutOfMemoryError:
                gc.collect()
                dev.empty_cache()
                print(f"arch_sweep[{args.child}] hf: out of memory; retried with gradient checkpointing")
                cargs.baseline_act_ckpt = True
                r = f2.bench_hf(cfg, work, cargs, dev)
                label = "hf+grad_ckpt"
            row = f2.summarise(label, r, work, peak, 1)
        else:
            r = f2.bench_engine(cfg, work, cargs, dev, "defaults")
            row = f2.summarise("fsdp2/defaults", r, work, peak, 1)
            row["policy"] = _policy_line(r.get("engine") or "")
        row["tokens_per_step"] = sum(sum(s.lens) for s in work[args.warmup :]) / max(1, args.steps)
    except Exception as exc:  # one configuration's failure is its row, never the sweep's end
        traceback.print_exc()
        row = {"error": f"{type(exc).__name__}: {str(exc)[:600]}"}
    (out / "row.json").write_text(json.dumps(row, indent=1, default=str))
    return 0


def _policy_line(engine_repr: str) -> str:
    """The engine options that decide speed and memory, from the engine's repr (best effort)."""
    keys = ("recompute", "reshard_after_forward", "optimizer_offload", "compile", "grad_sync")
    found = []
    for key in keys:
        at = engine_repr.find(f"{key}=")
        if at >= 0:
            end = min(
                i for i in (engine_repr.find(",", at), engine_repr.find(")", at), len(engine_repr)) if i >= 0
            )
            found.append(engine_repr[at:end])
    return ", ".join(found)


def _spawn(args: argparse.Namespace, name: str, hf: bool, out: Path, timeout: float) -> dict[str, Any]:
    """Run one configuration in a child process; its row, or ``{"error": ...}`` when it failed, was
    killed or timed out."""
    sub = out / (f"{name}-hf" if hf else name)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu.bench_arch_sweep",
        "--child",
        name,
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--sequences",
        str(args.sequences),
        "--out",
        str(sub),
    ]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--hf"] if hf else []
    env = dict(os.environ)
    kernel = None if hf else args.kernels.get(name)
    if kernel is not None:
        env["UNDERLAY_ATTENTION"] = kernel
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=timeout, check=False, env=env)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        rc = f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    path = sub / "row.json"
    row: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if not row:
        row = {"error": f"child process ended without a row (exit {rc})"}
    row["wall_s"] = wall
    row["attention"] = kernel or os.environ.get("UNDERLAY_ATTENTION", "auto")
    return row


def _line(name: str, row: dict[str, Any]) -> str:
    if "error" in row:
        return f"arch_sweep[{name}]: FAILED {row['error']}"
    mfu = f"{row['mfu'] * 100:.1f}% MFU" if row.get("mfu") is not None else "MFU n/a"
    policy = f"; {row['policy']}" if row.get("policy") else ""
    policy += f"; attention {row['attention']}" if row.get("attention", "auto") != "auto" else ""
    return (
        f"arch_sweep[{name}]: {row['tokens_per_s']:.0f} tokens/s, {mfu}, peak {row['peak_gib']:.1f} GiB, "
        f"{row['step_s']:.3f} s/step ({row['steady_steps']} steady of {len(row['step_s_each'])}), "
        f"wall {row['wall_s']:.0f} s{policy}"
    )


def main() -> int:
    ap = harness.parser(__doc__)
    ap.set_defaults(warmup=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny models of each family (CPU smoke run)")
    ap.add_argument("--only", default="", help=f"comma-separated shapes (default all): {', '.join(SHAPES)}")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    ap.add_argument("--sequences", type=int, default=64, help="sequences per step")
    ap.add_argument(
        "--baseline", default="llama-3.2-3b", help="shape of the plain-transformers baseline, or none"
    )
    ap.add_argument("--timeout-s", type=float, default=240.0, help="wall-clock limit of one configuration")
    ap.add_argument(
        "--budget-s", type=float, default=560.0, help="start no configuration after this (seconds)"
    )
    ap.add_argument("--min-left-s", type=float, default=45.0, help="budget a configuration needs to start")
    ap.add_argument(
        "--attention",
        default="",
        help="SHAPE=KERNEL[,SHAPE=KERNEL]: name the attention kernel of those shapes' engines "
        "(UNDERLAY_ATTENTION in their process only, e.g. gemma-2-2b=flex); the others keep auto",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hf", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    if args.child is not None:
        return run_child(args)
    names = [n for n in args.only.split(",") if n] or list(SHAPES)
    try:
        args.kernels = dict(item.split("=", 1) for item in args.attention.split(",") if item)
    except ValueError:
        ap.error(f"--attention {args.attention!r}: give SHAPE=KERNEL pairs, comma-separated")
    given = names + ([args.baseline] if args.baseline != "none" else []) + list(args.kernels)
    unknown = [n for n in given if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    out = harness.out_dir(args)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    start = time.perf_counter()
    jobs = [(n, False) for n in names]
    if args.baseline != "none":
        jobs.insert(0, (args.baseline, True))  # first, so a cut budget drops sweep rows, not the baseline
    rows: dict[str, dict[str, Any]] = {}
    baseline: dict[str, Any] | None = None
    for name, hf in jobs:
        left = args.budget_s - (time.perf_counter() - start)
        if left < args.min_left_s:
            row: dict[str, Any] = {"error": f"skipped: {left:.0f} s of --budget-s left"}
        else:
            row = _spawn(args, name, hf, out, min(args.timeout_s, left))
        if hf:
            baseline = row
            label = f"{name} baseline ({row.get('name', 'hf')})"
            print(_line(label, row), flush=True)
        else:
            rows[name] = row
            print(_line(name, row), flush=True)
    result: dict[str, Any] = {
        "rows": rows,
        "baseline_shape": args.baseline,
        "baseline": baseline,
        "args": vars(args),
    }
    ok = {n: r for n, r in rows.items() if "error" not in r}
    speedup = None
    if (
        baseline is not None
        and "error" not in baseline
        and "error" not in rows.get(args.baseline, {"error": 1})
    ):
        speedup = harness.ratio(rows[args.baseline]["tokens_per_s"], baseline["tokens_per_s"])
        result["speedup_vs_hf"] = speedup
        result["memory_ratio_vs_hf"] = harness.ratio(rows[args.baseline]["peak_gib"], baseline["peak_gib"])
    result["goals"] = {
        n: {"mfu>=0.45": r["mfu"] is not None and r["mfu"] >= 0.45} for n, r in ok.items() if "mfu" in r
    }
    if "gemma-2-2b" in ok and ok["gemma-2-2b"].get("mfu") is not None:
        result["goals"]["gemma-2-2b"]["mfu>=0.50"] = ok["gemma-2-2b"]["mfu"] >= 0.50
    print(f"{'shape':<14} {'s/step':>7} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>9}  policy / error")
    for n, r in rows.items():
        if "error" in r:
            print(f"{n:<14} {'-':>7} {'-':>9} {'-':>6} {'-':>9}  {r['error'][:100]}")
            continue
        mfu = f"{r['mfu'] * 100:5.1f}%" if r.get("mfu") is not None else "  n/a"
        print(
            f"{n:<14} {r['step_s']:>7.3f} {r['tokens_per_s']:>9.0f} {mfu:>6} {r['peak_gib']:>9.1f}  {r.get('policy', '')}"
        )
    parts = []
    for n, r in rows.items():
        if "error" in r:
            parts.append(f"{n} FAILED")
        else:
            parts.append(
                f"{n} {r['mfu'] * 100:.1f}%"
                if r.get("mfu") is not None
                else f"{n} {r['tokens_per_s']:.0f} tok/s"
            )
    summary = f"{len(ok)}/{len(rows)} shapes trained; MFU " + ", ".join(parts)
    if speedup is not None:
        summary += f"; {args.baseline} {speedup:.2f}x plain transformers tokens/s"
    harness.report("arch_sweep", result, summary, out)
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
