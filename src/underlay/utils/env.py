"""Every ``UNDERLAY_*`` environment variable underlay reads, in one table.

The code reads these variables through :func:`get` (at the moment of use, never frozen at import), and
``underlay info`` prints :func:`describe` (name, current value, default, meaning). A test greps ``src/``
for ``UNDERLAY_`` names and checks that each one is in :data:`ENV_VARS`, so a new variable cannot be
read without being documented here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from underlay.interfaces import ConfigError

__all__ = ["ENV_VARS", "EnvVar", "describe", "get"]


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its ``name``, accepted ``values`` (a human-readable summary), the
    ``default`` that applies when it is unset or empty, and what it ``means``."""

    name: str
    values: str
    default: str
    means: str


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("UNDERLAY_DEVICE", "auto, cpu, cuda, npu, plugin names", "auto", "the Device backend"),
        EnvVar("UNDERLAY_ENGINE", "fsdp2, mcore", "fsdp2", "the ParallelEngine and its WeightLoader"),
        EnvVar(
            "UNDERLAY_MCORE_CPU_FIXTURE",
            "1 (tests only)",
            "unset",
            "set by tests/mcore/_cpu_fixture.py: lets the mcore probe accept the CPU under that fixture",
        ),
        EnvVar(
            "UNDERLAY_CACHE",
            "a directory",
            "~/.cache/underlay/files",
            "where underlay.data.files.copy_to_local keeps local copies of remote files",
        ),
        EnvVar(
            "UNDERLAY_ATTENTION",
            "auto, fa4, flash_attn, npu, torch, eager",
            "auto",
            "the AttentionKernel (auto: the fastest that supports the case)",
        ),
        EnvVar(
            "UNDERLAY_LOGPROB_KERNEL",
            "auto, triton, torch",
            "auto",
            "fused hidden -> log-prob (+ entropy) kernel",
        ),
        EnvVar("UNDERLAY_QUANT", "auto, triton, torch", "auto", "blockwise FP8 weight quantiser"),
        EnvVar("UNDERLAY_PROFILER", "off, torch, nvtx, mstx", "off", "the Profiler backend"),
        EnvVar(
            "UNDERLAY_PLUGINS",
            "comma-separated entry-point names, or *",
            "",
            "which third-party backend packages (entry-point group underlay.backends) load",
        ),
        EnvVar(
            "UNDERLAY_PEAK_TFLOPS",
            "a number",
            "",
            "peak TFLOP/s used for MFU (unset: the device table, or a measured matmul rate on cpu)",
        ),
        EnvVar(
            "UNDERLAY_COMPILE_BACKEND",
            "a torch.compile backend",
            "inductor",
            "backend of the fsdp2 engine option compile",
        ),
        EnvVar(
            "UNDERLAY_LOG_LEVEL",
            "DEBUG, INFO, WARNING, ERROR or a number",
            "INFO",
            "level of underlay.utils.logging.setup_logging when no level is passed",
        ),
    )
}
"""The table, keyed by name."""


def get(name: str) -> str:
    """The current value of the registered variable ``name`` (stripped), or its default when unset or
    empty. Raises ``ConfigError`` for a name not in :data:`ENV_VARS` (register it there first)."""
    var = ENV_VARS.get(name)
    if var is None:
        raise ConfigError(f"{name} is not a registered underlay environment variable; add it to ENV_VARS")
    raw = os.environ.get(name, "").strip()
    return raw or var.default


def describe() -> list[dict[str, str | None]]:
    """One row per variable: ``name``, ``value`` (the raw current value, ``None`` when unset),
    ``default``, ``values`` and ``means``; in table order."""
    return [
        {
            "name": v.name,
            "value": os.environ.get(v.name),
            "default": v.default,
            "values": v.values,
            "means": v.means,
        }
        for v in ENV_VARS.values()
    ]
