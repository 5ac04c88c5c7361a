"""Device-agnostic profilers: ``off`` (records nothing, near-zero cost) and ``torch`` (torch.profiler)."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from underlay.backends._profiling import NULL_RANGE, HookRange, ProfilerBase, check_options, identity
from underlay.interfaces import Device, ProfilerConfig

__all__ = ["OffProfiler", "TorchProfiler"]

F = TypeVar("F", bound=Callable[..., Any])

_TORCH_OPTIONS: dict[str, Any] = {"with_flops": False, "with_modules": False, "gzip": False}


class OffProfiler:
    """The ``off`` profiler: records nothing and writes nothing on any rank, whatever the config says.

    ``range`` returns one shared no-op context and ``annotate`` returns the function itself, so both cost
    well under a microsecond per call (``benchmarks/results/profiler.md``).
    """

    __slots__ = ("_config", "_device")

    def __init__(self, config: ProfilerConfig, device: Device) -> None:
        self._config = config
        self._device = device

    @property
    def name(self) -> str:
        """``"off"``."""
        return "off"

    @property
    def enabled(self) -> bool:
        """Always ``False``."""
        return False

    def start(self) -> None:
        """No-op."""

    def stop(self) -> None:
        """No-op."""

    def step(self) -> None:
        """No-op."""

    def range(self, name: str) -> AbstractContextManager[None]:
        """The shared no-op context."""
        return NULL_RANGE

    def annotate(self, name: str | None = None) -> Callable[[F], F]:
        """A decorator that returns the function unchanged."""
        return identity


def _enter_record_function(name: str) -> torch.profiler.record_function:
    rf = torch.profiler.record_function(name)
    rf.__enter__()  # type: ignore[no-untyped-call]
    return rf


def _exit_record_function(rf: torch.profiler.record_function) -> None:
    rf.__exit__(None, None, None)


class TorchProfiler(ProfilerBase):
    """``torch.profiler`` driven by the step schedule of a ``ProfilerConfig``.

    Activities: CPU, plus CUDA when ``device.name == "cuda"`` (``PrivateUse1`` for ``"npu"``). The
    configured steps become a per-step schedule: a configured step records; up to ``config.warmup``
    steps before each run of consecutive configured steps are warm-up (profiled, not saved); every
    other step is idle. Each run of consecutive recorded steps is written, on enabled ranks only, to
    ``config.output_dir`` as ``rank{r}_step{s}.json`` (``format="chrome"``; ``s`` is the first step of
    the run) or through ``torch.profiler.tensorboard_trace_handler`` as
    ``rank{r}_step{s}.<timestamp>.pt.trace.json`` (``format="tensorboard"``). With ``config.steps``
    empty, everything from ``start`` to ``stop`` is one run. ``with_memory``, ``with_stack`` and
    ``record_shapes`` map to torch's ``profile_memory``, ``with_stack``, ``record_shapes``.

    ``config.options``: ``with_flops`` (bool), ``with_modules`` (bool), ``gzip`` (bool: write the trace
    gzipped, ``.json.gz``). ``range(name)`` is ``torch.profiler.record_function(name)``
    while a configured step runs. Unknown options raise ``ConfigError``.
    """

    _NAME = "torch"

    def __init__(self, config: ProfilerConfig, device: Device) -> None:
        super().__init__(config, device)
        self._opts = check_options("torch", config.options, _TORCH_OPTIONS)
        self._prof: torch.profiler.profile | None = None
        self._offset = 0
        self._block_start = 0
        self._traces: list[Path] = []

    @property
    def traces(self) -> list[Path]:
        """Trace files written so far by this profiler, in order."""
        return list(self._traces)

    def _activities(self) -> list[ProfilerActivity]:
        acts = [ProfilerActivity.CPU]
        if self._device.name == "cuda":
            acts.append(ProfilerActivity.CUDA)
        elif self._device.name == "npu" and hasattr(ProfilerActivity, "PrivateUse1"):
            acts.append(ProfilerActivity.PrivateUse1)
        return acts

    def _action(self, n: int) -> ProfilerAction:
        s = n + self._offset
        if not self._steps:
            return ProfilerAction.RECORD
        if s in self._steps:
            return ProfilerAction.RECORD if (s + 1) in self._steps else ProfilerAction.RECORD_AND_SAVE
        if any((s + k) in self._steps for k in range(1, self._config.warmup + 1)):
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def _save(self, prof: torch.profiler.profile) -> None:
        out = Path(self._config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"rank{self._rank}_step{self._block_start}"
        if self._config.format == "chrome":
            path = out / (f"{stem}.json.gz" if self._opts["gzip"] else f"{stem}.json")
            prof.export_chrome_trace(os.fspath(path))
            self._traces.append(path)
            return
        before = set(out.glob(f"{stem}.*"))
        torch.profiler.tensorboard_trace_handler(
            os.fspath(out), worker_name=stem, use_gzip=bool(self._opts["gzip"])
        )(prof)
        self._traces.extend(sorted(set(out.glob(f"{stem}.*")) - before))

    def _on_start(self) -> None:
        self._offset = self._step
        self._prof = torch.profiler.profile(
            activities=self._activities(),
            schedule=self._action,
            on_trace_ready=self._save,
            record_shapes=self._config.record_shapes,
            profile_memory=self._config.with_memory,
            with_stack=self._config.with_stack,
            with_flops=bool(self._opts["with_flops"]),
            with_modules=bool(self._opts["with_modules"]),
        )
        self._prof.start()

    def _on_step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def _on_stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()

    def _enter_block(self) -> None:
        self._block_start = self._step

    def _open(self, name: str) -> AbstractContextManager[None]:
        return HookRange(_enter_record_function, _exit_record_function, name)
