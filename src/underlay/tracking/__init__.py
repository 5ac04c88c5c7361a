"""Experiment tracking: one ``Tracking`` object fans each step's metrics out to several backends.

Built-in backends: ``console`` (one line per step on stdout), ``jsonl`` (``metrics.jsonl``, one JSON
object per step, flushed per line), ``tensorboard`` (scalars through ``torch.utils.tensorboard``), and,
when their packages are installed, ``wandb`` and ``mlflow`` (imported only when asked for). Any object
with ``log(metrics, step)`` and ``close()`` can be passed as a backend too.

Only one process writes: by default the rank-0 process of the default process group (every process when
no group is initialised); on other ranks ``log``/``close`` are no-ops.

Example::

    with Tracking(("console", "jsonl"), out_dir="underlay_out", run_name="grpo") as tracker:
        tracker.log({"loss": 0.7, "reward/mean": 0.25}, step=0)
"""

from __future__ import annotations

from underlay.tracking.backends import (
    BUILTIN_BACKENDS,
    ConsoleBackend,
    JsonlBackend,
    MlflowBackend,
    TensorBoardBackend,
    TrackerBackend,
    WandbBackend,
    read_jsonl,
)
from underlay.tracking.tracking import Tracking

__all__ = [
    "BUILTIN_BACKENDS",
    "ConsoleBackend",
    "JsonlBackend",
    "MlflowBackend",
    "TensorBoardBackend",
    "TrackerBackend",
    "Tracking",
    "WandbBackend",
    "read_jsonl",
]
