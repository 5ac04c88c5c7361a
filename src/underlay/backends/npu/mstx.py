"""The ``mstx`` profiler: torch_npu's mstx ranges and ``torch_npu.profiler`` around the configured steps.

Written against torch_npu's documented API (``torch_npu.npu.mstx.range_start/range_end/mark``,
``torch_npu.profiler.profile``, ``_ExperimentalConfig(msprof_tx=True, ...)``,
``tensorboard_trace_handler``). ``torch_npu`` is imported only when this profiler is built.
"""

from __future__ import annotations

import importlib
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from underlay.backends._profiling import HookRange, ProfilerBase, check_options, require_device
from underlay.interfaces import BackendUnavailable, ConfigError, Device, ProfilerConfig

__all__ = ["MstxProfiler"]

_MSTX_OPTIONS: dict[str, Any] = {
    "profiler": True,
    "level": "",
    "aic_metrics": "",
    "analyse": True,
    "domain": "default",
    "step_marks": True,
}


def _import_torch_npu() -> Any:
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise BackendUnavailable(
            "profiler",
            "mstx",
            f"the Python package 'torch_npu' cannot be imported ({exc})",
            ["off", "torch"],
            "install it with `pip install underlay[npu]` on an Ascend host",
        ) from exc


class MstxProfiler(ProfilerBase):
    """Ascend NPU profiling through mstx ranges and ``torch_npu.profiler``.

    On enabled ranks, while a configured step runs, ``range(name)`` is
    ``torch_npu.npu.mstx.range_start(name, None)`` / ``range_end(id)`` (host-side ranges, in the mstx
    domain of option ``domain``). With option ``profiler`` (default ``True``) each run of consecutive
    configured steps is recorded by a ``torch_npu.profiler.profile`` (activities CPU and NPU,
    ``msprof_tx=True`` so that the mstx ranges are collected, ``profile_memory``/``with_stack``/
    ``record_shapes`` from the config) that writes through ``torch_npu.profiler.tensorboard_trace_handler``
    into ``config.output_dir/rank{r}_step{s}`` (``s``: first step of the run); the device is synchronised
    before each ``stop()``. With ``profiler=False`` only the mstx ranges are emitted, for an external
    ``msprof`` capture. ``config.warmup`` is not used.

    ``config.options``: ``profiler`` (bool); ``level`` (a ``torch_npu.profiler.ProfilerLevel`` member
    name such as ``"Level1"``; ``""``, the default, keeps torch_npu's); ``aic_metrics`` (a
    ``torch_npu.profiler.AiCMetrics`` member name such as ``"PipeUtilization"``; ``""`` keeps
    torch_npu's); ``analyse`` (bool, default ``True``: parse the raw data when a run ends; ``False``
    needs a torch_npu whose ``tensorboard_trace_handler`` takes ``analyse_flag``); ``domain`` (mstx
    domain, default ``"default"``; another needs a torch_npu whose mstx calls take ``domain``);
    ``step_marks`` (bool: an mstx mark ``"step {n}"`` at each recorded step).

    Raises ``BackendUnavailable`` when torch_npu cannot be imported, ``IncompatibleBackends`` when
    ``device`` is not the npu device and ``ConfigError`` for a bad option.
    """

    _NAME = "mstx"

    def __init__(self, config: ProfilerConfig, device: Device) -> None:
        self._npu = _import_torch_npu()
        require_device("mstx", device, "npu", "UNDERLAY_PROFILER=torch (any device) or nvtx (cuda)")
        super().__init__(config, device)
        self._opts = check_options("mstx", config.options, _MSTX_OPTIONS)
        prof_mod = self._npu.profiler
        for key, enum in (("level", "ProfilerLevel"), ("aic_metrics", "AiCMetrics")):
            value = self._opts[key]
            if value and not hasattr(getattr(prof_mod, enum), value):
                raise ConfigError(
                    f"ProfilerConfig.options[{key!r}]={value!r} for the 'mstx' profiler: use a member name "
                    f"of torch_npu.profiler.{enum} (e.g. 'Level1' or 'PipeUtilization'), or '' for "
                    "torch_npu's default"
                )
        self._mstx = self._npu.npu.mstx
        # older torch_npu releases take no ``domain`` argument: pass it only when it is not the default
        domain = self._opts["domain"]
        self._kw: dict[str, str] = {} if domain == "default" else {"domain": domain}
        self._prof: Any = None
        self._traces: list[Path] = []

    @property
    def traces(self) -> list[Path]:
        """Output directories written so far (one per recorded run of steps)."""
        return list(self._traces)

    def _new_profile(self) -> Any:
        p = self._npu.profiler
        chosen: dict[str, Any] = {"msprof_tx": True}
        if self._opts["level"]:
            chosen["profiler_level"] = getattr(p.ProfilerLevel, self._opts["level"])
        if self._opts["aic_metrics"]:
            chosen["aic_metrics"] = getattr(p.AiCMetrics, self._opts["aic_metrics"])
        experimental = p._ExperimentalConfig(**chosen)
        out = Path(self._config.output_dir) / f"rank{self._rank}_step{self._step}"
        # ``analyse_flag`` exists only in newer torch_npu releases: pass it only to turn parsing off
        handler_kw = {} if self._opts["analyse"] else {"analyse_flag": False}
        self._traces.append(out)
        return p.profile(
            activities=[p.ProfilerActivity.CPU, p.ProfilerActivity.NPU],
            on_trace_ready=p.tensorboard_trace_handler(os.fspath(out), f"rank{self._rank}", **handler_kw),
            record_shapes=self._config.record_shapes,
            profile_memory=self._config.with_memory,
            with_stack=self._config.with_stack,
            experimental_config=experimental,
        )

    def _enter_block(self) -> None:
        if self._opts["profiler"]:
            self._prof = self._new_profile()
            self._prof.start()

    def _on_record_step(self) -> None:
        if self._opts["step_marks"]:
            self._mstx.mark(f"step {self._step}", **self._kw)

    def _leave_block(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            self._device.synchronize()
            prof.stop()

    def _range_start(self, name: str) -> int:
        return int(self._mstx.range_start(name, None, **self._kw))

    def _range_end(self, range_id: int) -> None:
        self._mstx.range_end(range_id, **self._kw)

    def _open(self, name: str) -> AbstractContextManager[None]:
        return HookRange(self._range_start, self._range_end, name)
