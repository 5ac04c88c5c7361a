"""FSDP2 engine training throughput on a vision-language model with synthetic images.

Model: Qwen2.5-VL shaped like the 3B release, random init: text vocab 151936, hidden 2048, 36 layers,
16 q / 2 kv heads, ffn 11008, tied embeddings, 3-D rotary sections (16, 24, 24); vision tower 32
blocks of width 1280 (ffn 3420, 16 heads, gated MLP), 14x14 patches, 2 frames per temporal patch,
2x2 merge, window attention (112 px) except blocks 7/15/23/31.

Data: per rank and step ``--sequences`` rows; ``--image-share`` of them (default 3/4) hold one random
image of 224-672 px per side (multiples of 28: 16x16 to 48x48 patches, 64 to 576 placeholder
tokens), placed after a text prompt of 32-256 tokens; every row has a log-normal response (median 400
tokens). Pixels are random normals (what the image processor's output looks like after
normalisation). The loss is a policy-gradient token mean over the responses.

The engine: bf16 compute, fp32 master weights and reduction, packed micro-batches of at most
``--max-tokens`` budget tokens (text tokens + vision patches weighted by ``models.patch_cost``), the
registry's attention (varlen) and fused log-prob head, the vision blocks and decoder layers as FSDP
units. Reports real text tokens/s, images/s and MFU (``FlopsCounter.batch_flops``: decoder + vision
tower, over the device's dense bf16 peak), the vision tower's share of the FLOPs, and peak memory,
averaged over ``--steps`` timed steps after ``--warmup``.

Run on the GPU host from the repo root (one H200, about 2 minutes)::

    python -m benchmarks.gpu.bench_vlm [--out DIR]

Writes ``OUT/vlm.json`` and prints a table. ``--device cpu --quick`` is a smoke run at tiny size.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import torch

from benchmarks import _harness as harness
from underlay.interfaces import (
    EngineConfig,
    LossContext,
    ModelConfig,
    OptimConfig,
    TokenBatch,
    TokenOutputs,
    VisionInputs,
)
from underlay.ops import aggregate_loss

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 151655, 151656, 151652, 151653


def model_config(quick: bool) -> Any:
    """The Qwen2.5-VL config (3B-like, or tiny with ``quick``)."""
    from transformers import AutoConfig

    if quick:
        text: dict[str, Any] = dict(
            vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            bos_token_id=0, eos_token_id=1,
            num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                    "rope_theta": 10000.0},
        )  # fmt: skip
        vision: dict[str, Any] = dict(
            depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=2,
            spatial_merge_size=2, temporal_patch_size=1, window_size=8, fullatt_block_indexes=[1],
        )  # fmt: skip
        ids = dict(image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)
    else:
        text = dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
            num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
            rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
        )  # fmt: skip
        vision = dict(
            depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        )  # fmt: skip
        ids = dict(
            image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END,
        )  # fmt: skip
    text["attention_dropout"] = 0.0
    return AutoConfig.for_model(
        "qwen2_5_vl", text_config=text, vision_config=vision, tie_word_embeddings=not quick, **ids
    )


def make_batch(cfg: Any, n: int, seed: int, image_share: float, quick: bool) -> TokenBatch:
    """``n`` right-padded rows, some with one random image (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    vc = cfg.vision_config
    merge, width = int(vc.spatial_merge_size), 3 * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
    vocab = int(cfg.text_config.vocab_size)
    text_vocab = min(vocab, 150) if quick else 151000  # below the special tokens
    rows: list[list[int]] = []
    grids: list[list[int]] = []
    owners: list[int] = []
    prompts: list[int] = []
    for i in range(n):
        prompt = (
            int(torch.randint(4, 12, (1,), generator=g))
            if quick
            else int(torch.randint(32, 257, (1,), generator=g))
        )
        median = 12.0 if quick else 400.0
        resp = int(min(4096, max(8, math.exp(math.log(median) + 0.8 * float(torch.randn(1, generator=g))))))
        seq = torch.randint(0, text_vocab, (prompt,), generator=g).tolist()
        if float(torch.rand(1, generator=g)) < image_share:
            side = (2, 4) if quick else (8, 24)  # merged units per side: 16..48 patches (224..672 px)
            h, w = (merge * int(torch.randint(side[0], side[1] + 1, (1,), generator=g)) for _ in range(2))
            grids.append([1, h, w])
            owners.append(i)
            seq += (
                [cfg.vision_start_token_id]
                + [cfg.image_token_id] * (h * w // merge**2)
                + [cfg.vision_end_token_id]
            )
        prompts.append(len(seq))
        seq += torch.randint(0, text_vocab, (resp,), generator=g).tolist()
        rows.append(seq)
    s = max(len(r) for r in rows)
    ids = torch.zeros(n, s, dtype=torch.long)
    attn = torch.zeros(n, s, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    pos = torch.arange(s)[None]
    loss_mask = ((pos >= torch.tensor(prompts)[:, None]) & (attn == 1)).long()
    images = None
    if grids:
        patches = sum(t * h * w for t, h, w in grids)
        images = VisionInputs(
            torch.randn(patches, width, generator=g), torch.tensor(grids), torch.tensor(owners)
        )
    return TokenBatch(ids, attn, loss_mask, {"advantages": torch.randn(n, generator=g)}, images=images)


def pg_loss(
    outputs: TokenOutputs, batch: TokenBatch, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    assert outputs.log_probs is not None
    adv = batch.extras["advantages"].to(outputs.log_probs.dtype)[:, None]
    return aggregate_loss(-(adv * outputs.log_probs), batch.loss_mask, "token-mean", ctx), {}


def compile_counts() -> str:
    """torch.compile's running totals (graph breaks, unique graphs, recompilations): a figure that
    grows from step to step after warm-up means the timed steps pay for compilation."""
    from torch._dynamo.utils import counters

    return (
        f"dynamo: graph breaks {sum(counters['graph_break'].values())}, unique graphs "
        f"{counters['stats'].get('unique_graphs', 0)}, recompiles {sum(counters['recompiles'].values())}"
    )


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny model (a smoke run, e.g. on the cpu)")
    ap.add_argument("--steps", type=int, default=3)
    ap.set_defaults(warmup=2)
    ap.add_argument("--sequences", type=int, default=32, help="rows per rank and step")
    ap.add_argument("--image-share", type=float, default=0.75)
    ap.add_argument("--max-tokens", type=int, default=16384, help="micro_batch_max_tokens")
    ap.add_argument("--recompute", default="full", choices=("none", "full"))
    ap.add_argument("--profile", action="store_true", help="profile one more step (the harness profiler)")
    ap.add_argument(
        "--compile", default=None, help="fsdp2 option compile (default: the device's, 'layer' on cuda)"
    )
    args = ap.parse_args()

    from underlay.ops import FlopsCounter
    from underlay.registry import get_device, get_engine

    dev = get_device(args.device)
    cfg = model_config(args.quick)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    ec = EngineConfig(
        model=ModelConfig(hf_config=cfg, seed=0),
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
        micro_batch_max_tokens=256 if args.quick else args.max_tokens,
        param_dtype=dtype,  # type: ignore[arg-type]
        reduce_dtype="float32",
        recompute=args.recompute,  # type: ignore[arg-type]
        with_entropy=False,
        options={"fused_adamw": dev.is_accelerator, **({"compile": args.compile} if args.compile else {})},
    )
    t0 = time.perf_counter()
    engine = get_engine(ec)
    build_s = time.perf_counter() - t0
    rank = int(os.environ.get("RANK", "0"))
    counter = FlopsCounter(cfg)
    peak = dev.peak_flops(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    dev.synchronize()
    dev.reset_peak_memory_stats()
    rows: list[dict[str, float]] = []
    for i in range(args.warmup + args.steps):
        batch = make_batch(cfg, args.sequences, rank + 7919 * i, args.image_share, args.quick)
        flops = counter.batch_flops(batch)
        text_flops = counter.estimate_flops(batch.attention_mask.sum(dim=1))
        dev.synchronize()
        t = time.perf_counter()
        res = engine.forward_backward(batch, pg_loss)
        engine.optimizer_step()
        dev.synchronize()
        dt = time.perf_counter() - t
        print(f"step {i}: {dt:.2f} s, {res.num_micro_batches} micro-batches; {compile_counts()}", flush=True)
        if i >= args.warmup:
            n_img = 0 if batch.images is None else batch.images.count
            rows.append({
                "seconds": dt,
                "tokens": float(batch.attention_mask.sum()),
                "images": float(n_img),
                "flops": flops,
                "vision_flop_share": (flops - text_flops) / flops,
                "micro_batches": float(res.num_micro_batches),
            })  # fmt: skip
    if args.profile and dev.is_accelerator:
        extra = make_batch(cfg, args.sequences, rank + 7919 * (i + 1), args.image_share, args.quick)
        harness.profile_step(
            lambda: (engine.forward_backward(extra, pg_loss), engine.optimizer_step()),
            "vlm",
            harness.out_dir(args),
        )
    secs = sum(r["seconds"] for r in rows)
    result = {
        "model": "qwen2_5_vl tiny" if args.quick else "qwen2_5_vl 3B-shaped, random init",
        "device": dev.name,
        "param_dtype": dtype,
        "recompute": args.recompute,
        "build_s": build_s,
        "steps": rows,
        "tokens_per_s": sum(r["tokens"] for r in rows) / secs,
        "images_per_s": sum(r["images"] for r in rows) / secs,
        "tflops_per_s": sum(r["flops"] for r in rows) / secs / 1e12,
        "mfu": (sum(r["flops"] for r in rows) / secs / peak) if peak else None,
        "vision_flop_share": sum(r["vision_flop_share"] for r in rows) / len(rows),
        "peak_allocated_gib": dev.memory_stats().peak_allocated / 2**30,
    }
    mfu = "n/a" if result["mfu"] is None else f"{100 * result['mfu']:.1f}%"
    summary = (
        f"{result['model']} on {dev.name}: {result['tokens_per_s']:.0f} tokens/s, "
        f"{result['images_per_s']:.1f} images/s, {result['tflops_per_s']:.1f} TFLOP/s, MFU {mfu} "
        f"(vision tower {100 * result['vision_flop_share']:.1f}% of the FLOPs), peak "
        f"{result['peak_allocated_gib']:.1f} GiB, build {build_s:.1f} s"
    )
    if rank == 0:
        harness.report("vlm", result, summary, harness.out_dir(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
