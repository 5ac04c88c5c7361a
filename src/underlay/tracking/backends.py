"""Tracking backends: console, jsonl, TensorBoard, and the optional wandb and mlflow."""

from __future__ import annotations

import importlib
import json
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, TextIO, runtime_checkable

from underlay.interfaces import BackendUnavailable, InvalidInput
from underlay.utils import env as _env
from underlay.utils.safe_files import as_path, writable_directory

__all__ = [
    "BUILTIN_BACKENDS",
    "ConsoleBackend",
    "JsonlBackend",
    "MlflowBackend",
    "TensorBoardBackend",
    "TrackerBackend",
    "WandbBackend",
    "read_jsonl",
]

BUILTIN_BACKENDS: tuple[str, ...] = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
"""Names ``Tracking`` accepts in its ``backends`` argument."""


@runtime_checkable
class TrackerBackend(Protocol):
    """Where metrics go. ``metrics`` maps names to finite or non-finite Python floats; ``step`` is an
    int >= 0 (both already validated by ``Tracking``). ``close`` flushes and releases resources and
    is idempotent."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` at ``step``."""

    def close(self) -> None:
        """Flush and release; later calls do nothing."""


def _import_optional(module: str, backend: str, extra: str = "tracking") -> ModuleType:
    """Import ``module`` or raise ``BackendUnavailable`` naming the package and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailable(
            "tracking",
            backend,
            f"the {module.split('.')[0]!r} package is not installed ({exc})",
            [b for b in ("console", "jsonl") if b != backend],
            f"pip install 'underlay[{extra}]' or pip install {module.split('.')[0]}",
        ) from exc


def _format_value(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 1e7:
        return str(int(value))
    return f"{value:.4g}"


class ConsoleBackend:
    """One line per step: ``step 3 | loss 0.1234 | reward/mean 0.5``, to ``stream`` (default stdout).

    ``keys`` restricts and orders the metrics printed (missing keys are skipped); ``None`` prints all
    in insertion order.
    """

    def __init__(self, stream: TextIO | None = None, keys: tuple[str, ...] | None = None) -> None:
        self._stream = stream
        self._keys = keys

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Print one line for ``step``."""
        names = [k for k in self._keys if k in metrics] if self._keys is not None else list(metrics)
        parts = [f"step {step}"] + [f"{k} {_format_value(metrics[k])}" for k in names]
        stream = self._stream if self._stream is not None else sys.stdout
        print(" | ".join(parts), file=stream, flush=True)

    def close(self) -> None:
        """Nothing to release (the stream belongs to the caller)."""


class JsonlBackend:
    """Appends ``{"step": s, "time": unix_seconds, **metrics}`` as one line to ``path`` per call and
    flushes it, so a crash loses at most the line being written. Non-finite values are written as
    ``null`` (JSON has no NaN/inf). The parent directory is created."""

    def __init__(self, path: str | Path) -> None:
        self.path = as_path(path, "JsonlBackend: path")
        if self.path.is_dir():
            raise InvalidInput(f"JsonlBackend: {self.path} is a directory; give the path of a .jsonl file")
        writable_directory(self.path.parent, "JsonlBackend")
        try:
            self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise InvalidInput(f"JsonlBackend: cannot open {self.path} for appending ({exc})") from exc

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Write one JSON line."""
        if self._file is None:
            return
        row: dict[str, Any] = {"step": step, "time": time.time()}
        row.update({k: (v if math.isfinite(v) else None) for k, v in metrics.items()})
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows a ``JsonlBackend`` wrote, in order. Raises ``InvalidInput`` naming the line when a
    line is not valid JSON (a truncated last line from a crash is skipped)."""
    rows: list[dict[str, Any]] = []
    file = as_path(path, "read_jsonl: path")
    if not file.is_file():
        raise InvalidInput(f"read_jsonl: {file} is not a file (missing or a directory)")
    lines = file.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                break
            raise InvalidInput(
                f"{path}: line {i + 1} is not valid JSON ({exc}); the file is corrupt"
            ) from exc
    return rows


class TensorBoardBackend:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` into ``log_dir`` (one event file per
    run). Raises ``BackendUnavailable`` when the ``tensorboard`` package is missing."""

    def __init__(self, log_dir: str | Path) -> None:
        _import_optional("tensorboard", "tensorboard")
        tb = _import_optional("torch.utils.tensorboard", "tensorboard")
        self.log_dir = writable_directory(
            as_path(log_dir, "TensorBoardBackend: log_dir"), "TensorBoardBackend"
        )
        self._writer: Any = tb.SummaryWriter(log_dir=str(self.log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Add every metric as a scalar at ``step`` and flush."""
        if self._writer is None:
            return
        for k, v in metrics.items():
            self._writer.add_scalar(k, v, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Close the writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbBackend:
    """Weights & Biases run (``wandb.init(project, name, dir, config)``); offline unless
    ``WANDB_MODE`` says otherwise, since underlay never assumes network access. Raises
    ``BackendUnavailable`` when ``wandb`` is not installed."""

    def __init__(
        self, project: str, run_name: str, out_dir: str | Path, config: Mapping[str, Any] | None = None
    ) -> None:
        wandb = _import_optional("wandb", "wandb")
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            project=project,
            name=run_name,
            dir=str(out_dir),
            config=dict(config or {}),
            mode=_env.get("WANDB_MODE"),
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """``run.log(metrics, step=step)``."""
        if self._run is not None:
            self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        """``run.finish()``."""
        if self._run is not None:
            self._run.finish()
            self._run = None


class MlflowBackend:
    """An MLflow run named ``run_name`` in experiment ``project``. The tracking URI is
    ``MLFLOW_TRACKING_URI`` when set, else a file store under ``out_dir/mlruns``. Raises
    ``BackendUnavailable`` when ``mlflow`` is not installed."""

    def __init__(
        self, project: str, run_name: str, out_dir: str | Path, config: Mapping[str, Any] | None = None
    ) -> None:
        self._mlflow: Any = _import_optional("mlflow", "mlflow")
        if _env.get_optional("MLFLOW_TRACKING_URI") is None:
            self._mlflow.set_tracking_uri((Path(out_dir).resolve() / "mlruns").as_uri())
        self._mlflow.set_experiment(project)
        self._run: Any = self._mlflow.start_run(run_name=run_name)
        if config:
            self._mlflow.log_params({k: str(v) for k, v in config.items()})

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """``mlflow.log_metrics(metrics, step=step)`` (MLflow metric names may not contain some
        characters; ``/`` is allowed)."""
        if self._run is not None:
            self._mlflow.log_metrics(dict(metrics), step=step)

    def close(self) -> None:
        """``mlflow.end_run()``."""
        if self._run is not None:
            self._mlflow.end_run()
            self._run = None
