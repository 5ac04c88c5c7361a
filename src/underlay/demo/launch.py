"""Starting the demo's processes and printing its summary."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from underlay.demo.config import DemoConfig
from underlay.interfaces import ConfigError, UnderlayError
from underlay.utils import env as _env

__all__ = ["LAUNCHERS", "OUTPUTS", "format_summary", "launch", "world_size_for"]

OUTPUTS = ("demo", "data", "checkpoints", "profile", "hf_export", "summary.json", ".errors")
"""What a run writes under ``out_dir`` (and removes from an earlier run there before it starts)."""


def world_size_for(requested: int) -> int:
    """``requested`` on the cpu; ``min(requested, visible devices)`` on an accelerator (one process per
    device). Raises ``ConfigError`` when an accelerator is selected but none is visible."""
    from underlay import registry

    device = registry.get_device()
    if not device.is_accelerator:
        return requested
    count = device.device_count()
    if count < 1:
        raise ConfigError(
            f"UNDERLAY_DEVICE selects {device.name!r} but no device is visible; check {device.visible_devices_env}"
        )
    return min(requested, count)


def _worker(rank: int, cfg: DemoConfig, world: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    # deterministic cuBLAS (the resume check compares bit for bit): the user's value, else the default
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = _env.get("CUBLAS_WORKSPACE_CONFIG")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from underlay.parallel.logging import setup_logging

    # the console shows rank 0 only; every rank's records go to its own file. Warnings and up unless
    # UNDERLAY_LOG_LEVEL asks for more (the demo's own progress lines are printed, not logged).
    quiet = None if _env.get_optional("UNDERLAY_LOG_LEVEL") else "WARNING"
    setup_logging(level=quiet, rank_zero_only=True, file=Path(out_dir) / "logs" / "demo.log")
    try:
        import transformers

        from underlay.demo.grpo import run_rank

        hf_logging: Any = transformers.utils.logging
        hf_logging.disable_progress_bar()  # no "Loading weights" bar in the demo output
        from underlay.parallel.distributed import init_distributed

        init_distributed(timeout_s=600.0)
        run_rank(cfg, out_dir)
    except BaseException as exc:
        errors = Path(out_dir) / ".errors"
        errors.mkdir(parents=True, exist_ok=True)
        record = {
            "type": type(exc).__name__,
            "message": str(exc),
            "underlay_error": isinstance(exc, UnderlayError),
            "traceback": traceback.format_exc(),
        }
        (errors / f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # All work and outputs are complete. Leave without interpreter teardown: a thread that
    # torch.profiler leaves behind occasionally aborts a spawned process at exit ("terminate called
    # without an active exception"), which would turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _raise_child_error(out: Path, exc: BaseException) -> None:
    records = []
    for p in sorted((out / ".errors").glob("rank*.json")):
        records.append((p.stem, json.loads(p.read_text(encoding="utf-8"))))
    for rank, rec in records:
        if rec["underlay_error"]:
            raise UnderlayError(f"demo {rank}: {rec['type']}: {rec['message']}") from exc
    if records:
        rank, rec = records[0]
        raise RuntimeError(f"demo {rank} failed:\n{rec['traceback']}") from exc
    raise exc


LAUNCHERS = ("torch", "ray")
"""``torch``: spawned local processes; ``ray``: Ray actors (``underlay.launch.ray.WorkerGroup``)."""


def _ray_rank(cfg: DemoConfig, out_dir: str, world: int) -> dict[str, Any]:
    """The demo on one Ray actor rank (its process group is already initialised by the group)."""
    import torch
    import transformers

    from underlay.demo.grpo import run_rank

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    hf_logging: Any = transformers.utils.logging
    hf_logging.disable_progress_bar()
    return run_rank(cfg, out_dir)


def _launch_ray(cfg: DemoConfig, out: Path) -> None:
    """The ranks as Ray actors: joins ``RAY_ADDRESS`` or an initialised Ray, else starts a local one
    (and stops it afterwards). ``cfg.world_size`` ranks, each reserving one device of the selected
    backend's Ray resource (one CPU on the cpu). A failed rank raises ``RankFailure`` (an
    ``UnderlayError``) naming the rank, its host and the cause."""
    import ray

    from underlay.launch.ray import WorkerGroup, ensure_ray

    world = cfg.world_size
    cfg.check_world(world)
    started = ensure_ray(num_cpus=max(world, os.cpu_count() or 1))
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "CUBLAS_WORKSPACE_CONFIG": _env.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    try:
        with WorkerGroup(world, env=env, name="underlay-demo", collective_timeout_s=600.0) as group:
            group.run(_ray_rank, cfg, str(out), world)
    finally:
        if started:
            ray.shutdown()


def launch(cfg: DemoConfig, launcher: str = "torch") -> dict[str, Any]:
    """Run the demo and return rank 0's summary (also in ``out_dir/summary.json``). Earlier demo outputs
    in ``out_dir`` (``OUTPUTS``) are removed first.

    ``launcher="torch"``: ``world_size_for(cfg.world_size)`` spawned local processes (gloo on the cpu,
    the device's collective backend otherwise); an ``UnderlayError`` in any process is re-raised here as
    ``UnderlayError`` naming the rank and the original type and message, any other failure as
    ``RuntimeError`` carrying the child's traceback. ``launcher="ray"``: ``cfg.world_size`` Ray actors
    (see ``_launch_ray``); a failure raises ``underlay.launch.ray.RankFailure``. Raises ``ConfigError``
    for another launcher name.
    """
    import importlib

    from underlay.parallel.distributed import free_port

    if launcher not in LAUNCHERS:
        raise ConfigError(f"demo --launcher={launcher!r}: use one of {LAUNCHERS}")
    # the module (``torch.multiprocessing.spawn`` as an attribute is the function of that name)
    spawn: Any = importlib.import_module("torch.multiprocessing.spawn")

    world = world_size_for(cfg.world_size) if launcher == "torch" else cfg.world_size
    cfg.check_world(world)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    t0 = time.perf_counter()
    if launcher == "ray":
        _launch_ray(cfg, out)
    else:
        # a port found free can be taken by another process before rank 0 listens on it: the ranks
        # then fail in the rendezvous before any work, and a new port is tried (three in all)
        for attempt in range(3):
            try:
                _start_processes(spawn, cfg, world, out, free_port())
                break
            except (RuntimeError, UnderlayError) as exc:
                if attempt == 2 or "EADDRINUSE" not in str(exc):
                    raise
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    summary["launch_wall_s"] = time.perf_counter() - t0
    summary["launcher"] = launcher
    return summary


def _start_processes(spawn: Any, cfg: DemoConfig, world: int, out: Path, port: int) -> None:
    try:
        spawn.start_processes(
            _worker, args=(cfg, world, port, str(out)), nprocs=world, join=True, start_method="spawn"
        )
    except (spawn.ProcessRaisedException, spawn.ProcessExitedException) as exc:
        _raise_child_error(out, exc)


def _fmt(v: Any, spec: str = ".4g") -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "n/a"
    return format(v, spec)


def format_summary(summary: dict[str, Any]) -> str:
    """The final table of a run: one row per step, then the resume, export, trace and output lines."""
    cfg = summary["config"]
    hist = summary["history"]
    head = (
        f"underlay demo: {len(hist)} GRPO steps, Qwen3-shaped {cfg['model_size']} model "
        f"({summary['parameters'] / 1e6:.2f} M params), {summary['engine']} on {summary['world_size']} x "
        f"{summary['device']} ({summary['device_model']}, {summary['param_dtype']}), {summary['wall_s']:.1f} s in the workers"
        + (f", {summary['launch_wall_s']:.1f} s with process start" if "launch_wall_s" in summary else "")
        + (" (ranks as Ray actors)" if summary.get("launcher") == "ray" else "")
    )
    cols = [
        ("step", "step", "d"),
        ("loss", "loss", ".4f"),
        ("reward", "reward/mean", ".3f"),
        ("acc", "accuracy", ".2f"),
        ("grad_norm", "grad_norm", ".3f"),
        ("tokens/s", "tokens_per_s", ".0f"),
        ("mfu", "mfu", ".2e"),
        ("gen_s", "timing/gen", ".3f"),
        ("oldlp_s", "timing/old_logprob", ".3f"),
        ("update_s", "timing/update", ".3f"),
        ("sync_s", "timing/sync", ".3f"),
    ]
    rows = [[h for h, _, _ in cols]]
    for i, m in enumerate(hist):
        rows.append([str(i) if k == "step" else _fmt(m.get(k), spec) for _, k, spec in cols])
    widths = [max(len(r[j]) for r in rows) for j in range(len(cols))]
    kernels = summary.get("kernels", {})
    if kernels:
        head += "\nkernels: " + ", ".join(f"{k} {v}" for k, v in kernels.items())
    lines = [head, ""]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    r, e = summary["resume"], summary["export"]
    verdict = (
        "identical"
        if r["identical"]
        else f"equal within {r['max_rel_diff']:.2g} (relative)"
        if r["ok"]
        else f"DIFFERENT ({r['max_rel_diff']:.2g} relative)"
    )
    learn, data = summary.get("learning"), summary.get("data")
    if data:
        lines += [
            "",
            f"data:    {data['path']} (echo task: answer with the named word), {data['report']}; BPE "
            f"tokenizer trained on it, {data['vocab_size']} tokens, chat template",
        ]
    if learn:
        lines += [
            f"learning: mean reward {learn['reward_first']:.3f} over the first {learn['window']} steps -> "
            f"{learn['reward_last']:.3f} over the last {learn['window']} ({learn['ratio']:.1f}x)",
        ]
    lines += [
        "",
        f"resume:  step {r['step']} redone after reloading {r['checkpoint']}: loss {r['loss']!r} vs "
        f"{r['loss_after_reload']!r}, grad norm {r['grad_norm']!r} vs {r['grad_norm_after_reload']!r} -> {verdict}",
        f"export:  {e['path']} reloaded with transformers: max |logits - rollout copy| = "
        f"{e['max_abs_logit_diff']:.3g}, max |log-prob - engine.infer| = "
        f"{e['max_abs_logprob_diff_vs_engine']:.3g}, tokenizer round trip "
        f"{'ok' if e['tokenizer_roundtrip'] else 'FAILED'}",
        f"trace:   {', '.join(summary['traces']) or '(none written)'}",
        f"metrics: {summary['metrics_jsonl']}"
        + (f", TensorBoard: {summary['tensorboard']}" if summary["tensorboard"] else ""),
    ]
    lines += [f"note:    {n}" for n in summary["notes"]]
    return "\n".join(lines)
