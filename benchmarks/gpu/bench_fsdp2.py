"""FSDP2 engine training throughput vs plain transformers; with ``--mcore``, the mcore engine vs fsdp2.

Model: ``--model`` (default ``qwen2-1.5b``: Qwen2-shaped 1.5B, vocab 151936, hidden 1536, 28 layers,
12 q / 2 kv heads, ffn 8960, tied embeddings; also ``llama-3.2-1b``, ``qwen3-1.7b``, ``qwen3-4b``,
``qwen3-8b``, see ``MODELS``), random init. Data: a long-tailed GRPO-like length mix (prompts 64-512 tokens, responses
log-normal with median 700 tokens, capped so a sequence has at most 8192 tokens), the same sequences
for both contenders, a policy-gradient token-mean loss over the response tokens.

- ``fsdp2``: ``underlay.get_engine``-built FSDP2 engine, bf16 compute / fp32 master weights and
  reduction, packed (padding-free) micro-batches of at most 16384 real tokens, the cuda attention
  (varlen) and fused Triton log-prob head, fused AdamW, parameters kept unsharded between forward
  and backward (``reshard_after_forward=False``). ``--act-ckpt`` lists the variants to measure, one
  engine each in the same run: an activation-checkpointing mode (``none`` or ``full``), optionally
  with ``+compile`` (engine option ``compile=True``: norms, MLPs and attention modules compiled),
  ``+norm_mlp`` (``compile="norm_mlp"``) or ``+layer`` (``compile="layer"``: each decoder layer's whole
  forward), optionally with ``@B`` (engine option ``compile_memory_budget=B``, e.g. ``none+layer@0.8``).
  Default ``none+layer@0.85``; the first row is the one the goals are judged on. ``defaults`` builds
  the engine with no options and no recompute policy at all (the engine's per-device auto choices and
  memory policy: what a user who reads nothing gets), ``tuned`` is ``none+layer@0.85``; with both in
  one run the MFU difference is printed in points. A ``+offload`` suffix adds ``optimizer_offload``;
  ``+per_step`` / ``+per_mb`` set ``grad_sync`` (gradients reduced once per step / after every
  micro-batch; without either the engine decides): with both of one variant in a run (e.g.
  ``tuned+per_mb,tuned+per_step``) the step-time ratio and the MFU difference are printed.
  Each engine prints its repr (the resolved options), the memory policy's estimate against the measured
  peak, and the compile warm-up the engine reported.
- ``hf``: plain transformers: the fp32 model under bf16 autocast, SDPA, padded micro-batches of the
  same sequences in dataset order (as many as fit 16384 padded tokens), ``logits.float().log_softmax``,
  fused AdamW, no activation checkpointing (``--baseline-act-ckpt`` to enable). Only when world size 1.

Reports real (non-padding) tokens/s, MFU (``ops.FlopsCounter`` over the real tokens / the device's
dense bf16 peak) and peak allocated memory, averaged over ``--steps`` timed steps after a warm-up.
Goals: fsdp2 >= 50% MFU, >= 2x hf tokens/s, <= 0.5x hf peak memory. ``--profile`` profiles one more
step of every fsdp2 variant: the costliest kernels and where the GPU sat idle
(``underlay.profiling.trace_gaps``).

Run on the GPU host from the repo root (one H200, well under 5 minutes)::

    python -m benchmarks.gpu.bench_fsdp2 [--out DIR]
    python -m benchmarks.gpu.bench_fsdp2 --mcore [--profile] [--out DIR]   # needs megatron-core

Under ``torchrun --nproc_per_node 2 -m benchmarks.gpu.bench_fsdp2`` (weak scaling: every rank its own
sequences of the same mix) it measures fsdp2 at dp=2 and writes ``fsdp2_dp2.json``; the scaling
efficiency is its tokens/s over twice the 1-GPU run's. Prints a table; writes ``OUT/fsdp2.json``.
``--device cpu --quick`` is a smoke run with a tiny model.

``--mcore``: the same model, workload and sequences through the mcore engine at TP=1 (world size 1,
megatron's DDP + distributed optimizer, bf16 compute / fp32 master weights, packed micro-batches of at
most 16384 tokens) and through fsdp2 (the first ``--act-ckpt`` variant) in the same run: tokens/s of
both and the ratio (goal: mcore >= 0.9x fsdp2), into ``OUT/mcore.json``. With ``--profile`` it
profiles one more step of each engine and counts the device->host synchronisations of one mcore
``forward_backward`` and one ``optimizer_step`` (``torch.cuda.set_sync_debug_mode("warn")``, grouped
by the Python line that made them) for a batch on the host and on the device
(``OUT/mcore_syncs_tp1.json``).
"""

from __future__ import annotations

import gc
import json
import math
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import _harness as harness
from underlay.interfaces import EngineConfig, LossContext, ModelConfig, OptimConfig, TokenBatch, TokenOutputs
from underlay.ops import aggregate_loss

MAX_TOKENS = 16384


# name: (config class, hidden, layers, q heads, kv heads, head_dim, ffn, vocab, tied); public shapes
MODELS: dict[str, tuple[str, int, int, int, int, int, int, int, bool]] = {
    "qwen2-1.5b": ("Qwen2Config", 1536, 28, 12, 2, 128, 8960, 151936, True),
    "llama-3.2-1b": ("LlamaConfig", 2048, 16, 32, 8, 64, 8192, 128256, True),
    "qwen3-1.7b": ("Qwen3Config", 2048, 28, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b": ("Qwen3Config", 2560, 36, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": ("Qwen3Config", 4096, 36, 32, 8, 128, 12288, 151936, False),
}

SUFFIXES: dict[str, tuple[str, object]] = {
    "+offload": ("optimizer_offload", True),
    "+per_step": ("grad_sync", "per_step"),
    "+per_mb": ("grad_sync", "per_micro_batch"),
}
"""Variant suffixes (any order, at the end) and the engine option each sets."""


def split_variant(variant: str) -> tuple[str, dict[str, object]]:
    """``"tuned+per_step+offload"`` -> ``("tuned", {"grad_sync": "per_step", "optimizer_offload": True})``."""
    extra: dict[str, object] = {}
    spec = variant
    while True:
        for suffix, (option, value) in SUFFIXES.items():
            if spec.endswith(suffix):
                spec = spec.removesuffix(suffix)
                extra[option] = value
                break
        else:
            return spec, extra


TUNED = "none+layer@0.85"
"""The hand-tuned variant: whole-layer compile, budget 0.85, no recomputation, fused AdamW, parameters
kept unsharded (the options the README recommended before the defaults chose them)."""


def model_config(quick: bool, model: str = "qwen2-1.5b") -> Any:
    """The random-init config of ``model`` (``MODELS``); ``quick``: a 2-layer toy of the same family."""
    import transformers

    cls_name, hidden, layers, heads, kv, head_dim, ffn, vocab, tied = MODELS[model]
    cls = getattr(transformers, cls_name)
    if quick:
        return cls(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1024,
            tie_word_embeddings=tied,
        )
    return cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
    )


def length_mix(n: int, seed: int, quick: bool) -> list[int]:
    """Long-tailed GRPO-like lengths: prompt U[64, 512] + log-normal response (median 700)."""
    g = torch.Generator().manual_seed(seed)
    if quick:
        return [int(x) for x in torch.randint(8, 120, (n,), generator=g)]
    prompt = torch.randint(64, 513, (n,), generator=g)
    resp = torch.exp(math.log(700.0) + 0.9 * torch.randn(n, generator=g)).long().clamp(16)
    return [int(min(8192, p + r)) for p, r in zip(prompt.tolist(), resp.tolist())]


def make_batch(lens: list[int], vocab: int, seed: int) -> TokenBatch:
    g = torch.Generator().manual_seed(seed + 1000)
    s = max(lens)
    pos = torch.arange(s)[None]
    t_lens = torch.tensor(lens)[:, None]
    attn = (pos < t_lens).long()
    ids = torch.randint(0, vocab, (len(lens), s), generator=g) * attn
    prompt = torch.clamp(t_lens // 3, max=512)
    loss_mask = ((pos >= prompt) & (attn == 1)).long()
    return TokenBatch(ids, attn, loss_mask, {"advantages": torch.randn(len(lens), generator=g)})


@dataclass(frozen=True)
class Step:
    """One training step's sequences: lengths, the padded batch, and its training FLOPs."""

    lens: list[int]
    batch: TokenBatch
    flops: float


def workload(cfg: Any, args: Any, rank: int) -> list[Step]:
    """``args.warmup`` warm-up steps, then ``args.steps`` timed steps. Each step draws new sequences from
    the same mix (as RL training does, so new lengths every step; compiled code must not recompile for
    them) unless ``--same-batch``, which repeats the first."""
    from underlay.ops import FlopsCounter

    counter = FlopsCounter(cfg)
    out = []
    for i in range(args.warmup + args.steps):
        seed = rank if args.same_batch else rank + 7919 * i
        lens = length_mix(args.sequences, seed=seed, quick=args.quick)
        out.append(Step(lens, make_batch(lens, cfg.vocab_size, seed=seed), counter.estimate_flops(lens)))
    return out


def pg_loss(
    outputs: TokenOutputs, batch: TokenBatch, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    assert outputs.log_probs is not None
    adv = batch.extras["advantages"].to(outputs.log_probs.dtype)[:, None]
    return aggregate_loss(-(adv * outputs.log_probs), batch.loss_mask, "token-mean", ctx), {}


def bench_engine(cfg: Any, work: list[Step], args: Any, dev: Any, variant: str) -> dict[str, Any]:
    import torch._functorch.config as functorch_config

    from underlay.registry import get_engine

    torch._dynamo.reset()  # every variant compiles its own graphs (the partitioner reads the budget)
    functorch_config.activation_memory_budget = 1.0
    common: dict[str, Any] = dict(
        model=ModelConfig(hf_config=cfg, seed=0),
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
        micro_batch_max_tokens=MAX_TOKENS if not args.quick else 256,
        param_dtype="bfloat16",
        reduce_dtype="float32",
        with_entropy=False,
    )
    spec, extra_options = split_variant(variant)
    if spec == "defaults":  # what a user who sets nothing gets: the engine's auto options
        ec = EngineConfig(**common, options=extra_options)
    else:
        spec = TUNED if spec == "tuned" else spec
        act_ckpt, _, extra = spec.partition("+")
        extra, _, budget = extra.partition("@")
        ec = EngineConfig(
            **common,
            recompute=act_ckpt,
            options={
                "fused_adamw": True,
                "reshard_after_forward": False,
                "compile": {"": False, "compile": True}.get(extra, extra),
                "compile_memory_budget": float(budget) if budget else None,
                "optimizer_offload": False,
                **extra_options,
            },
        )
    if dev.is_accelerator:
        gib = torch.cuda.memory_reserved() / 2**30
        print(
            f"fsdp2/{variant}: {gib:.1f} GiB reserved by the caching allocator before the build", flush=True
        )
    trace = bool(getattr(args, "memory_trace", False) and dev.is_accelerator)
    if trace:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    t0 = time.perf_counter()
    try:
        engine = get_engine(ec)
    except torch.OutOfMemoryError:
        if trace:
            print_live_allocations(f"fsdp2/{variant} build")
        raise
    build_s = time.perf_counter() - t0
    if trace:
        print(f"fsdp2/{variant}: after the build {gib_now()}", flush=True)
    print(f"fsdp2/{variant}: built in {build_s:.1f} s: {engine!r}", flush=True)
    policy = getattr(engine, "memory_estimate", None)
    estimate = policy.estimate.total if policy is not None else None
    if policy is not None:
        print(f"fsdp2/{variant}: memory policy: {policy.reason}", flush=True)
    dev.synchronize()
    dev.empty_cache()
    dev.reset_peak_memory_stats()
    times: list[float] = []
    mbs = 0
    compiled: list[bool] = []
    host: list[str] = []
    for i, step in enumerate(work):
        graphs = compile_events()
        before = host_costs()
        dev.synchronize()
        t = time.perf_counter()
        phase = "forward_backward"
        try:
            res = engine.forward_backward(step.batch, pg_loss)
            if trace:
                print(f"fsdp2/{variant}: step {i} after forward_backward {gib_now()}", flush=True)
            phase = "optimizer_step"
            engine.optimizer_step()
        except torch.OutOfMemoryError:
            if trace:
                print_live_allocations(f"fsdp2/{variant} step {i} {phase}")
            raise
        dev.synchronize()
        if trace:
            print(f"fsdp2/{variant}: step {i} after optimizer_step {gib_now()}", flush=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
            compiled.append(compile_events() > graphs)
            after = host_costs()
            host.append(f"gc {after[0] - before[0]:.2f} s, {after[1] - before[1]} cudaMalloc")
        mbs = max(mbs, res.num_micro_batches)
    peak = dev.memory_stats().peak_allocated
    warm = dict(getattr(engine, "compile_warmup", {}))
    print(f"fsdp2/{variant}: torch.compile {dynamo_counts()}; engine-reported warm-up {warm}", flush=True)
    repr_ = repr(engine)
    if args.profile and dev.is_accelerator:
        profile_step(engine, work[-1].batch, f"fsdp2_{variant}", args.out)
    del engine
    gc.collect()
    dev.empty_cache()
    if host:
        print(f"fsdp2/{variant}: host costs of the timed steps: {'; '.join(host)}", flush=True)
    return {
        "times": times,
        "compiled": compiled,
        "peak": peak,
        "build_s": build_s,
        "micro_batches": mbs,
        "estimate": estimate,
        "warmup": warm,
        "engine": repr_,
    }


def gib_now() -> str:
    """Allocated / peak-allocated / reserved device memory now, in GiB."""
    a, p, r = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved()
    return f"allocated {a / 2**30:.1f} GiB, peak {p / 2**30:.1f} GiB, reserved {r / 2**30:.1f} GiB"


_PLUMBING = ("nn/modules/module.py", "/_dynamo/", "/_compile.py", "/autograd/__init__.py", "/_tensor.py")


def print_live_allocations(where: str, top: int = 15) -> None:
    """Group the live device allocations of the memory history by their innermost Python frames
    (outside torch's module-call and dynamo plumbing) and print the largest groups: where the bytes are."""
    snap = torch.cuda.memory._snapshot()
    groups: dict[str, list[int]] = {}
    for seg in snap["segments"]:
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [
                f"{Path(f['filename']).name}:{f['line']}:{f['name']}"
                for f in block.get("frames", [])
                if f["filename"].endswith(".py") and not any(k in f["filename"] for k in _PLUMBING)
            ][:5]
            entry = groups.setdefault(" < ".join(frames) or "(no python frame)", [0, 0])
            entry[0] += block["size"]
            entry[1] += 1
    total = sum(v[0] for v in groups.values())
    print(f"== live allocations at OOM ({where}): {total / 2**30:.1f} GiB; {gib_now()}", flush=True)
    for key, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {size / 2**30:7.2f} GiB in {n:5d} blocks  {key}", flush=True)


_TRITON_COMPILES = [0]
_GC_SECONDS = [0.0, 0.0]  # total, start of the collection in progress


def _gc_timer(phase: str, _info: dict[str, Any]) -> None:
    if phase == "start":
        _GC_SECONDS[1] = time.perf_counter()
    else:
        _GC_SECONDS[0] += time.perf_counter() - _GC_SECONDS[1]


def host_costs() -> tuple[float, int]:
    """(seconds spent in Python's garbage collector, cudaMalloc calls of the caching allocator) so far:
    two one-time host costs that can make a timed step slow without any compilation."""
    if _gc_timer not in gc.callbacks:
        gc.callbacks.append(_gc_timer)
    allocs = torch.cuda.memory_stats().get("num_device_alloc", 0) if torch.cuda.is_available() else 0
    return _GC_SECONDS[0], int(allocs)


def count_triton_compiles() -> bool:
    """Count Triton JIT compilations (``triton.knobs.runtime.jit_post_compile_hook``, Triton >= 3.4):
    the log-prob and FP8 kernels specialise on their integer arguments (e.g. divisible by 16), so a new
    token count can compile a kernel again in the middle of a run. Returns whether the hook is in."""
    try:
        import triton.knobs as knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False

    def hook(**_: Any) -> None:
        _TRITON_COMPILES[0] += 1

    runtime.jit_post_compile_hook = hook
    return True


def compile_events() -> int:
    """Graphs torch.compile has compiled plus Triton JIT compilations so far (a step that compiles is
    not steady state)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0)) + _TRITON_COMPILES[0]


def dynamo_counts() -> str:
    """Graph breaks, graphs and compiled frames of torch.compile since the last call (then reset)."""
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"].get("unique_graphs", 0)
    frames = counters["frames"]
    text = (
        f"graph breaks {breaks} ({len(counters['graph_break'])} reasons), unique graphs {graphs}, "
        f"frames ok {frames.get('ok', 0)} of {frames.get('total', 0)}"
    )
    counters.clear()  # the next variant counts from zero
    return text


def profile_step(engine: Any, batch: TokenBatch, label: str, out: Path, loss: Any = None) -> None:
    """One step of ``engine`` under the harness's profiler (``loss``: default :func:`pg_loss`), into
    ``out/profile_<label>.txt``."""
    from torch.profiler import record_function

    def step() -> None:
        with record_function("bench.forward_backward"):
            engine.forward_backward(batch, loss or pg_loss)
        with record_function("bench.optimizer_step"):
            engine.optimizer_step()

    harness.profile_step(step, label, out)


def baseline_micro_batches(lens: list[int]) -> list[list[int]]:
    """Dataset order; as many sequences as fit MAX_TOKENS padded tokens (at least one)."""
    out: list[list[int]] = []
    cur: list[int] = []
    for i, n in enumerate(lens):
        if cur and (len(cur) + 1) * max(n, *(lens[j] for j in cur)) > MAX_TOKENS:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def bench_hf(cfg: Any, work: list[Step], args: Any, dev: Any) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    device = dev.torch_device() if dev.is_accelerator else torch.device("cpu")
    t0 = time.perf_counter()
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    build_s = time.perf_counter() - t0
    if args.baseline_act_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=dev.is_accelerator)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    dev.synchronize()
    dev.empty_cache()
    dev.reset_peak_memory_stats()
    times: list[float] = []
    padded = 0
    mbs = 0
    for i, step in enumerate(work):
        plan = baseline_micro_batches(step.lens)
        batch = step.batch.to(device)
        n_loss = float(batch.loss_mask.sum())
        dev.synchronize()
        t = time.perf_counter()
        for idx in plan:
            sub = batch.select(idx)
            s = int(sub.attention_mask.sum(1).max())
            ids, attn, lm = sub.input_ids[:, :s], sub.attention_mask[:, :s], sub.loss_mask[:, :s]
            with amp:
                logits = model(input_ids=ids, attention_mask=attn).logits
            lsm = logits.float().log_softmax(-1)
            lp = lsm[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
            adv = sub.extras["advantages"][:, None]
            loss = (-(adv * lp) * lm[:, 1:]).sum() / n_loss
            loss.backward()
            del logits, lsm, lp, loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dev.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
            padded += sum(len(idx) * max(step.lens[j] for j in idx) for idx in plan)
        mbs = max(mbs, len(plan))
    peak = dev.memory_stats().peak_allocated
    del model, opt
    gc.collect()
    dev.empty_cache()
    return {"times": times, "peak": peak, "build_s": build_s, "micro_batches": mbs, "padded": padded}


def summarise(
    name: str, r: dict[str, Any], work: list[Step], peak_flops: float | None, world: int
) -> dict[str, Any]:
    """Means over the timed steps (the last ``len(r["times"])`` of ``work``) in which neither torch.compile
    nor Triton compiled anything (steady state; compilation is a one-time cost, reported as
    ``compiled``); all timed steps when every one compiled."""
    timed = work[-len(r["times"]) :]
    flags = r.get("compiled") or [False] * len(timed)
    keep = [i for i, c in enumerate(flags) if not c] or list(range(len(timed)))
    step_s = sum(r["times"][i] for i in keep) / len(keep)
    tokens = sum(sum(timed[i].lens) for i in keep) / len(keep)
    flops = sum(timed[i].flops for i in keep) / len(keep)
    row = {
        "name": name,
        "step_s": step_s,
        "step_s_each": r["times"],
        "compiled": flags,
        "steady_steps": len(keep),
        "mfu_each": [s.flops / t / peak_flops for s, t in zip(timed, r["times"])] if peak_flops else [],
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_total": tokens * world / step_s,
        "mfu": (flops / step_s / peak_flops) if peak_flops else None,
        "peak_gib": r["peak"] / 2**30,
        "micro_batches": r["micro_batches"],
        "build_s": r["build_s"],
        "estimate_gib": r["estimate"] / 2**30 if r.get("estimate") else None,
        "compile_warmup": r.get("warmup"),
        "engine": r.get("engine"),
    }
    if "padded" in r:
        row["padding_fraction"] = 1 - sum(sum(s.lens) for s in timed) / r["padded"]
    return row


def bench_mcore(cfg: Any, work: list[Any], args: Any, dev: Any) -> dict[str, Any]:
    """Time ``forward_backward`` + ``optimizer_step`` of the mcore engine over ``work``."""
    from underlay.registry import get_engine

    ec = EngineConfig(
        model=ModelConfig(hf_config=cfg, seed=0),
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
        micro_batch_max_tokens=MAX_TOKENS if not args.quick else 256,
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
        engine.forward_backward(step.batch, pg_loss)
        engine.optimizer_step()
        dev.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    peak = dev.memory_stats().peak_allocated
    if args.profile and dev.is_accelerator:
        profile_step(engine, work[-1].batch, "mcore_tp1", args.out)
        syncs = count_syncs(engine, work[-1].batch)
        print(json.dumps(syncs, indent=1), flush=True)
        (Path(args.out) / "mcore_syncs_tp1.json").write_text(json.dumps(syncs, indent=1))
    del engine
    gc.collect()
    dev.empty_cache()
    return {"times": times, "peak": peak, "build_s": build_s}


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
            ("forward_backward", lambda b=b: engine.forward_backward(b, pg_loss)),
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


def mcore_compare(cfg: Any, work: list[Step], args: Any, dev: Any) -> int:
    """``--mcore``: mcore at TP=1 against fsdp2 (the first ``--act-ckpt`` variant) on ``work``."""
    tokens = [sum(s.lens) for s in work[args.warmup :]]
    results: dict[str, Any] = {"mcore": bench_mcore(cfg, work, args, dev)}
    print(f"mcore  {sum(tokens) / sum(results['mcore']['times']):10.0f} tokens/s (before fsdp2)", flush=True)
    results["fsdp2"] = bench_engine(cfg, work, args, dev, args.act_ckpt.split(",")[0])
    rows = {}
    for name, r in results.items():
        tps = sum(tokens) / sum(r["times"])
        rows[name] = {"tokens_per_s": tps, "peak_gib": r["peak"] / 2**30, "build_s": r["build_s"]}
        print(f"{name:6s} {tps:10.0f} tokens/s  peak {r['peak'] / 2**30:6.1f} GiB", flush=True)
    ratio = harness.ratio(rows["mcore"]["tokens_per_s"], rows["fsdp2"]["tokens_per_s"])
    summary = (
        f"{args.model}: mcore {rows['mcore']['tokens_per_s']:.0f} vs fsdp2 {rows['fsdp2']['tokens_per_s']:.0f} "
        f"tokens/s ({ratio:.3f}x; goal >= 0.9), peak {rows['mcore']['peak_gib']:.1f} vs "
        f"{rows['fsdp2']['peak_gib']:.1f} GiB"
    )
    harness.report("mcore", {"rows": rows, "ratio": ratio, "args": vars(args)}, summary, args.out)
    return 0


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen2-1.5b", choices=sorted(MODELS), help="model shape (random init)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    ap.set_defaults(warmup=2)  # untimed steps first (compilation settles)
    ap.add_argument("--sequences", type=int, default=64, help="sequences per rank and step")
    ap.add_argument(
        "--act-ckpt",
        default="none+layer@0.85",
        help="comma-separated fsdp2 variants, one row each: 'defaults' (no options at all: the engine's "
        f"auto choices), 'tuned' (= {TUNED}), or an activation-checkpointing mode (none, full), "
        "optionally with '+compile', '+norm_mlp' or '+layer' (engine option compile) and '@budget' "
        "(compile_memory_budget), e.g. none+layer,full+layer@0.8; a '+offload' suffix adds "
        "optimizer_offload=True; '+per_step' / '+per_mb' set grad_sync (e.g. tuned+per_mb,tuned+per_step "
        "prints their ratio)",
    )
    ap.add_argument("--baseline-act-ckpt", action="store_true")
    ap.add_argument("--profile", action="store_true", help="profile one more step of every fsdp2 variant")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument(
        "--memory-trace",
        action="store_true",
        help="record the allocator history: memory after the build and each phase, the largest live "
        "allocations by Python frame on an out-of-memory error",
    )
    ap.add_argument(
        "--same-batch",
        action="store_true",
        help="repeat one batch every step (runs A-F did) instead of new ones",
    )
    ap.add_argument("--mcore", action="store_true", help="mcore at TP=1 against fsdp2 instead (see above)")
    ap.add_argument("--mcore-recompute", default="none", choices=["none", "full", "selective"])
    args = ap.parse_args()
    harness.out_dir(args)
    from underlay.parallel.distributed import init_distributed
    from underlay.registry import get_device

    dev = get_device(args.device)
    if dev.is_accelerator and not count_triton_compiles():
        print(
            "this triton has no jit_post_compile_hook: steps that JIT-compile a Triton kernel are not flagged"
        )
    env = init_distributed(dev)
    rank, world = env.rank, env.world_size
    cfg = model_config(args.quick, args.model)
    work = workload(cfg, args, rank)
    if args.mcore:
        return mcore_compare(cfg, work, args, dev)
    peak_flops = dev.peak_flops(torch.bfloat16)
    rows: list[dict[str, Any]] = []
    hf_row = None  # the baseline runs first, so a time limit cuts variants rather than the baseline
    if world == 1 and not args.no_baseline:
        hf_row = summarise("hf", bench_hf(cfg, work, args, dev), work, peak_flops, world)
        print(f"hf baseline: {hf_row['step_s']:.3f} s/step, {hf_row['peak_gib']:.1f} GiB", flush=True)
    for variant in args.act_ckpt.split(","):
        try:
            r = bench_engine(cfg, work, args, dev, variant)
        except Exception as exc:  # one failing variant must not hide the others
            print(f"fsdp2/{variant} failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            gc.collect()
            dev.empty_cache()
            continue
        rows.append(summarise(f"fsdp2/{variant}", r, work, peak_flops, world))
        print(f"fsdp2/{variant}: {rows[-1]['step_s']:.3f} s/step, {rows[-1]['peak_gib']:.1f} GiB", flush=True)
    if not rows:
        print("every fsdp2 variant failed")
        return 1
    if hf_row is not None:
        rows.append(hf_row)
    if world > 1:  # the slowest rank sets the pace
        for row in rows:
            t = torch.tensor(
                [row["step_s"]],
                dtype=torch.float64,
                device=dev.torch_device() if dev.is_accelerator else "cpu",
            )
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            row["step_s_max_rank"] = float(t.item())
            row["tokens_per_s_total"] = row["tokens_per_s"] * row["step_s"] * world / float(t.item())
    result: dict[str, Any] = {
        "rows": rows,
        "world_size": world,
        "real_tokens_per_rank_step": [sum(st.lens) for st in work[args.warmup :]],
        "sequences_per_rank": args.sequences,
        "max_len": max(max(st.lens) for st in work[args.warmup :]),
        "mean_len": sum(sum(st.lens) for st in work[args.warmup :]) / (args.sequences * args.steps),
        "device": dev.model_name() if dev.is_accelerator else platform.processor(),
        "peak_tflops": peak_flops / 1e12 if peak_flops else None,
        "args": vars(args),
        "model": args.model,
    }
    hf_rows = [r for r in rows if r["name"] == "hf"]
    if hf_rows:
        ours, hf = rows[0], hf_rows[0]
        result["speedup_by_mode"] = {r["name"]: r["tokens_per_s"] / hf["tokens_per_s"] for r in rows[:-1]}
        result["speedup"] = harness.ratio(ours["tokens_per_s"], hf["tokens_per_s"])
        result["memory_ratio"] = harness.ratio(ours["peak_gib"], hf["peak_gib"])
        result["goals"] = {
            "mfu>=0.50": bool(ours["mfu"] is not None and ours["mfu"] >= 0.5),
            "speedup>=2": bool(result["speedup"] >= 2.0),
            "memory<=0.5": bool(result["memory_ratio"] <= 0.5),
        }
    if rank == 0:
        toks = result["real_tokens_per_rank_step"]
        batches = "one batch repeated" if args.same_batch else "new sequences every step"
        print(
            f"world {world}; {args.sequences} seqs/rank/step ({batches}), real tokens/rank/step {toks}, "
            f"max length {result['max_len']}"
        )
        print(f"{'':<22} {'step_s':>8} {'tok/s/gpu':>10} {'tok/s':>10} {'MFU':>6} {'peak GiB':>9} {'mbs':>4}")
        for r in rows:
            mfu = f"{r['mfu'] * 100:5.1f}%" if r["mfu"] is not None else "  n/a"
            print(
                f"{r['name']:<22} {r['step_s']:>8.3f} {r['tokens_per_s']:>10.0f} {r['tokens_per_s_total']:>10.0f} "
                f"{mfu:>6} {r['peak_gib']:>9.2f} {r['micro_batches']:>4}"
            )
            each = ", ".join(f"{t:.3f}{'*' if c else ''}" for t, c in zip(r["step_s_each"], r["compiled"]))
            mfus = ", ".join(f"{m * 100:.1f}%" for m in r["mfu_each"]) if r["mfu_each"] else "n/a"
            print(f"{'':<22} steps {each} s (* compiled: left out of the mean); MFU {mfus}")
        by_name = {r["name"]: r for r in rows}
        d, t = by_name.get("fsdp2/defaults"), by_name.get("fsdp2/tuned")
        if d is not None and t is not None and d["mfu"] is not None and t["mfu"] is not None:
            result["defaults_minus_tuned_mfu_points"] = (d["mfu"] - t["mfu"]) * 100
            print(
                f"{args.model}: defaults {d['mfu'] * 100:.1f}% MFU vs tuned {t['mfu'] * 100:.1f}%: "
                f"{result['defaults_minus_tuned_mfu_points']:+.1f} points (goal: within 2)"
            )
        comparisons = {}
        for per_step in rows:
            spec, extra = split_variant(per_step["name"].removeprefix("fsdp2/"))
            if not per_step["name"].startswith("fsdp2/") or extra.pop("grad_sync", None) != "per_step":
                continue
            twin = {**extra, "grad_sync": "per_micro_batch"}
            per_mb = next(
                (
                    r
                    for r in rows
                    if r["name"].startswith("fsdp2/") and split_variant(r["name"][6:]) == (spec, twin)
                ),
                None,
            )
            if per_mb is None:
                continue
            ratio = per_step["step_s"] / per_mb["step_s"]
            points = (per_step["mfu"] - per_mb["mfu"]) * 100 if per_step["mfu"] is not None else None
            label = spec + "".join(k for k, (o, _) in SUFFIXES.items() if o in extra)
            comparisons[label] = {
                "step_time_ratio_per_step_over_per_mb": ratio,
                "mfu_points": points,
                "peak_gib": (per_step["peak_gib"], per_mb["peak_gib"]),
            }
            mfu_text = f", MFU {points:+.2f} points" if points is not None else ""
            print(
                f"{args.model} {label}: grad_sync per_step vs per_micro_batch: step time x{ratio:.4f} "
                f"({per_step['step_s']:.3f} vs {per_mb['step_s']:.3f} s){mfu_text}, peak "
                f"{per_step['peak_gib']:.1f} vs {per_mb['peak_gib']:.1f} GiB"
            )
        if comparisons:
            result["grad_sync_comparison"] = comparisons
        for r in rows:
            if r.get("estimate_gib"):
                print(
                    f"{r['name']}: memory estimate {r['estimate_gib']:.1f} GiB vs measured peak "
                    f"{r['peak_gib']:.1f} GiB ({r['estimate_gib'] / r['peak_gib']:.2f}x)"
                )
        if "speedup" in result:
            print(
                f"speedup {result['speedup']:.2f}x, memory ratio {result['memory_ratio']:.2f}, goals {result['goals']}"
            )
            print(
                "speedup by mode: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["speedup_by_mode"].items())
            )
        name = "fsdp2" if world == 1 else f"fsdp2_dp{world}"
        if args.model != "qwen2-1.5b":
            name += f"_{args.model}"
        first = rows[0]
        mfu = f"{first['mfu'] * 100:.1f}% MFU" if first["mfu"] is not None else "MFU n/a"
        summary = f"{args.model} {first['name']}: {first['tokens_per_s_total']:.0f} tokens/s, {mfu}, peak {first['peak_gib']:.1f} GiB"
        if "speedup" in result:
            summary += f"; {result['speedup']:.2f}x hf tokens/s, {result['memory_ratio']:.2f}x its peak"
        harness.report(name, result, summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
