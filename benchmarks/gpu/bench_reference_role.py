"""A reference-policy engine (``EngineConfig(role="reference")``) against the trainable engine, one GPU.

Model: Qwen3-1.7B shape (``--model qwen3-4b`` for the 4B shape), random init, bf16 compute, fused
log-prob head; the trainable engine also has fp32 master weights, fused AdamW and gradients, the
reference engine only the bf16 weights. Data: ``--rows`` GRPO-like rows of ``--min-len``..``--max-len``
tokens (default 32 rows of 1024-4096), micro-batches of at most ``--max-tokens`` real tokens.

Measured one engine after the other (the first deleted and the cache emptied before the second is built):

- ``trainable``: the default engine after one ``forward_backward`` + ``optimizer_step`` (so its
  optimizer state and gradients exist); ``held``: allocated device memory between calls (what a
  colocated trainer keeps while the rollout runs); ``infer``: one ``infer`` of the batch (log-probs and
  entropy): its time and the peak allocated memory during it;
- ``reference``: the same config with ``role="reference"``: ``held`` right after the build, the same
  ``infer``.

Prints the ratios reference / trainable of held memory, infer peak and infer time, and the largest
log-prob difference of the two engines' first ``infer`` (same seed, before any step: 0 expected).
Writes ``OUT/reference_role.json``.

    python -m benchmarks.gpu.bench_reference_role [--out DIR]             # one H100/H200
    python -m benchmarks.gpu.bench_reference_role --quick --device cpu    # smoke run, tiny model
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import sys
import time
from typing import Any

import torch

from benchmarks import _harness as harness
from underlay.interfaces import EngineConfig, ModelConfig, OptimConfig, TokenBatch

GiB = float(1 << 30)


def make_batch(args: Any, vocab: int) -> TokenBatch:
    """``args.rows`` right-padded rows of random lengths; loss mask on each row's second half."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.rows,), generator=g)
    width = int(lens.max())
    pos = torch.arange(width)[None]
    attn = (pos < lens[:, None]).long()
    ids = torch.randint(0, vocab, (args.rows, width), generator=g) * attn
    loss = ((pos >= (lens // 2)[:, None]) & (attn == 1)).long()
    return TokenBatch(ids, attn, loss, {"advantages": torch.randn(args.rows, generator=g)})


def measure(ec: EngineConfig, batch: TokenBatch, args: Any, dev: Any) -> tuple[dict[str, Any], torch.Tensor]:
    """Build ``ec``'s engine, (trainable: one step), then held memory and ``args.repeats`` timed
    ``infer`` calls after ``args.warmup``; returns the row and the log-probs of its first ``infer``."""
    from underlay.registry import get_engine

    gc.collect()
    dev.empty_cache()
    before = dev.memory_stats().allocated
    t0 = time.perf_counter()
    engine = get_engine(ec, "fsdp2")
    build_s = time.perf_counter() - t0
    first = engine.infer(batch, with_entropy=True).log_probs
    assert first is not None
    first = first.float().cpu()
    if ec.role == "trainable":
        engine.forward_backward(batch, harness.pg_loss)
        engine.optimizer_step()
    dev.synchronize()
    gc.collect()
    held = dev.memory_stats().allocated - before
    dev.reset_peak_memory_stats()
    timing = harness.timeit(
        functools.partial(engine.infer, batch, with_entropy=True),
        warmup=args.warmup,
        repeats=args.repeats,
        device=dev.torch_device(),
    )
    peak = dev.memory_stats().peak_allocated - before
    tokens = int(batch.attention_mask.sum())
    row = {
        "engine": repr(engine),
        "build_s": build_s,
        "held_gib": held / GiB,
        "infer_peak_gib": peak / GiB,
        "infer_s": timing.median,
        "infer_tokens_per_s": tokens / timing.median,
        "infer_times_s": timing.all,
    }
    print(
        f"{ec.role:>9}: held {row['held_gib']:.2f} GiB, infer peak {row['infer_peak_gib']:.2f} GiB, "
        f"infer {timing.median:.3f} s ({row['infer_tokens_per_s']:.0f} tok/s), built in {build_s:.1f} s",
        flush=True,
    )
    del engine
    gc.collect()
    dev.empty_cache()
    return row, first


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--model", default="qwen3-1.7b", choices=sorted(harness.QWEN3_SHAPES))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=16384, help="micro_batch_max_tokens")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths (smoke run)")
    parser.set_defaults(repeats=3)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.min_len, args.max_len, args.max_tokens, args.repeats = 4, 16, 64, 128, 1
    from underlay.registry import get_device

    dev = get_device(args.device)
    cfg = harness.qwen3_config(args.model, quick=args.quick)
    ec = EngineConfig(
        model=ModelConfig(hf_config=cfg, seed=0, fused_head=True),
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
        micro_batch_max_tokens=args.max_tokens,
        param_dtype="bfloat16",
        reduce_dtype="float32",
        with_entropy=True,
        options={"fused_adamw": dev.is_accelerator},
    )
    batch = make_batch(args, cfg.vocab_size)
    rows: dict[str, dict[str, Any]] = {}
    firsts: dict[str, torch.Tensor] = {}
    for role in ("trainable", "reference"):
        rows[role], firsts[role] = measure(dataclasses.replace(ec, role=role), batch, args, dev)
    ref, train = rows["reference"], rows["trainable"]
    ratios = harness.row_ratios(
        rows,
        "reference",
        "trainable",
        {"held memory": "held_gib", "infer peak": "infer_peak_gib", "infer time": "infer_s"},
    )
    mask = batch.attention_mask.bool()
    diff = float((firsts["reference"] - firsts["trainable"])[mask].abs().max())
    summary = (
        f"{args.model if not args.quick else 'tiny'}: held {ref['held_gib']:.2f} vs {train['held_gib']:.2f} GiB "
        f"({ratios['held memory reference / trainable']:.2f}x), infer peak "
        f"{ratios['infer peak reference / trainable']:.2f}x, infer time "
        f"{ratios['infer time reference / trainable']:.2f}x, first-infer diff {diff:.1e}"
    )
    note = "of the first infer (same seed)"
    harness.report_comparison(
        "reference_role", args, rows, ratios, summary, diff, "first_infer_max_diff", note
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
