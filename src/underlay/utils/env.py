"""Every environment variable underlay reads, in one table, and the only place that reads them.

:data:`ENV_VARS` declares each variable: its name, the values it takes, the default that applies when it
is unset or empty, what it means, and its ``owner``: ``"underlay"`` for the ``UNDERLAY_*`` variables this
library defines, else the program that defines the variable and that underlay follows (``"torchrun"``
for ``RANK``/``WORLD_SIZE``/..., ``"triton"``, ``"ray"``, ``"cuda"``, ``"wandb"``, ...).

The code reads them through the accessors here (:func:`get`, :func:`get_optional`, :func:`get_int`,
:func:`get_float`, :func:`get_bool`) at the moment of use, never frozen at import (except where the
program that owns the variable itself decides at import, e.g. Triton's interpreter), and
``underlay info`` prints :func:`describe`. An accessor asked for an undeclared name raises
``ConfigError``.

The rule, enforced by ``tests/unit/test_env_config_logging.py``: outside this module nothing in
``src/underlay`` reads ``os.environ`` or calls ``os.getenv``; each ``UNDERLAY_*`` name in ``src/`` is
declared here and each declared variable is read somewhere. Writing the environment is allowed where a
launcher prepares a process (``os.environ.update(...)``, ``os.environ.setdefault(...)`` as a statement,
``os.environ[name] = value``, ``os.environ.pop(...)``), because those set variables for the code and
libraries that read them, they do not decide anything in underlay.

Tuning switches that only a benchmark or a test needs are constructor options of the kernel or engine
(e.g. ``TritonLogprobKernel(device, mode=..., tma=...)``, ``TritonFp8Quantizer(device, autotune=...)``,
``TorchAttention(device, dense_uniform=...)`` given to an engine as ``ModelConfig.attention``),
not variables here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from underlay.interfaces import ConfigError

__all__ = [
    "ENV_VARS",
    "EnvVar",
    "describe",
    "get",
    "get_bool",
    "get_float",
    "get_int",
    "get_optional",
]


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its ``name``, accepted ``values`` (a human-readable summary), the
    ``default`` that applies when it is unset or empty (``""``: none, the reading code says what happens),
    what it ``means`` to underlay, and its ``owner`` (``"underlay"``, or the program that defines it)."""

    name: str
    values: str
    default: str
    means: str
    owner: str = "underlay"


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        # ---- underlay's own
        EnvVar("UNDERLAY_DEVICE", "auto, cpu, cuda, npu, plugin names", "auto", "the Device backend"),
        EnvVar("UNDERLAY_ENGINE", "fsdp2, mcore", "fsdp2", "the ParallelEngine and its WeightLoader"),
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
            "UNDERLAY_MCORE_CPU_FIXTURE",
            "1, 0 (tests only)",
            "0",
            "set by tests/mcore/_cpu_fixture.py: lets the mcore probe and engine accept the CPU under that "
            "fixture",
        ),
        EnvVar(
            "UNDERLAY_CACHE",
            "a directory",
            "~/.cache/underlay/files",
            "where underlay.data.files.copy_to_local keeps local copies of remote files",
        ),
        EnvVar(
            "UNDERLAY_PEAK_TFLOPS",
            "a number > 0",
            "",
            "peak TFLOP/s used for MFU (unset: the device table, or a measured matmul rate on cpu)",
        ),
        EnvVar(
            "UNDERLAY_COMPILE_BACKEND",
            "a torch.compile backend",
            "inductor",
            "backend of every graph an engine compiles (fsdp2 option compile, mcore fused_elementwise)",
        ),
        EnvVar(
            "UNDERLAY_LOG_LEVEL",
            "DEBUG, INFO, WARNING, ERROR or a number",
            "INFO",
            "level of underlay.parallel.logging.setup_logging when no level is passed (the CLI and the "
            "demo show warnings and up unless it is set)",
        ),
        # ---- defined by launchers and libraries underlay works with
        EnvVar(
            "RANK",
            "an integer >= 0",
            "0",
            "global rank of this process before the process group exists",
            "torchrun",
        ),
        EnvVar(
            "WORLD_SIZE", "an integer >= 1", "1", "number of processes to start the group with", "torchrun"
        ),
        EnvVar(
            "LOCAL_RANK",
            "an integer >= 0",
            "",
            "rank on this host: picks the local device (unset: RAY_LOCAL_RANK, else the rank when the "
            "world is 1, else 0)",
            "torchrun",
        ),
        EnvVar(
            "LOCAL_WORLD_SIZE",
            "an integer >= 1",
            "",
            "processes on this host: fsdp2's auto options treat the job as one node when it covers the "
            "world (unset: the ranks compare host names)",
            "torchrun",
        ),
        EnvVar(
            "MASTER_ADDR",
            "a host name or address",
            "127.0.0.1",
            "rendezvous host of init_distributed",
            "torchrun",
        ),
        EnvVar(
            "MASTER_PORT",
            "a TCP port",
            "",
            "rendezvous port of init_distributed (required when WORLD_SIZE > 1; else a free port)",
            "torchrun",
        ),
        EnvVar(
            "RAY_LOCAL_RANK",
            "an integer >= 0",
            "",
            "local rank under Ray when LOCAL_RANK is unset",
            "ray",
        ),
        EnvVar(
            "RAY_ADDRESS",
            "a Ray cluster address",
            "",
            "ensure_ray joins this cluster (and passes no resource sizes) instead of starting a local Ray",
            "ray",
        ),
        EnvVar(
            "TRITON_INTERPRET",
            "as Triton reads it: 1, true, on, yes (any case) interpret; anything else compiles",
            "0",
            "Triton kernels run in Triton's CPU interpreter (tests); the triton backends accept CPU tensors "
            "then; decided when the kernels are defined (at import)",
            "triton",
        ),
        EnvVar(
            "CUDA_VISIBLE_DEVICES",
            "comma-separated device indices",
            "",
            "which GPUs the cuda device sees (named in its out-of-range errors)",
            "cuda",
        ),
        EnvVar(
            "ASCEND_RT_VISIBLE_DEVICES",
            "comma-separated device indices",
            "",
            "which NPUs the npu device sees (named in its out-of-range errors)",
            "npu",
        ),
        EnvVar(
            "CUBLAS_WORKSPACE_CONFIG",
            ":4096:8 or :16:8",
            ":4096:8",
            "cuBLAS workspace; the demo sets this default in its ranks for deterministic cuBLAS (its resume "
            "check compares bit for bit)",
            "cuda",
        ),
        EnvVar(
            "WANDB_MODE",
            "online, offline, disabled",
            "offline",
            "mode of the wandb tracking backend (underlay's default is offline, not wandb's online)",
            "wandb",
        ),
        EnvVar(
            "MLFLOW_TRACKING_URI",
            "an MLflow tracking URI",
            "",
            "where the mlflow tracking backend logs (unset: a file store under the run's out_dir/mlruns)",
            "mlflow",
        ),
    )
}
"""The table, keyed by name."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _var(name: str) -> EnvVar:
    var = ENV_VARS.get(name)
    if var is None:
        raise ConfigError(
            f"{name} is not a declared environment variable; add it to underlay.utils.env.ENV_VARS"
        )
    return var


def get_optional(name: str) -> str | None:
    """The current value of the declared variable ``name``, stripped, or ``None`` when it is unset or
    empty (the table's default is not applied: the caller's own fallback is). Raises ``ConfigError``
    for a name not in :data:`ENV_VARS`."""
    _var(name)
    raw = os.environ.get(name, "").strip()
    return raw or None


def get(name: str) -> str:
    """The current value of the declared variable ``name`` (stripped), or its default when unset or
    empty (``""`` for a variable without one). Raises ``ConfigError`` for a name not in
    :data:`ENV_VARS`."""
    return get_optional(name) or _var(name).default


def _bad(name: str, raw: str, accepted: str) -> ConfigError:
    return ConfigError(f"environment variable {name}={raw!r} is not {accepted}; fix it or unset it")


def get_int(name: str, *, minimum: int | None = None) -> int | None:
    """:func:`get` parsed as an integer, or ``None`` when it is ``""`` (unset, no default). Raises
    ``ConfigError`` naming the variable, its value and what is accepted for a non-integer or a value
    below ``minimum``."""
    raw = get(name)
    if not raw:
        return None
    accepted = "an integer" if minimum is None else f"an integer >= {minimum}"
    try:
        value = int(raw)
    except ValueError as exc:
        raise _bad(name, raw, accepted) from exc
    if minimum is not None and value < minimum:
        raise _bad(name, raw, accepted)
    return value


def get_float(name: str, *, positive: bool = False) -> float | None:
    """:func:`get` parsed as a finite float, or ``None`` when it is ``""`` (unset, no default). Raises
    ``ConfigError`` naming the variable, its value and what is accepted for a non-number, an infinite
    or NaN value, or (``positive``) a value <= 0."""
    raw = get(name)
    if not raw:
        return None
    accepted = "a finite number > 0" if positive else "a finite number"
    try:
        value = float(raw)
    except ValueError as exc:
        raise _bad(name, raw, accepted) from exc
    if not math.isfinite(value) or (positive and value <= 0):
        raise _bad(name, raw, accepted)
    return value


def get_bool(name: str) -> bool:
    """:func:`get` as a switch: ``1/true/yes/on`` are ``True``, ``0/false/no/off`` ``False`` (any case).
    Raises ``ConfigError`` naming the variable, its value and the accepted values for anything else
    (including a declared variable without a default that is unset)."""
    raw = get(name)
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise _bad(name, raw, f"one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off)")


def describe() -> list[dict[str, str | None]]:
    """One row per variable: ``name``, ``value`` (the raw current value, ``None`` when unset),
    ``default``, ``values``, ``means`` and ``owner``; in table order (underlay's own first)."""
    return [
        {
            "name": v.name,
            "value": os.environ.get(v.name),
            "default": v.default,
            "values": v.values,
            "means": v.means,
            "owner": v.owner,
        }
        for v in ENV_VARS.values()
    ]
