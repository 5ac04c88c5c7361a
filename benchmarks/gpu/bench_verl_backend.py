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
capped at 2048). Reports the first step's loss and grad norm of each (they should agree to bf16
precision), then tokens/s and peak memory averaged over ``--steps`` timed steps after one warm-up.
Writes ``$OUT/verl_backend_bench.json`` (or the current directory).

Run on the GPU host from the repo root, in the verl environment (``bash scripts/setup.sh verl`` built
with a CUDA torch and, for verl's remove-padding path, flash-attn)::

    torchrun --nproc_per_node 1 benchmarks/gpu/bench_verl_backend.py

``--device cpu --quick`` is a smoke run of the underlay contender alone with a tiny model (verl's FSDP
engine registers for cuda and npu only).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

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
    for step in range(args.steps + 1):
        td, tokens = _batch(args, vocab, remove_padding)
        if cuda:
            torch.cuda.synchronize()
            if step == 1:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with engine.train_mode():
            out = engine.train_batch(td, loss_fn)
        if cuda:
            torch.cuda.synchronize()
        if step == 0:
            first = {"loss": float(sum(out["loss"])), "grad_norm": float(out["metrics"]["grad_norm"])}
            # the same weights for every step: compare like with like (no drift between contenders)
        else:
            times.append(time.perf_counter() - t0)
    step_s = sum(times) / len(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    del engine
    if cuda:
        torch.cuda.empty_cache()
    return {"backend": backend, "step_s": step_s, "tokens_per_s": tokens / step_s, "peak_gib": peak, **first}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(MODELS))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--median-response", type=int, default=600)
    p.add_argument("--max-response", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny model, tiny batch (smoke run)")
    args = p.parse_args()
    if args.quick:
        args.model, args.prompts, args.group, args.prompt_len = "tiny", 2, 4, 8
        args.median_response, args.max_response, args.max_tokens, args.steps = 16, 32, 128, 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if args.device == "cpu":
        os.environ.setdefault("UNDERLAY_DEVICE", "cpu")
        os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    path = _model_dir(args.model)
    remove_padding = importlib.util.find_spec("flash_attn") is not None
    rows = []
    contenders = ["underlay"] if args.device == "cpu" else ["verl", "underlay"]
    for backend in contenders:
        try:
            rows.append(_run(backend, path, args, remove_padding))
        except Exception as exc:  # a contender that cannot run is reported, not fatal to the other
            rows.append({"backend": backend, "error": f"{type(exc).__name__}: {exc}"})
    if dist.get_rank() == 0:
        print(
            f"model {args.model}, {args.prompts}x{args.group} sequences, verl remove_padding={remove_padding}"
        )
        for r in rows:
            if "error" in r:
                print(f"{r['backend']:>9}: FAILED {r['error']}")
            else:
                print(
                    f"{r['backend']:>9}: step {r['step_s']:.3f} s  {r['tokens_per_s']:,.0f} tok/s  "
                    f"peak {r['peak_gib']:.2f} GiB  first-step loss {r['loss']:.6f} grad_norm {r['grad_norm']:.6f}"
                )
        ok = [r for r in rows if "error" not in r]
        if len(ok) == 2:
            print(f"underlay/verl tokens/s: {ok[1]['tokens_per_s'] / ok[0]['tokens_per_s']:.2f}x")
        out = Path(os.environ.get("OUT", ".")) / "verl_backend_bench.json"
        out.write_text(
            json.dumps({"args": vars(args), "remove_padding": remove_padding, "rows": rows}, indent=2)
        )
        print(f"wrote {out}")
    dist.destroy_process_group()
    sys.exit(0 if all("error" not in r for r in rows) else 1)


if __name__ == "__main__":
    main()
