"""``Tracking``: validate a step's metrics once and hand them to every configured backend."""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import torch

from underlay.interfaces import ConfigError, InvalidInput
from underlay.parallel.rank import current_rank
from underlay.tracking.backends import (
    BUILTIN_BACKENDS,
    ConsoleBackend,
    JsonlBackend,
    MlflowBackend,
    TensorBoardBackend,
    TrackerBackend,
    WandbBackend,
)

__all__ = ["Tracking"]


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise InvalidInput(
                f"Tracking.log: metric {name!r} is a tensor of shape {tuple(value.shape)}; log scalars "
                "(reduce it first, e.g. .mean())"
            )
        return float(value.detach().float().cpu().item())
    if isinstance(value, numbers.Real):
        return float(value)
    raise InvalidInput(
        f"Tracking.log: metric {name!r} has type {type(value).__name__}; log ints, floats, bools or "
        "one-element tensors"
    )


_RESERVED = frozenset({"step", "time"})


class Tracking:
    """Fan-out of per-step scalar metrics to several backends.

    ``backends``: names from ``BUILTIN_BACKENDS`` (``console``, ``jsonl``, ``tensorboard``, ``wandb``,
    ``mlflow``) and/or ``TrackerBackend`` objects; no duplicates. Files go under
    ``run_dir = out_dir / run_name``: ``metrics.jsonl`` and ``tensorboard/``. ``project`` names the
    wandb project / mlflow experiment and ``config`` is recorded by them as run parameters.
    ``rank``: the process that writes; ``None`` = rank 0 of the default process group (or the only
    process). Other ranks validate their input the same way but write nothing. ``console_keys``
    restricts and orders what the console prints; ``stream`` replaces stdout for it.

    Raises ``ConfigError`` for an unknown or duplicated backend name or a bad ``run_name``, and
    ``BackendUnavailable`` (naming the package to install) when an optional backend's package is missing;
    backends already opened are closed again before raising.
    """

    def __init__(
        self,
        backends: Sequence[str | TrackerBackend] = ("console", "jsonl", "tensorboard"),
        out_dir: str | Path = "underlay_out",
        run_name: str = "run",
        *,
        project: str = "underlay",
        config: Mapping[str, Any] | None = None,
        rank: int | None = None,
        console_keys: Sequence[str] | None = None,
        stream: TextIO | None = None,
    ) -> None:
        if isinstance(backends, str):
            raise ConfigError(
                f"Tracking(backends={backends!r}): pass a sequence of names, e.g. ({backends!r},)"
            )
        if not isinstance(backends, Sequence):
            raise ConfigError(f"Tracking(backends={backends!r}): pass a sequence of names, e.g. ('console',)")
        if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir).strip():
            raise ConfigError(f"Tracking(out_dir={out_dir!r}): give a directory path (str or pathlib.Path)")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ConfigError(
                f"Tracking(rank={rank!r}): give an int >= 0 or None (rank 0 of the process group)"
            )
        if not isinstance(run_name, str):
            raise ConfigError(f"Tracking(run_name={run_name!r}): give a str")
        if not run_name or run_name in (".", "..") or "/" in run_name or "\\" in run_name:
            raise ConfigError(
                f"Tracking(run_name={run_name!r}): use a non-empty name without path separators"
            )
        names = [b for b in backends if isinstance(b, str)]
        unknown = [b for b in names if b not in BUILTIN_BACKENDS]
        if unknown:
            raise ConfigError(
                f"Tracking: unknown backend(s) {unknown}; valid names: {', '.join(BUILTIN_BACKENDS)} "
                "(or pass an object with log(metrics, step) and close())"
            )
        if len(set(names)) != len(names):
            raise ConfigError(f"Tracking: backends {names} name one backend twice; list each once")
        for b in backends:
            if not isinstance(b, str) and not isinstance(b, TrackerBackend):
                raise ConfigError(
                    f"Tracking: backend {b!r} is neither a name nor an object with log(metrics, step) and close()"
                )
        self.run_dir = Path(out_dir) / run_name
        self.run_name = run_name
        if rank is None:
            rank = current_rank()
        self.is_writer = rank == 0
        self._backends: list[TrackerBackend] = []
        self._closed = False
        if not self.is_writer:
            return
        try:
            for b in backends:
                if isinstance(b, str):
                    self._backends.append(self._open(b, project, config, console_keys, stream))
                else:
                    self._backends.append(b)
        except BaseException:
            self.close()
            raise

    def _open(
        self,
        name: str,
        project: str,
        config: Mapping[str, Any] | None,
        console_keys: Sequence[str] | None,
        stream: TextIO | None,
    ) -> TrackerBackend:
        if name == "console":
            return ConsoleBackend(stream, tuple(console_keys) if console_keys is not None else None)
        if name == "jsonl":
            return JsonlBackend(self.jsonl_path)
        if name == "tensorboard":
            return TensorBoardBackend(self.tensorboard_dir)
        if name == "wandb":
            return WandbBackend(project, self.run_name, self.run_dir, config)
        return MlflowBackend(project, self.run_name, self.run_dir, config)

    @property
    def jsonl_path(self) -> Path:
        """``run_dir / "metrics.jsonl"`` (written only with the ``jsonl`` backend)."""
        return self.run_dir / "metrics.jsonl"

    @property
    def tensorboard_dir(self) -> Path:
        """``run_dir / "tensorboard"`` (written only with the ``tensorboard`` backend)."""
        return self.run_dir / "tensorboard"

    @property
    def backends(self) -> tuple[TrackerBackend, ...]:
        """The opened backends (empty on non-writing ranks)."""
        return tuple(self._backends)

    def log(self, metrics: Mapping[str, Any], step: int) -> dict[str, float]:
        """Validate and record ``metrics`` at ``step``; returns them as floats.

        Values: ints, floats, bools, numpy scalars or one-element tensors (converted to float; NaN and
        inf pass through, the jsonl backend writes them as ``null``). Keys: non-empty strings. ``step``:
        an int >= 0; ``"step"`` and ``"time"`` are reserved names. Raises ``InvalidInput`` naming the bad key or value before any backend writes, and
        when called after ``close``.
        """
        if self._closed:
            raise InvalidInput("Tracking.log called after close(); create a new Tracking")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidInput(f"Tracking.log: step={step!r}; pass an int >= 0")
        if not isinstance(metrics, Mapping):
            raise InvalidInput(
                f"Tracking.log: metrics={metrics!r:.60} is a {type(metrics).__name__}; pass a dict"
            )
        clean: dict[str, float] = {}
        for k, v in metrics.items():
            if not isinstance(k, str) or not k:
                raise InvalidInput(f"Tracking.log: metric name {k!r}; use non-empty strings")
            if k in _RESERVED:
                # the jsonl row is {"step": s, "time": t, **metrics}: these names would overwrite them
                raise InvalidInput(
                    f"Tracking.log: metric name {k!r} is reserved (the step and time of the row); rename it, "
                    f"e.g. 'train/{k}'"
                )
            clean[k] = _to_float(k, v)
        for b in self._backends:
            b.log(clean, step)
        return clean

    def close(self) -> None:
        """Close every backend (idempotent); the first error is re-raised after all were tried."""
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        for b in self._backends:
            try:
                b.close()
            except Exception as exc:  # close the others before reporting
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> Tracking:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
