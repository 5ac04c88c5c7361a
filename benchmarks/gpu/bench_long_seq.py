"""Long-sequence training on one GPU: recomputation against activation offload.

Model: Qwen2-1.5B shape, random init (vocab 151936, hidden 1536, 28 layers, 12 q / 2 kv heads, ffn
8960, tied embeddings), bf16 compute / fp32 master weights, fused log-prob head, TiledMLP
(``--tiles``), fused AdamW. Data: one ``--tokens``-token sequence per step (default 65,536), a
policy-gradient token-mean loss over its second half.

Variants, measured in the same run (same sequences, same process):

- ``recompute``: ``recompute="full"`` (each decoder layer recomputed in backward; its input stays on
  the device);
- ``offload+recompute``: the same engine with the activation offloader on: the layer inputs (the
  checkpoint boundaries) go to pinned host memory and are prefetched back;
- ``offload``: ``recompute="none"`` with ``activation_offload``: every saved activation of every
  layer goes to host memory (bounded by ``--host-limit-gib``; what does not fit stays on the device).

``recompute`` and ``offload+recompute`` share one engine (the offloader's ``enabled`` switch), so the
model is built twice, not three times. For each variant: peak allocated device memory (GiB), mean step
time (forward_backward + optimizer_step) over ``--steps`` steps after ``--warmup``, tokens/s, the host
bytes the offloader copied per step, and the step-time ratio of each offload variant against
``recompute`` (the baseline: the overhead of offload against recomputation). Writes
``OUT/long_seq.json``. Fits about 150 s on one H200 at the defaults.

    python -m benchmarks.gpu.bench_long_seq [--out DIR]            # the H200 run
    python -m benchmarks.gpu.bench_long_seq --quick [--out DIR]    # cpu smoke run, tiny model
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import _harness as harness
from underlay.interfaces import EngineConfig, LossContext, ModelConfig, OptimConfig, TokenBatch, TokenOutputs
from underlay.ops import aggregate_loss

GiB = float(1 << 30)


def model_config(quick: bool) -> Any:
    from transformers import Qwen2Config

    if quick:
        return Qwen2Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )


def make_batch(tokens: int, vocab: int, seed: int) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    attn = torch.ones_like(ids)
    loss_mask = (torch.arange(tokens)[None] >= tokens // 2).long()
    return TokenBatch(ids, attn, loss_mask, {"advantages": torch.randn(1, generator=g)})


def pg_loss(
    outputs: TokenOutputs, batch: TokenBatch, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    assert outputs.log_probs is not None
    adv = batch.extras["advantages"].to(outputs.log_probs.dtype)[:, None]
    return aggregate_loss(-(adv * outputs.log_probs), batch.loss_mask, "token-mean", ctx), {}


def build(cfg: Any, args: Any, recompute: str) -> Any:
    from underlay.registry import get_engine

    ec = EngineConfig(
        model=ModelConfig(hf_config=cfg, seed=0, fused_head=True, tiled_mlp_tiles=args.tiles),
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
        micro_batch_max_tokens=args.tokens,
        param_dtype="bfloat16",
        reduce_dtype="float32",
        recompute=recompute,  # type: ignore[arg-type]
        with_entropy=False,
        options={
            "fused_adamw": True,
            "reshard_after_forward": False,
            "activation_offload": True,
            "activation_offload_min_bytes": 0 if args.quick else 1 << 20,
        },
    )
    t0 = time.perf_counter()
    engine = get_engine(ec)
    print(f"built recompute={recompute} in {time.perf_counter() - t0:.1f} s", flush=True)
    return engine


def host_limit(cap_gib: float) -> int:
    """Pinned host bytes the offload may hold: ``cap_gib``, and at most the memory available now less
    16 GiB (pinned pages cannot be swapped; the process needs the rest)."""
    limit = int(cap_gib * GiB)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limit = min(limit, int(line.split()[1]) * 1024 - 16 * (1 << 30))
    except OSError:
        pass
    return max(limit, 0)


def measure(engine: Any, batches: list[TokenBatch], args: Any, label: str, offload: bool) -> dict[str, Any]:
    dev = engine.device
    offloader = engine.activation_offloader
    offloader.enabled = offload
    offloader.host_limit_bytes = host_limit(args.host_limit_gib)
    dev.synchronize()
    dev.empty_cache()
    dev.reset_peak_memory_stats()
    times: list[float] = []
    copied: list[int] = []
    for i, batch in enumerate(batches):
        offloader.stats.reset()
        dev.synchronize()
        t = time.perf_counter()
        engine.forward_backward(batch, pg_loss)
        engine.optimizer_step()
        dev.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
            copied.append(offloader.stats.copied_bytes)
    stats = dict(vars(offloader.stats))
    peak = dev.memory_stats().peak_allocated
    mean = sum(times) / len(times)
    row = {
        "variant": label,
        "peak_gib": peak / GiB if peak is not None else None,
        "step_s": mean,
        "times_s": times,
        "tokens_per_s": args.tokens / mean,
        "host_gib_per_step": (sum(copied) / len(copied)) / GiB if copied else 0.0,
        "pool_reserved_gib": offloader.pool.reserved_bytes / GiB,
        "last_step_stats": stats,
    }
    print(
        f"{label:>18}: peak {row['peak_gib']:.2f} GiB, step {mean:.3f} s, {row['tokens_per_s']:.0f} tok/s, "
        f"host {row['host_gib_per_step'] * 1024:.1f} MiB/step in {stats['offloaded_tensors']} tensors "
        f"(pool {row['pool_reserved_gib']:.2f} GiB), left on the device: {stats['skipped_small']} small, "
        f"{stats['skipped_limit']} over the host limit",
        flush=True,
    )
    offloader.enabled = True
    return row


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=65536, help="tokens of the one sequence per step")
    parser.add_argument("--tiles", type=int, default=8, help="TiledMLP tiles")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--variants",
        default="recompute,offload+recompute,offload",
        help="comma-separated subset of recompute, offload+recompute, offload",
    )
    parser.add_argument(
        "--host-limit-gib",
        type=float,
        default=80.0,
        help="most pinned host memory the offload may use (also at most MemAvailable - 16 GiB)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model on the cpu (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.tokens = min(args.tokens, 1024)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - {"recompute", "offload+recompute", "offload"})
    if unknown:
        parser.error(f"unknown variants {unknown}")
    from underlay.registry import get_device

    dev = get_device()  # the engine starts a 1-rank process group itself
    cfg = model_config(args.quick)
    batches = [make_batch(args.tokens, cfg.vocab_size, seed=i) for i in range(args.warmup + args.steps)]
    rows: dict[str, dict[str, Any]] = {}
    t_all = time.perf_counter()
    if {"recompute", "offload+recompute"} & set(variants):
        engine = build(cfg, args, "full")
        for label, offload in (("recompute", False), ("offload+recompute", True)):
            if label in variants:
                rows[label] = measure(engine, batches, args, label, offload)
        del engine
        gc.collect()
        dev.empty_cache()
    if "offload" in variants:
        engine = build(cfg, args, "none")
        rows["offload"] = measure(engine, batches, args, "offload", True)
        del engine
        gc.collect()
        dev.empty_cache()
    ratios = {}
    if "recompute" in rows:
        base = rows["recompute"]["step_s"]
        for label in ("offload+recompute", "offload"):
            if label in rows:
                ratios[f"{label} / recompute step time"] = harness.ratio(rows[label]["step_s"], base)
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}x", flush=True)
    print(f"total {time.perf_counter() - t_all:.1f} s", flush=True)
    result = {"tokens": args.tokens, "tiles": args.tiles, "rows": rows, "ratios": ratios}
    summary = f"{args.tokens} tokens: " + "; ".join(
        f"{label} {r['step_s']:.2f} s/step, peak {(r['peak_gib'] or float('nan')):.1f} GiB"
        for label, r in rows.items()
    )
    if ratios:
        summary += "; " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    harness.report("long_seq", result, summary, harness.out_dir(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
