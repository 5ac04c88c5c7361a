"""``underlay demo``: a miniature GRPO run over the whole library (see ``underlay.demo.grpo``).

The device comes from ``UNDERLAY_DEVICE`` (cpu: ``--world-size`` gloo processes; an accelerator: one
process per visible device, at most ``--world-size``), the engine from ``UNDERLAY_ENGINE``.
``--launcher ray`` runs the ranks as Ray actors (a local Ray started for the run, or ``RAY_ADDRESS``). The task:
answer with the word the prompt names, from a jsonl dataset the run writes, through underlay.data (a
BPE tokenizer trained on it, a chat template, a resumable sampler). Outputs under ``--out-dir``:
``data/echo_train.jsonl``, ``demo/metrics.jsonl`` and ``demo/tensorboard/``, ``profile/`` (a
torch-profiler trace of one step), ``checkpoints/``, ``hf_export/`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
from typing import Any

from underlay.demo.config import MODEL_SIZES, DemoConfig

__all__ = ["DemoConfig", "add_demo_parser", "run_demo"]


def add_demo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``demo`` subcommand on an ``argparse`` sub-parser action; returns its parser."""
    d = DemoConfig()
    p: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="miniature GRPO run: sampling, rewards, group advantages, FSDP2 updates, checkpoint, export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=d.steps, help=f"GRPO steps (>= 2; default {d.steps})")
    p.add_argument(
        "--model-size",
        choices=sorted(MODEL_SIZES),
        default=d.model_size,
        help="tiny: hidden 64, 2 layers; small: hidden 128, 4 layers (Qwen3-shaped, random init)",
    )
    p.add_argument("--out-dir", default=d.out_dir, help=f"output directory (default {d.out_dir})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the model, prompts and sampling")
    p.add_argument(
        "--world-size", type=int, default=d.world_size, help=f"processes (default {d.world_size}; cpu: gloo)"
    )
    p.add_argument(
        "--prompts-per-step", type=int, default=d.prompts_per_step, help="prompts per step (all ranks)"
    )
    p.add_argument(
        "--responses-per-prompt", type=int, default=d.responses_per_prompt, help="GRPO group size (>= 2)"
    )
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="response length limit")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    p.add_argument(
        "--launcher",
        choices=("torch", "ray"),
        default="torch",
        help="torch: spawned local processes (default); ray: Ray actors on a local Ray started for the "
        "run, or the cluster at RAY_ADDRESS (needs underlay[ray])",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_demo)
    return p


def run_demo(cfg: DemoConfig, launcher: str = "torch") -> dict[str, Any]:
    """Run the demo with ``launcher`` (``"torch"`` or ``"ray"``) and return its summary (the dict
    written to ``out_dir/summary.json``)."""
    from underlay.demo.launch import launch

    return launch(cfg, launcher)


def _cmd_demo(args: argparse.Namespace) -> int:
    from underlay.demo.launch import format_summary

    cfg = DemoConfig(
        steps=args.steps,
        model_size=args.model_size,
        out_dir=args.out_dir,
        seed=args.seed,
        world_size=args.world_size,
        prompts_per_step=args.prompts_per_step,
        responses_per_prompt=args.responses_per_prompt,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr,
        progress=not args.no_progress,
    )
    print(format_summary(run_demo(cfg, args.launcher)))
    return 0
