"""One GRPO actor update through verl 0.9.1's own FSDP engine vs the underlay backend (issue 36).

Both contenders are built by verl's ``EngineRegistry.new`` from the same verl configs and driven the
way verl's trainer drives an actor: ``train_batch`` of a NO_PADDING TensorDict with verl's ``ppo_loss``
(GRPO: group-normalised outcome advantages from ``compute_grpo_outcome_advantage``, clipped policy
loss, token-mean, no KL, no entropy bonus), bf16 compute with fp32 master weights and reduction,
dynamic micro-batches of at most ``--max-tokens`` tokens, no activation checkpointing.

- ``verl``: ``FSDPEngineWithLMHead`` (backend ``fsdp2``), remove-padding (flash-attn varlen) when
  ``flash_attn`` is installed, else padded SDPA (reported).
- ``underlay``: ``underlay.integrations.verl`` (backend ``underlay``; ``UNDERLAY_ENGINE`` picks the
  underlay engine, default fsdp2).

Model: ``--model`` (default ``qwen2.5-1.5b``: Qwen2-shaped, random init saved to a temp dir), data:
``--prompts`` groups of ``--group`` responses, prompt 256 tokens, responses log-normal (median 600,
capped at 2048). Each contender runs ``--warmup`` untimed then ``--repeats`` timed updates; recorded:
the first update's loss and grad norm (same weights, same batch: they agree to bf16 precision), step
time, tokens/s, peak memory, and ``ratio`` = underlay tokens/s over verl's (same run). Harness record
``OUT/verl_backend.json`` and one summary line. Run on the GPU host from the repository root::

    python -m benchmarks.gpu.bench_verl_backend --out DIR

It needs verl 0.9.1 and its imports there (the GPU image has none of verl, ray, tensordict, omegaconf,
hydra-core, codetiming, datasets, pyarrow): ``bash scripts/gpu_wheels.sh --verl`` downloads them into
two folders that each fit one device call; ``docs/verl.md`` (GPU comparison) gives the two calls that
install them into ``.verl-site/`` and run this script. A contender that cannot run is recorded with its
error and the line that raised it (the deepest frame inside verl), not fatal to the other.
``--device cpu --quick`` is a smoke run of the underlay contender alone with a tiny model (verl's FSDP
engine registers for cuda and npu only).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import _harness as harness

MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
}


def _model_dir(name: str) -> str:
    """A random-init Qwen2 model saved as a Hugging Face directory (rank 0 writes, all wait)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = os.path.join(tempfile.gettempdir(), f"underlay_verl_bench_{name}")
    if dist.get_rank() == 0 and not os.path.isdir(path):
        cfg = Qwen2Config(max_position_embeddings=4096, **MODELS[name])
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    dist.barrier()
    return path


def _batch(args: argparse.Namespace, vocab: int, remove_padding: bool) -> Any:
    """The GRPO batch verl's actor receives, NO_PADDING layout, with verl's own advantages."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(1)
    n = args.prompts * args.group
    plen = args.prompt_len
    rlens = [
        max(
            8,
            min(
                args.max_response,
                int(math.exp(math.log(args.median_response) + 0.6 * torch.randn(1, generator=g).item())),
            ),
        )
        for _ in range(n)
    ]
    rmax = max(rlens)
    prompts = torch.randint(1, vocab, (args.prompts, plen), generator=g).repeat_interleave(args.group, 0)
    responses = torch.zeros(n, rmax, dtype=torch.long)
    rmask = torch.zeros(n, rmax, dtype=torch.long)
    for i, r in enumerate(rlens):
        responses[i, :r] = torch.randint(1, vocab, (r,), generator=g)
        rmask[i, :r] = 1
    attn = torch.cat([torch.ones(n, plen, dtype=torch.long), rmask], 1)
    scores = torch.zeros(n, rmax)
    scores[torch.arange(n), torch.tensor(rlens) - 1] = torch.rand(n, generator=g).round()
    index = torch.arange(args.prompts).repeat_interleave(args.group).numpy()
    adv, _ = compute_grpo_outcome_advantage(scores, rmask.float(), index)
    old = -torch.rand(n, rmax, generator=g) * 2 * rmask
    td = tu.get_tensordict(
        {
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attn,
            "position_ids": (attn.cumsum(1) - 1).clamp(min=0),
            "prompts": prompts,
            "responses": responses,
            "response_mask": rmask,
            "old_log_probs": old,
            "advantages": adv,
        }
    )
    td = left_right_2_no_padding(td)
    for key, value in {
        "temperature": 1.0,
        "global_batch_size": n,
        "calculate_entropy": False,
        "use_dynamic_bsz": True,
        "max_token_len_per_gpu": args.max_tokens,
        "use_remove_padding": remove_padding,
    }.items():
        tu.assign_non_tensor_data(td, key, value)
    return td, sum(rlens) + n * plen


def _engine(backend: str, path: str, args: argparse.Namespace, remove_padding: bool) -> Any:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    model = HFModelConfig(
        path=path,
        load_tokenizer=False,
        enable_gradient_checkpointing=False,
        use_remove_padding=remove_padding,
    )
    optim = FSDPOptimizerConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0, total_training_steps=100)
    if backend == "underlay":
        import underlay.integrations.verl as uv

        eng: Any = uv.UnderlayEngineConfig(max_token_len_per_gpu=args.max_tokens)
    else:
        eng = FSDPEngineConfig(
            strategy="fsdp2", max_token_len_per_gpu=args.max_tokens, use_torch_compile=False
        )
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="underlay" if backend == "underlay" else "fsdp2",
        model_config=model,
        engine_config=eng,
        optimizer_config=optim,
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def _run(backend: str, path: str, args: argparse.Namespace, remove_padding: bool) -> dict[str, Any]:
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    engine = _engine(backend, path, args, remove_padding)
    vocab = MODELS[args.model]["vocab_size"]
    n = args.prompts * args.group
    acfg = ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=n,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode="token-mean",
        clip_ratio=0.2,
        entropy_coeff=0.0,
        use_kl_loss=False,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=args.max_tokens,
        rollout_n=args.group,
    )
    loss_fn = functools.partial(ppo_loss, acfg)
    cuda = torch.cuda.is_available() and args.device == "cuda"
    first: dict[str, float] = {}
    times = []
    tokens = 0
    for step in range(args.warmup + args.repeats):
        td, tokens = _batch(args, vocab, remove_padding)
        if cuda:
            torch.cuda.synchronize()
            if step == args.warmup:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with engine.train_mode():
            out = engine.train_batch(td, loss_fn)
        if cuda:
            torch.cuda.synchronize()
        if step == 0:  # both contenders start from the same weights: their first steps must agree
            first = {"loss": float(sum(out["loss"])), "grad_norm": float(out["metrics"]["grad_norm"])}
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = sum(times) / len(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    del engine
    if cuda:
        torch.cuda.empty_cache()
    return {"backend": backend, "step_s": step_s, "tokens_per_s": tokens / step_s, "peak_gib": peak, **first}


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(MODELS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--median-response", type=int, default=600)
    ap.add_argument("--max-response", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny model, tiny batch (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.model, args.prompts, args.group, args.prompt_len = "tiny", 2, 4, 8
        args.median_response, args.max_response, args.max_tokens = 16, 32, 128
        args.warmup, args.repeats = 1, 1
    out = harness.out_dir(args)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if args.device == "cpu":
        os.environ.setdefault("UNDERLAY_DEVICE", "cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    path = _model_dir(args.model)
    remove_padding = importlib.util.find_spec("flash_attn") is not None
    # verl's FSDP engine registers for cuda and npu only: on the CPU the underlay contender runs alone
    contenders = ["underlay"] if args.device == "cpu" else ["verl", "underlay"]
    rows: dict[str, dict[str, Any]] = {}
    for backend in contenders:
        try:
            rows[backend] = _run(backend, path, args, remove_padding)
        except Exception as exc:  # a contender that cannot run is recorded, not fatal to the other
            rows[backend] = {
                "backend": backend,
                "error": f"{type(exc).__name__}: {exc}",
                "at": _blocking_line(exc),
            }
    dist.destroy_process_group()
    ok = {k: r for k, r in rows.items() if "error" not in r}
    result: dict[str, Any] = {
        "rows": rows,
        "args": vars(args),
        "remove_padding": remove_padding,
        "versions": {name: _version(name) for name in ("verl", "tensordict", "ray", "transformers", "torch")},
    }
    ours = ok.get("underlay")
    base = ok.get("verl")
    if ours and base:
        result["ratio"] = harness.ratio(ours["tokens_per_s"], base["tokens_per_s"])
        result["memory_ratio"] = harness.ratio(ours["peak_gib"], base["peak_gib"])
        summary = (
            f"{args.model} {args.prompts}x{args.group} GRPO update: underlay {ours['tokens_per_s']:,.0f} tok/s = "
            f"{result['ratio']:.2f}x verl fsdp2 ({base['tokens_per_s']:,.0f}), peak {ours['peak_gib']:.1f} vs "
            f"{base['peak_gib']:.1f} GiB, first-step grad_norm {ours['grad_norm']:.4f} vs {base['grad_norm']:.4f}"
        )
    elif ours:
        verl_row = rows.get("verl", {})
        why = f"{verl_row['error']} at {verl_row['at']}" if "error" in verl_row else "not run on the CPU"
        summary = f"{args.model}: underlay {ours['tokens_per_s']:,.0f} tok/s; no verl baseline ({why})"
    else:
        summary = "FAILED: " + "; ".join(f"{k}: {r['error']} at {r['at']}" for k, r in rows.items())
    harness.report("verl_backend", result, summary, out)
    return 0 if len(ok) == len(contenders) else 1


def _blocking_line(exc: BaseException) -> str:
    """Where ``exc`` was raised: the deepest frame inside verl if the traceback passes through verl (the line
    of verl that cannot run here), else the deepest frame, as ``path:line: source``."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    in_verl = [f for f in frames if f"{os.sep}verl{os.sep}" in f.filename]
    f = (in_verl or frames)[-1]
    return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
