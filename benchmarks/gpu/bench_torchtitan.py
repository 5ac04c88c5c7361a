"""underlay's fsdp2 engine beside torchtitan, on one GPU, in one process: the same Llama 3 shape, the
same initial weights (torchtitan's own init, converted to Hugging Face names by torchtitan's own state-dict
adapter), the same token batches, the same AdamW (lr, betas, eps, weight decay) and clipping.

torchtitan runs as its trainer configures a single GPU: its ``parallelize_llama`` with its default job
config (selective activation checkpointing, per-block ``torch.compile``, a compiled loss) and AMP bf16
autocast (it applies FSDP only with more than one data-parallel rank). underlay runs its engine with the
defaults (``EngineConfig`` with only the model, optimizer and ``micro_batch_max_tokens`` set).

Cases: ``full`` (every row ``seq_len`` tokens: equal work for both) and ``rl`` (a long-tailed mix of
lengths: torchtitan pads every row to ``seq_len`` and accumulates over micro-batches of ``rows_per_mb``
rows; underlay packs). Reported: real tokens/s of each (steps after ``warmup``), the ratio
underlay/torchtitan, peak memory, and both loss curves with their largest difference.

    python -m benchmarks.gpu.bench_torchtitan --shape 1b --out DIR      (needs torchtitan 0.2.2)
    python -m benchmarks.gpu.bench_torchtitan --shape tiny --device cpu --out DIR   (logic check, fp32)

torchtitan's ``import torchtitan.models.llama3`` imports ``datasets`` (its data loaders); where that is
not installed a stand-in module is registered, as nothing here loads data.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B's layers, untied embeddings (torchtitan's model has no tying)
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256),
    # Llama-3.1-8B
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32),
}


def _import_torchtitan() -> Any:
    try:
        import datasets  # noqa: F401
    except ImportError:  # only torchtitan's data loaders use it
        stub = types.ModuleType("datasets")
        for name in ("Dataset", "IterableDataset", "load_dataset", "interleave_datasets"):
            setattr(stub, name, type(name, (), {}) if name[0].isupper() else (lambda *a, **k: None))
        dist_stub = types.ModuleType("datasets.distributed")
        dist_stub.split_dataset_by_node = lambda *a, **k: None  # type: ignore[attr-defined]
        sys.modules["datasets"], sys.modules["datasets.distributed"] = stub, dist_stub
    import torchtitan.models.llama3 as tt

    return tt


def _batches(steps: int, rows: int, seq: int, vocab: int, mode: str, seed: int) -> list[list[torch.Tensor]]:
    """Per step, ``rows`` token sequences of ``seq + 1`` tokens (``full``) or of long-tailed lengths
    between 64 and ``seq + 1`` (``rl``, log-normal), the same for both trainers."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if mode == "full":
            lens = [seq + 1] * rows
        else:
            raw = torch.empty(rows).log_normal_(mean=math.log(seq / 6), std=0.9, generator=g)
            lens = [int(min(seq + 1, max(64, x))) for x in raw.tolist()]
        out.append([torch.randint(0, vocab, (n,), generator=g) for n in lens])
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _StepProfile:
    """With ``--profile``: profile step ``at`` of a run (one whole optimizer step), write its chrome
    trace to ``out/<name>_trace.json`` and print the top device kernels by total time and the device
    time per kernel family (gemm, attention, copies/casts, elementwise/reductions, other)."""

    def __init__(self, enabled: bool, at: int, out: Path, name: str) -> None:
        self.enabled, self.at, self.out, self.name = enabled, at, out, name
        self.prof: Any = None

    def start(self, step: int) -> None:
        if self.enabled and step == self.at:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()

    def stop(self, step: int) -> None:
        if self.prof is None or step != self.at:
            return
        self.prof.__exit__(None, None, None)
        trace = self.out / f"{self.name}_trace.json"
        self.prof.export_chrome_trace(str(trace))
        rows = [e for e in self.prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
        rows = [
            e
            for e in rows
            if not e.key.startswith(("aten::", "autograd::", "Torch-Compiled", "CompiledFunction"))
        ]
        rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
        fam: dict[str, float] = {}
        for e in rows:
            k = e.key.lower()
            f = (
                "gemm"
                if any(t in k for t in ("gemm", "cutlass", "sm90_xmma", "nvjet", "matmul"))
                else "attention"
                if any(t in k for t in ("flash", "fmha", "attention", "sdpa"))
                else "copy/cast"
                if any(t in k for t in ("copy", "memcpy", "cast", "memset", "chunk_cat", "split_with_sizes"))
                else "triton"
                if k.startswith("triton")
                else "other"
            )
            fam[f] = fam.get(f, 0.0) + e.self_device_time_total / 1e3
        total = sum(fam.values())
        print(
            f"[profile {self.name}] device ms by family: "
            + json.dumps({k: round(v, 1) for k, v in sorted(fam.items())})
            + f" total {total:.1f}",
            flush=True,
        )
        for e in rows[:25]:
            print(
                f"[profile {self.name}]   {e.self_device_time_total / 1e3:9.2f} ms  x{e.count:<5d} {e.key[:110]}",
                flush=True,
            )
        try:
            from underlay.profiling.trace_gaps import analyse

            print(analyse(json.loads(trace.read_text()), top=8), flush=True)
        except Exception as exc:  # the gap report is optional
            print(f"[profile {self.name}] gap analysis failed: {exc}", flush=True)
        self.prof = None


def run_torchtitan(
    tt: Any, args: Any, shape: dict[str, Any], batches: Any, device: torch.device, hf_dir: Path
) -> dict[str, Any]:
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims

    margs = tt.TransformerModelArgs(
        vocab_size=args.vocab, rope_theta=500000, max_seq_len=args.seq_len + 1, **shape
    )
    job = JobConfig()
    job.training.seq_len = args.seq_len
    job.compile.enable = device.type == "cuda"
    job.compile.components = ["model", "loss"]
    if device.type != "cuda":
        job.activation_checkpoint.mode = "none"
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    with torch.device("meta"):
        model = tt.Transformer(margs)
    model = tt.parallelize_llama(model, dims, job)
    model.to_empty(device=device)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    # the initial weights, in Hugging Face names, for underlay (once per shape: the seed fixes them)
    if not (hf_dir / "model.safetensors").exists():
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items() if "freqs_cis" not in k}
        state = {
            k.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", ""): v
            for k, v in state.items()
        }
        _save_hf(tt.Llama3StateDictAdapter(margs, None).to_hf(state), margs, model, hf_dir, args)
        del state
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(
        params,
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        **({"fused": True} if device.type == "cuda" else {}),
    )
    loss_fn = torch.nn.functional.cross_entropy
    if job.compile.enable:
        loss_fn = torch.compile(loss_fn)
    amp = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    losses, times = [], []
    prof = _StepProfile(args.profile, args.warmup - 1, args.out_dir, f"torchtitan_{args.case}")
    for step, seqs in enumerate(batches):
        _sync(device)
        prof.start(step)
        t0 = time.perf_counter()
        real = sum(len(s) - 1 for s in seqs)
        total = torch.zeros((), device=device)
        for i in range(0, len(seqs), args.rows_per_mb):
            chunk = seqs[i : i + args.rows_per_mb]
            inp = torch.zeros(len(chunk), args.seq_len, dtype=torch.long)
            lab = torch.full((len(chunk), args.seq_len), -100, dtype=torch.long)
            for r, s in enumerate(chunk):
                inp[r, : len(s) - 1] = s[:-1]
                lab[r, : len(s) - 1] = s[1:]
            inp, lab = inp.to(device), lab.to(device)
            with amp:
                logits = model(inp)
            loss = (
                loss_fn(logits.flatten(0, 1).float(), lab.flatten(0, 1), ignore_index=-100, reduction="sum")
                / real
            )
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=device.type == "cuda")
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
        _sync(device)
        times.append(time.perf_counter() - t0)
        prof.stop(step)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    del model, opt, params
    return {"losses": losses, "times": times, "peak_gib": peak}


def _save_hf(hf_state: dict[str, torch.Tensor], margs: Any, model: Any, out: Path, args: Any) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    ffn = int(hf_state["model.layers.0.mlp.gate_proj.weight"].shape[0])
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=margs.dim,
        intermediate_size=ffn,
        num_hidden_layers=margs.n_layers,
        num_attention_heads=margs.n_heads,
        num_key_value_heads=margs.n_kv_heads,
        rms_norm_eps=margs.norm_eps,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "factor": margs.rope_scaling_args.scaling_factor,
            "low_freq_factor": margs.rope_scaling_args.low_freq_factor,
            "high_freq_factor": margs.rope_scaling_args.high_freq_factor,
            "original_max_position_embeddings": margs.rope_scaling_args.original_max_position_embeddings,
            "rope_theta": float(margs.rope_theta),
        },
        architectures=["LlamaForCausalLM"],
    )
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(out / "model.safetensors"))


def run_underlay(args: Any, batches: Any, device: torch.device, hf_dir: Path) -> dict[str, Any]:
    import underlay
    from underlay.interfaces import EngineConfig, ModelConfig, OptimConfig, TokenBatch
    from underlay.ops import aggregate_loss

    attention: Any = None  # the registry's choice
    if args.attention_dense_uniform:  # the torch kernel's opt-in batched SDPA for equal-length rows
        from underlay.backends.portable.attention import TorchAttention

        attention = TorchAttention(underlay.get_device(), dense_uniform=True)
    cfg = EngineConfig(
        model=ModelConfig(path=str(hf_dir), attention=attention),
        optim=OptimConfig(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0),
        micro_batch_max_tokens=args.micro_batch_tokens,
        recompute=args.recompute,
        options=json.loads(args.underlay_options),
        **({} if device.type == "cuda" else {"param_dtype": "float32", "reduce_dtype": "float32"}),
    )
    engine = underlay.get_engine(cfg)

    def ce(outputs: Any, batch: Any, ctx: Any) -> Any:
        loss = aggregate_loss(-outputs.log_probs, batch.loss_mask, "token-mean", ctx)
        return loss, {}

    for key in ("resolved_options", "option_reasons", "recompute"):
        if hasattr(engine, key):
            print(f"[underlay] {key}: {getattr(engine, key)}", flush=True)
    losses, times = [], []
    prof = _StepProfile(args.profile, args.warmup - 1, args.out_dir, f"underlay_{args.case}")
    for step, seqs in enumerate(batches):
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = s
            attn[r, : len(s)] = 1
        loss_mask = attn.clone()
        loss_mask[:, 0] = 0  # position 0 scores nothing; positions 1.. score tokens 1.. given their prefix
        batch = TokenBatch(ids, attn, loss_mask)
        _sync(device)
        prof.start(step)
        t0 = time.perf_counter()
        res = engine.forward_backward(batch, ce)
        engine.optimizer_step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        prof.stop(step)
        losses.append(float(res.metrics["loss"]))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    del engine
    return {"losses": losses, "times": times, "peak_gib": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--cases", default="full,rl")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=4, help="rows per step (full); rl uses 4x as many, shorter")
    ap.add_argument("--rows-per-mb", type=int, default=4, help="torchtitan rows per micro-batch")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="profile the last warm-up step of each run")
    ap.add_argument("--recompute", default="auto", help="underlay's EngineConfig.recompute")
    ap.add_argument("--underlay-options", default="{}", help="underlay's EngineConfig.options, as JSON")
    ap.add_argument(
        "--attention-dense-uniform",
        action="store_true",
        help="underlay's attention: TorchAttention(device, dense_uniform=True) as ModelConfig.attention "
        "(equal-length packed rows as one batched SDPA call)",
    )
    ap.add_argument("--trainers", default="torchtitan,underlay")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name (variants into one --out)")
    args = ap.parse_args()
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="bench_torchtitan_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir = out_dir
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    tt = _import_torchtitan()
    results: dict[str, Any] = {
        "shape": args.shape,
        "seq_len": args.seq_len,
        "device": str(device),
        "underlay_recompute": args.recompute,
        "underlay_options": json.loads(args.underlay_options),
        "underlay_attention_dense_uniform": args.attention_dense_uniform,
    }
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
    import torchtitan
    import transformers

    results["versions"] = {
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", "0.2.2"),
        "transformers": transformers.__version__,
    }
    for case in args.cases.split(","):
        args.case = case
        rows = args.rows if case == "full" else args.rows * 4
        batches = _batches(args.steps, rows, args.seq_len, args.vocab, case, args.seed)
        real = [sum(len(s) - 1 for s in b) for b in batches]
        hf_dir = out_dir / f"hf_{args.shape}"  # the same seed gives the same init for every case
        entry: dict[str, Any] = {
            "rows": rows,
            "real_tokens_per_step": real[0] if case == "full" else sum(real) / len(real),
        }
        for name, fn in (
            (
                "torchtitan",
                lambda b=batches, d=hf_dir: run_torchtitan(tt, args, SHAPES[args.shape], b, device, d),
            ),
            ("underlay", lambda b=batches, d=hf_dir: run_underlay(args, b, device, d)),
        ):
            needs_init = name == "torchtitan" and not (hf_dir / "model.safetensors").exists()
            if name not in args.trainers.split(",") and not needs_init:
                continue
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                r = fn()
            except torch.OutOfMemoryError as exc:
                r = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
            except Exception as exc:  # report and go on with the other trainer / case
                r = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            gc.collect()
            if "times" in r:
                t = r["times"][args.warmup :]
                r["tokens_per_s"] = sum(real[args.warmup :]) / sum(t)
            entry[name] = r
            print(
                f"[{case}] {name}: " + json.dumps({k: v for k, v in r.items() if k not in ("times",)}),
                flush=True,
            )
            if name == "torchtitan" and "error" in r and not (hf_dir / "model.safetensors").exists():
                entry["underlay"] = {"error": "skipped: torchtitan did not produce the initial weights"}
                break
        a, b = entry.get("underlay", {}), entry.get("torchtitan", {})
        if "tokens_per_s" in a and "tokens_per_s" in b:
            entry["ratio_underlay_over_torchtitan"] = a["tokens_per_s"] / b["tokens_per_s"]
            entry["max_loss_diff"] = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
            print(
                f"[{case}] underlay/torchtitan tokens/s = {entry['ratio_underlay_over_torchtitan']:.3f} "
                f"({a['tokens_per_s']:.0f} vs {b['tokens_per_s']:.0f}); max |loss diff| over {args.steps} steps "
                f"= {entry['max_loss_diff']:.4f}",
                flush=True,
            )
        results[case] = entry
        # after every case: a run stopped later still leaves the cases it finished
        (out_dir / f"torchtitan_{args.shape}{args.tag}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
