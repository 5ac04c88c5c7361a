"""Shared-prompt GRPO (``TokenBatch.prompt_groups``) against the same batch without it, one GPU.

Model: Qwen3-1.7B shape, random init (vocab 151936, hidden 2048, 28 layers, 16 q / 8 kv heads, head
dim 128, ffn 6144, tied embeddings), bf16 compute / fp32 master weights, fused log-prob head, fused
AdamW; the engine's own recompute and memory choices (``recompute="auto"``). Data: a long-prompt GRPO
mix: ``--groups`` prompts of ``--prompt-min``..``--prompt-max`` tokens (default 2048-4096), each with
``--n`` responses (default 8) of ``--resp-min``..``--resp-max`` tokens (default 200-800), a
policy-gradient token-mean loss over the responses; every row carries its whole prompt.

Variants, measured on one engine, alternating step by step on the same batches (so weights, data and
allocator state are shared):

- ``unshared``: the batch as it is (each row its own copy of the prompt: ``n`` prompt copies per group);
- ``shared``: the same batch with ``prompt_groups`` (each prompt computed once per group: the
  shared-prefix attention, flex attention compiled on cuda).

For each: mean ``forward_backward`` + ``optimizer_step`` time over ``--steps`` steps after ``--warmup``,
tokens/s (the batch's real tokens, the same count for both, so the ratio is the speed-up), the tokens
the backbone computed, peak allocated memory, and the ``infer`` time (old/reference log-probs) of the
batch; then the ratio shared / unshared of tokens/s (training and infer) and the largest log-prob
difference between the two (bf16: summation order). Writes ``OUT/shared_prompt.json``.

    python -m benchmarks.gpu.bench_shared_prompt [--out DIR]                  # one H100/H200
    python -m benchmarks.gpu.bench_shared_prompt --quick --device cpu         # smoke run, tiny model
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import torch

from benchmarks import _harness as harness
from underlay.interfaces import EngineConfig, ModelConfig, OptimConfig, TokenBatch

GiB = float(1 << 30)


def make_batch(args: Any, vocab: int, seed: int) -> TokenBatch:
    """``args.groups`` prompts with ``args.n`` responses each, right-padded, ``prompt_groups`` set;
    loss mask on the responses; one advantage per row."""
    g = torch.Generator().manual_seed(seed)

    def length(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    groups: list[int] = []
    for gi in range(args.groups):
        prompt = torch.randint(0, vocab, (length(args.prompt_min, args.prompt_max),), generator=g)
        for _ in range(args.n):
            rows.append(
                (prompt, torch.randint(0, vocab, (length(args.resp_min, args.resp_max),), generator=g))
            )
            groups.append(gi)
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        n = len(p) + len(r)
        ids[i, :n] = torch.cat([p, r])
        attn[i, :n] = 1
        loss[i, len(p) : n] = 1
    adv = torch.randn(len(rows), generator=g)
    return TokenBatch(ids, attn, loss, {"advantages": adv}, prompt_groups=torch.tensor(groups))


def computed_tokens(batch: TokenBatch) -> int:
    """Tokens the backbone computes for ``batch`` (shared prompts once per group when it has groups)."""
    if batch.prompt_groups is None:
        return int(batch.attention_mask.sum())
    from underlay.ops.prompt_sharing import shared_prompt_costs

    return sum(shared_prompt_costs(batch.input_ids, batch.attention_mask, batch.prompt_groups)[1])


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--groups", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt-min", type=int, default=2048)
    parser.add_argument("--prompt-max", type=int, default=4096)
    parser.add_argument("--resp-min", type=int, default=200)
    parser.add_argument("--resp-max", type=int, default=800)
    parser.add_argument("--max-tokens", type=int, default=16384, help="micro_batch_max_tokens")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny model and lengths (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.n, args.max_tokens = 2, 4, 512
        args.prompt_min, args.prompt_max, args.resp_min, args.resp_max = 64, 128, 8, 32
        args.steps, args.warmup = 1, 1
    from underlay.registry import get_device, get_engine

    dev = get_device(args.device)
    cfg = harness.qwen3_config(quick=args.quick)
    ec = EngineConfig(
        model=ModelConfig(hf_config=cfg, seed=0, fused_head=True),
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
        micro_batch_max_tokens=args.max_tokens,
        param_dtype="bfloat16",
        reduce_dtype="float32",
        with_entropy=False,
        options={"fused_adamw": dev.is_accelerator},
    )
    t0 = time.perf_counter()
    engine = get_engine(ec, "fsdp2")
    print(f"built {engine!r} in {time.perf_counter() - t0:.1f} s", flush=True)
    batches = [make_batch(args, cfg.vocab_size, seed=i) for i in range(args.warmup + args.steps)]
    variants = {
        "unshared": [dataclasses.replace(b, prompt_groups=None) for b in batches],
        "shared": batches,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    infer_s: dict[str, list[float]] = {k: [] for k in variants}
    peaks: dict[str, int] = dict.fromkeys(variants, 0)
    logp: dict[str, torch.Tensor] = {}
    for i in range(len(batches)):
        for name, bs in variants.items():  # alternate: both see the same weights' drift and allocator
            dev.synchronize()
            dev.reset_peak_memory_stats()
            t = time.perf_counter()
            engine.forward_backward(bs[i], harness.pg_loss)
            engine.optimizer_step()
            dev.synchronize()
            step = time.perf_counter() - t
            peaks[name] = max(peaks[name], dev.memory_stats().peak_allocated or 0)
            t = time.perf_counter()
            engine.infer(bs[i], with_entropy=False)
            dev.synchronize()
            inf = time.perf_counter() - t
            if i >= args.warmup:
                times[name].append(step)
                infer_s[name].append(inf)
            print(f"step {i} {name:>8}: train {step:.3f} s, infer {inf:.3f} s", flush=True)
        # the two variants of one step see different weights (one optimizer step apart): compare on
        # the weights after both steps
        if i == len(batches) - 1:
            for name, bs in variants.items():
                lp = engine.infer(bs[i], with_entropy=False).log_probs
                assert lp is not None
                logp[name] = lp.float().cpu() * bs[i].loss_mask
    rows: dict[str, dict[str, Any]] = {}
    for name, bs in variants.items():
        real = sum(int(b.attention_mask.sum()) for b in bs[args.warmup :]) / args.steps
        step = sum(times[name]) / len(times[name])
        inf = sum(infer_s[name]) / len(infer_s[name])
        rows[name] = {
            "step_s": step,
            "tokens_per_s": real / step,
            "infer_s": inf,
            "infer_tokens_per_s": real / inf,
            "real_tokens_per_step": real,
            "computed_tokens_per_step": sum(computed_tokens(b) for b in bs[args.warmup :]) / args.steps,
            "peak_gib": peaks[name] / GiB,
            "times_s": times[name],
        }
        r = rows[name]
        print(
            f"{name:>8}: {r['tokens_per_s']:.0f} tok/s train ({step:.3f} s/step), "
            f"{r['infer_tokens_per_s']:.0f} tok/s infer, computes {r['computed_tokens_per_step']:.0f} of "
            f"{real:.0f} tokens, peak {r['peak_gib']:.2f} GiB",
            flush=True,
        )
    ratios = harness.row_ratios(
        rows,
        "shared",
        "unshared",
        {"train tokens/s": "tokens_per_s", "infer tokens/s": "infer_tokens_per_s", "peak memory": "peak_gib"},
    )
    max_diff = float((logp["shared"] - logp["unshared"]).abs().max())
    lengths = (
        f"{args.groups} x {args.n} rows, prompts {args.prompt_min}-{args.prompt_max}, "
        f"responses {args.resp_min}-{args.resp_max}"
    )
    summary = (
        f"{lengths}: train {ratios['train tokens/s shared / unshared']:.2f}x tokens/s "
        f"({rows['shared']['tokens_per_s']:.0f} vs {rows['unshared']['tokens_per_s']:.0f}), infer "
        f"{ratios['infer tokens/s shared / unshared']:.2f}x, peak {ratios['peak memory shared / unshared']:.2f}x"
    )
    note = "shared vs unshared (same weights)"
    harness.report_comparison(
        "shared_prompt", args, rows, ratios, summary, max_diff, "max_logprob_diff", note
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
