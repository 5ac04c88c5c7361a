"""The one harness every benchmark uses: arguments, timing, ratios, the JSON record and its summary line.

A benchmark parses its arguments with :func:`parser` (``--out DIR``, default a fresh temporary
directory, never the repository), times with :func:`timeit` (warm-up calls, then repeats; the device
is synchronised around every timed call on an accelerator), measures its baseline in the same run and
reports ``ratio(result, baseline)``, and ends with :func:`report`: ``OUT/<name>.json`` holds the
figures plus the environment (:func:`environment`) and the command; one line ``<name>: <summary>``
goes to stdout.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Timing",
    "environment",
    "out_dir",
    "parser",
    "profile_step",
    "ratio",
    "report",
    "report_comparison",
    "row_ratios",
    "sync",
    "timeit",
]


def parser(description: str | None) -> argparse.ArgumentParser:
    """An argument parser with the shared options: ``--out`` (directory for the JSON record and any
    large output; default: a new temporary directory), ``--warmup`` and ``--repeats`` (for
    :func:`timeit`; a benchmark may ignore them where it times whole training steps itself)."""
    ap = argparse.ArgumentParser(
        description=(description or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: a new temp dir)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls")
    return ap


def out_dir(args: argparse.Namespace) -> Path:
    """The run's output directory: ``args.out`` (created) or a new temporary directory (stored back)."""
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="underlay-bench-"))
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def sync(device: str | torch.device | None = None) -> None:
    """Wait for the accelerator's queued work (no-op on cpu)."""
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    elif dev is not None and dev.type not in ("cpu", "cuda") and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median, minimum and every timed call."""

    median: float
    min: float
    all: list[float]


def timeit(
    fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5, device: str | torch.device | None = None
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` (>= 1) timed ones, the device
    synchronised before and after each timed call (wall-clock ``perf_counter``)."""
    if repeats < 1:
        raise ValueError(f"timeit(repeats={repeats}): needs at least one timed call")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times), min(times), times)


def ratio(value: float, baseline: float) -> float:
    """``value / baseline`` (baseline measured in the same run); ``inf`` for a zero baseline."""
    return value / baseline if baseline else float("inf")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Hardware and software of this run: date (UTC), command, python, platform, CPU count, torch and
    CUDA, the GPU's name when one is visible, and the versions of the packages a figure depends on."""
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "-m", _module_name(), *sys.argv[1:]]),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    for dist in ("transformers", "triton", "megatron-core", "flash-attn-4", "liger-kernel", "underlay"):
        version = _version(dist)
        if version is not None:
            env[dist] = version
    return env


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else sys.argv[0]


def report(name: str, result: dict[str, Any], summary: str, out: Path) -> Path:
    """Write ``out/<name>.json`` (``result`` plus ``environment``) and print ``<name>: <summary>``."""
    path = Path(out) / f"{name}.json"
    record = {"benchmark": name, "summary": summary, "environment": environment(), **result}
    path.write_text(json.dumps(record, indent=1, default=_jsonable))
    print(f"{name}: {summary} -> {path}", flush=True)
    return path


def row_ratios(
    rows: dict[str, dict[str, Any]], new: str, base: str, fields: dict[str, str]
) -> dict[str, float]:
    """``{"<label> <new> / <base>": ratio(rows[new][field], rows[base][field])}`` for each ``label: field``
    of ``fields``: the ratios of two measured variants (``base`` measured in the same run)."""
    return {f"{label} {new} / {base}": ratio(rows[new][f], rows[base][f]) for label, f in fields.items()}


def report_comparison(
    name: str,
    args: argparse.Namespace,
    rows: dict[str, dict[str, Any]],
    ratios: dict[str, float],
    summary: str,
    logprob_diff: float,
    diff_key: str,
    diff_note: str,
) -> Path:
    """The end of a benchmark that compares two variants of one model: print each ratio
    (``<key>: <value>x``) and the largest log-prob difference between the variants
    (``largest log-prob difference <diff_note>: <diff>``), then :func:`report` the record
    ``{"config": vars(args), "rows", "ratios", diff_key: logprob_diff}`` under ``name`` in
    ``out_dir(args)``. Returns the JSON path."""
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}x", flush=True)
    print(f"largest log-prob difference {diff_note}: {logprob_diff:.3e}", flush=True)
    result = {"config": vars(args), "rows": rows, "ratios": ratios, diff_key: logprob_diff}
    return report(name, result, summary, out_dir(args))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Timing):
        return asdict(obj)
    if isinstance(obj, Path | torch.dtype | torch.device):
        return str(obj)
    return repr(obj)


def profile_step(step: Callable[[], Any], label: str, out: Path) -> str:
    """Profile one call of ``step`` with torch.profiler (CPU + CUDA): its wall time, the 30 costliest
    device ops and the idle-gap attribution of ``underlay.profiling.trace_gaps``; written to
    ``out/profile_<label>.txt`` (the chrome trace, tens of MB, is deleted) and returned."""
    from underlay.profiling.trace_gaps import analyse

    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - t0
    trace = Path(out) / f"trace_{label}.json"
    prof.export_chrome_trace(str(trace))
    gaps = analyse(json.loads(trace.read_text()), top=22)
    trace.unlink()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)
    text = (
        f"profiled step ({label}): wall {wall:.3f} s ('Self CUDA time total' is kernel time)\n{table}\n{gaps}"
    )
    (Path(out) / f"profile_{label}.txt").write_text(text)
    print(text, flush=True)
    return text


QWEN3_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    # hidden, layers, q heads, kv heads, ffn (head dim 128, vocab 151936, tied embeddings: public shapes)
    "qwen3-1.7b": (2048, 28, 16, 8, 6144),
    "qwen3-4b": (2560, 36, 32, 8, 9728),
}


def qwen3_config(shape: str = "qwen3-1.7b", *, quick: bool = False) -> Any:
    """A random-init ``transformers.Qwen3Config`` of ``shape`` (``QWEN3_SHAPES``); ``quick``: a 2-layer
    toy (hidden 64, vocab 512) for cpu smoke runs."""
    from transformers import Qwen3Config

    if quick:
        return Qwen3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
    hidden, layers, heads, kv, ffn = QWEN3_SHAPES[shape]
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )


def pg_loss(outputs: Any, batch: Any, ctx: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A policy-gradient token-mean loss, ``-advantage * log_prob`` over ``batch.loss_mask``
    (``batch.extras["advantages"]``: ``[B]``), no metrics: an engine ``LossFn``."""
    from underlay.ops import aggregate_loss

    assert outputs.log_probs is not None
    adv = batch.extras["advantages"].to(outputs.log_probs.dtype)[:, None]
    return aggregate_loss(-(adv * outputs.log_probs), batch.loss_mask, "token-mean", ctx), {}
