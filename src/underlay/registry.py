"""Backend registry and factories.

Each backend is a :class:`BackendSpec`: a kind, a name, a priority, a description, a cheap
side-effect-free probe and a lazy ``"module:attr"`` target that is imported only once the backend is
selected. Selection for a kind follows, in order: an explicit argument, an :func:`override` context,
the kind's environment variable, else ``auto`` (the highest-priority backend whose probe passes and that
works with the selected device). An explicit argument that differs from the environment raises
``ConfigError``; a named backend that cannot run raises ``BackendUnavailable`` with the probe's reason
and what is available. Nothing falls back silently. The choice is made once per process and cached;
:func:`reset` clears it (tests).

Third-party backends: a distribution declares an entry point in the group ``underlay.backends`` whose
object is a callable returning an iterable of ``BackendSpec`` (or the iterable itself). Only plugins
named in ``UNDERLAY_PLUGINS`` (comma-separated entry-point names, ``*`` for all) are loaded.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from underlay.interfaces import (
    AttentionKernel,
    AttentionSpec,
    BackendKind,
    BackendUnavailable,
    ConfigError,
    Device,
    EngineConfig,
    EngineOptions,
    Fp8Quantizer,
    IncompatibleBackends,
    LogprobKernel,
    ParallelEngine,
    PluginError,
    ProbeResult,
    Profiler,
    ProfilerConfig,
    UnknownBackend,
    WeightLoader,
    describe_options,
)
from underlay.utils import env as _env

__all__ = [
    "ENV_VARS",
    "KINDS",
    "BackendSpec",
    "Selection",
    "backends",
    "engine_options",
    "get_attention",
    "get_device",
    "get_engine",
    "get_logprob_kernel",
    "get_profiler",
    "get_quantizer",
    "get_weight_loader",
    "info",
    "override",
    "probe",
    "register",
    "reset",
    "resolve",
]

log = logging.getLogger("underlay.registry")

KINDS: tuple[BackendKind, ...] = (
    "device",
    "engine",
    "attention",
    "logprob",
    "quant",
    "profiler",
    "weight_loader",
)

ENV_VARS: dict[str, str] = {
    "device": "UNDERLAY_DEVICE",
    "engine": "UNDERLAY_ENGINE",
    "attention": "UNDERLAY_ATTENTION",
    "logprob": "UNDERLAY_LOGPROB_KERNEL",
    "quant": "UNDERLAY_QUANT",
    "profiler": "UNDERLAY_PROFILER",
}
"""Environment variable per kind. The weight loader follows the engine and has none."""

_DEFAULT_WHEN_UNSET: dict[str, str] = {"profiler": "off", "engine": "fsdp2"}
PLUGIN_GROUP = "underlay.backends"
PLUGIN_ENV = "UNDERLAY_PLUGINS"


def _always_available() -> ProbeResult:
    return ProbeResult.ok()


@dataclass(frozen=True)
class BackendSpec:
    """One registered backend.

    ``target`` is ``"package.module:attr"``; the attribute is a class or factory called as
    ``factory()`` for devices, ``factory(device)`` for attention, logprob and weight-loader backends,
    ``factory(config, device)`` for profilers (a ``ProfilerConfig``) and engines (an
    ``EngineConfig``). ``devices`` names the device backends it works with (empty: any). ``priority``
    orders ``auto`` (highest first). ``probe`` must be cheap and free of side effects. ``options``
    (engines only) is ``"package.module:attr"`` of the engine's options dataclass (``EngineOptions``:
    the fields of ``EngineConfig.options`` plus ``supports_recompute``), in a module light enough to
    import for ``underlay info``.
    """

    kind: BackendKind
    name: str
    target: str
    priority: int = 0
    description: str = ""
    probe: Callable[[], ProbeResult] = _always_available
    devices: tuple[str, ...] = ()
    origin: str = "builtin"
    options: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"BackendSpec.kind={self.kind!r}: use one of {KINDS}")
        if not self.name or self.name == "auto" or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"BackendSpec.name={self.name!r}: a non-empty identifier other than 'auto'")
        if ":" not in self.target:
            raise ConfigError(f"BackendSpec.target={self.target!r}: use 'package.module:attribute'")

    def works_with(self, device: str) -> bool:
        """Whether this backend can run with the device backend named ``device``."""
        return not self.devices or device in self.devices


@dataclass(frozen=True)
class Selection:
    """How a kind was resolved: the chosen ``name``, where the choice came from and why."""

    kind: str
    name: str
    source: str  # "argument" | "override" | "environment" | "default" | "auto"
    reason: str = ""


# --------------------------------------------------------------------------------------------- probes


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _requires(module: str, extra: str) -> Callable[[], ProbeResult]:
    def probe() -> ProbeResult:
        if _has_module(module):
            return ProbeResult.ok()
        return ProbeResult.fail(
            f"the Python package {module!r} is not installed",
            f"install it with `pip install underlay[{extra}]`",
        )

    return probe


def _package_dir_with(package: str, relative: str) -> bool:
    """Whether an installed ``package`` (regular or namespace) holds the file ``relative``, found
    without importing it (``find_spec`` of a top-level name imports nothing)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    roots = (spec.submodule_search_locations or []) if spec is not None else []
    return any((Path(root) / relative).is_file() for root in roots)


def _probe_flash_attn2() -> ProbeResult:
    """flash-attn 2 proper: ``flash_attn/flash_attn_interface.py``. flash-attn-4 installs a bare
    ``flash_attn`` namespace (``flash_attn/cute``) that has none of flash-attn 2's functions."""
    if _package_dir_with("flash_attn", "flash_attn_interface.py"):
        return ProbeResult.ok()
    return ProbeResult.fail(
        "the Python package 'flash-attn' (2.x, flash_attn.flash_attn_interface) is not installed",
        "install it with `pip install flash-attn --no-build-isolation` on a CUDA host",
    )


def _probe_flex() -> ProbeResult:
    """This torch ships ``torch.nn.attention.flex_attention`` (torch >= 2.5)."""
    if _package_dir_with("torch", "nn/attention/flex_attention.py"):
        return ProbeResult.ok()
    return ProbeResult.fail(
        f"torch {torch.__version__} has no torch.nn.attention.flex_attention",
        "install torch >= 2.5 for the flex attention kernel",
    )


def _probe_fa4() -> ProbeResult:
    """flash-attn-4 installed (``flash_attn/cute/interface.py``) and a torch whose flash-attention
    kernels can be replaced (``torch/nn/attention/_registry.py``: ``register_flash_attention_impl``).
    The compute capability is checked when the kernel is built."""
    if not _package_dir_with("flash_attn", "cute/interface.py"):
        return ProbeResult.fail(
            "the Python package 'flash-attn-4' (flash_attn.cute) is not installed",
            "install it with `pip install underlay[fa4]` on a CUDA host",
        )
    if not _package_dir_with("torch", "nn/attention/_registry.py"):
        return ProbeResult.fail(
            f"torch {torch.__version__} cannot replace its flash-attention kernels "
            "(no torch.nn.attention.register_flash_attention_impl)",
            "use a torch that has torch.nn.attention.register_flash_attention_impl",
        )
    return ProbeResult.ok()


def _current_accelerator() -> str | None:
    acc = getattr(torch, "accelerator", None)
    if acc is None:  # torch < 2.6
        return None
    try:
        if not acc.is_available():
            return None
        cur = acc.current_accelerator()
    except RuntimeError:
        return None
    return None if cur is None else str(cur.type)


def _probe_cuda() -> ProbeResult:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return ProbeResult.fail(
            f"this torch build ({torch.__version__}) has no CUDA support",
            "install a CUDA build of torch (`pip install torch` on a GPU host)",
        )
    if _current_accelerator() != "cuda":
        return ProbeResult.fail("no CUDA device is visible", "check `nvidia-smi` and CUDA_VISIBLE_DEVICES")
    return ProbeResult.ok()


def _probe_mcore() -> ProbeResult:
    """megatron-core importable and an accelerator present (megatron calls CUDA directly)."""
    if not _has_module("megatron.core"):
        return ProbeResult.fail(
            "the Python package 'megatron-core' is not installed",
            "install it with `pip install underlay[mcore]`",
        )
    # UNDERLAY_MCORE_CPU_FIXTURE=1 is set only by the test fixture tests/mcore/_cpu_fixture.py, which
    # maps megatron's CUDA calls to the CPU in its own processes (the engine checks the same variable)
    if _current_accelerator() is None and not _env.get_bool("UNDERLAY_MCORE_CPU_FIXTURE"):
        return ProbeResult.fail(
            "megatron-core calls CUDA directly and needs an accelerator device; none is available",
            "use UNDERLAY_ENGINE=fsdp2 on the CPU (tests run mcore on the CPU only under the test-only "
            "fixture tests/mcore/_cpu_fixture.py, constructing MCoreEngine directly)",
        )
    return ProbeResult.ok()


def _probe_npu() -> ProbeResult:
    if not _has_module("torch_npu"):
        return ProbeResult.fail(
            "the Python package 'torch_npu' is not installed", "install it with `pip install underlay[npu]`"
        )
    if _current_accelerator() == "cuda":
        return ProbeResult.fail("this process already has CUDA; one accelerator family per process")
    return ProbeResult.ok()


def _all(*probes: Callable[[], ProbeResult]) -> Callable[[], ProbeResult]:
    def probe() -> ProbeResult:
        for p in probes:
            r = p()
            if not r.available:
                return r
        return ProbeResult.ok()

    return probe


def _builtin_specs() -> list[BackendSpec]:
    b = "underlay.backends"
    return [
        BackendSpec(
            "device",
            "cuda",
            f"{b}.cuda.device:CudaDevice",
            20,
            "NVIDIA/AMD GPU through torch.cuda",
            _probe_cuda,
        ),
        BackendSpec(
            "device",
            "npu",
            f"{b}.npu.device:NpuDevice",
            10,
            "Huawei Ascend NPU through torch_npu",
            _probe_npu,
        ),
        BackendSpec("device", "cpu", f"{b}.cpu.device:CpuDevice", 0, "host CPU (gloo; always available)"),
        BackendSpec(
            "attention",
            "fa4",
            f"{b}.portable.fa4_attention:FA4Attention",
            40,
            "FlashAttention-4 (flash-attn-4) behind torch's varlen_attn; compute capability 9.x/10.x",
            _all(_probe_cuda, _probe_fa4),
            ("cuda",),
        ),
        BackendSpec(
            "attention",
            "flash_attn",
            f"{b}.cuda.flash_attention:FlashAttnKernel",
            30,
            "flash-attn 2/3 varlen and padded kernels",
            _probe_flash_attn2,
            ("cuda",),
        ),
        BackendSpec(
            "attention",
            "npu",
            f"{b}.npu.attention:NpuFusionAttention",
            30,
            "torch_npu.npu_fusion_attention (TND layout for packed input)",
            _probe_npu,
            ("npu",),
        ),
        BackendSpec(
            "attention",
            "torch",
            f"{b}.portable.attention:TorchAttention",
            20,
            "torch varlen_attn / SDPA / per-sequence SDPA",
            devices=("cuda", "cpu"),
        ),
        BackendSpec(
            "attention",
            "flex",
            f"{b}.portable.flex_attention:FlexAttention",
            # below the varlen kernels (which run the cases they support faster), above eager: auto
            # picks it for what only eager ran on cuda before (softcaps: Gemma 2)
            10,
            "torch flex_attention (compiled, block masks): softcap and windows in O(T) memory",
            _probe_flex,
            ("cuda",),
        ),
        BackendSpec(
            "attention",
            "eager",
            f"{b}.portable.attention:EagerAttention",
            0,
            "plain fp32 reference on any device",
        ),
        BackendSpec(
            "logprob",
            "triton",
            f"{b}.cuda.logprob:TritonLogprobKernel",
            20,
            "fused Triton linear -> log-prob + entropy",
            _all(_probe_cuda, _requires("triton", "cuda")),
            ("cuda",),
        ),
        BackendSpec(
            "logprob",
            "torch",
            f"{b}.portable.logprob:TorchLogprobKernel",
            0,
            "chunked torch linear -> log-prob",
        ),
        BackendSpec(
            "quant",
            "triton",
            f"{b}.cuda.fp8:TritonFp8Quantizer",
            20,
            "Triton blockwise e4m3 quantiser",
            _all(_probe_cuda, _requires("triton", "cuda")),
            ("cuda",),
        ),
        BackendSpec(
            "quant", "torch", f"{b}.portable.quant:TorchFp8Quantizer", 0, "torch blockwise e4m3 quantiser"
        ),
        BackendSpec(
            "profiler", "off", f"{b}.portable.profiler:OffProfiler", 0, "records nothing; near-zero cost"
        ),
        BackendSpec(
            "profiler", "torch", f"{b}.portable.profiler:TorchProfiler", 10, "torch.profiler traces per rank"
        ),
        BackendSpec(
            "profiler",
            "nvtx",
            f"{b}.cuda.nvtx:NvtxProfiler",
            10,
            "NVTX ranges for Nsight Systems",
            _probe_cuda,
            ("cuda",),
        ),
        BackendSpec(
            "profiler",
            "mstx",
            f"{b}.npu.mstx:MstxProfiler",
            10,
            "torch_npu mstx ranges and profiler",
            _probe_npu,
            ("npu",),
        ),
        BackendSpec(
            "engine",
            "fsdp2",
            "underlay.engines.fsdp2.engine:FSDP2Engine",
            10,
            "PyTorch FSDP2 (fully_shard), HSDP, Ulysses SP",
            options="underlay.engines.fsdp2.options:FSDP2Options",
        ),
        BackendSpec(
            "weight_loader",
            "fsdp2",
            "underlay.engines.fsdp2.weights:FSDP2WeightLoader",
            10,
            "HF safetensors <-> FSDP2 shards",
        ),
        BackendSpec(
            "engine",
            "mcore",
            "underlay.engines.mcore.engine:MCoreEngine",
            0,
            "Megatron-Core GPTModel: TP, PP, DP, sequence parallel; distributed optimizer",
            _probe_mcore,
            options="underlay.engines.mcore.options:MCoreOptions",
        ),
        BackendSpec(
            "weight_loader",
            "mcore",
            "underlay.engines.mcore.weights:MCoreWeightLoader",
            0,
            "HF safetensors <-> Megatron-Core TP/PP shards",
            _probe_mcore,
        ),
    ]


# ------------------------------------------------------------------------------------------- state


@dataclass
class _State:
    specs: dict[str, dict[str, BackendSpec]] = field(default_factory=dict)
    plugins_loaded: bool = False
    plugin_error: PluginError | None = None
    selections: dict[tuple[str, str | None, str], Selection] = field(default_factory=dict)
    instances: dict[tuple[str, str], Any] = field(default_factory=dict)
    overrides: list[dict[str, str]] = field(default_factory=list)
    probes: dict[tuple[str, str], ProbeResult] = field(default_factory=dict)
    extra: list[BackendSpec] = field(default_factory=list)


_lock = threading.RLock()
_state = _State()


def reset() -> None:
    """Forget every selection, instance, probe result and loaded plugin (keeps ``register``-ed specs)."""
    with _lock:
        extra = list(_state.extra)
        overrides = list(_state.overrides)
        _state.__init__()  # type: ignore[misc]
        _state.extra, _state.overrides = extra, overrides


def register(spec: BackendSpec, *, replace: bool = False) -> None:
    """Add a backend in-process (plugins use entry points instead). A name clash raises ``ConfigError``
    unless ``replace``."""
    with _lock:
        table = _specs().setdefault(spec.kind, {})
        if spec.name in table and not replace:
            raise ConfigError(
                f"{spec.kind} backend {spec.name!r} is already registered (from {table[spec.name].origin}); "
                "pass replace=True to shadow it"
            )
        table[spec.name] = spec
        _state.extra = [s for s in _state.extra if (s.kind, s.name) != (spec.kind, spec.name)] + [spec]
        _state.selections.clear()
        _state.instances.pop((spec.kind, spec.name), None)


def _specs() -> dict[str, dict[str, BackendSpec]]:
    if not _state.specs:
        for s in _builtin_specs():
            _state.specs.setdefault(s.kind, {})[s.name] = s
        for s in _state.extra:
            _state.specs.setdefault(s.kind, {})[s.name] = s
    if _state.plugin_error is not None:
        # a broken plugin fails every call, not only the first (until reset() after fixing it)
        raise _state.plugin_error
    if not _state.plugins_loaded:
        try:
            loaded = _load_plugins()
            seen = {kind: dict(table) for kind, table in _state.specs.items()}
            for s in loaded:
                table = seen.setdefault(s.kind, {})
                if s.name in table:
                    raise PluginError(
                        f"plugin {s.origin!r} registers {s.kind} backend {s.name!r}, which "
                        f"{table[s.name].origin} already provides; rename the plugin's backend"
                    )
                table[s.name] = s
        except PluginError as exc:
            _state.plugin_error = exc
            raise
        for s in loaded:
            _state.specs.setdefault(s.kind, {})[s.name] = s
        _state.plugins_loaded = True
    return _state.specs


def _allowed_plugins() -> set[str] | None:
    raw = _env.get(PLUGIN_ENV)
    if not raw:
        return set()
    if raw in ("*", "all"):
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def _load_plugins() -> list[BackendSpec]:
    allowed = _allowed_plugins()
    if allowed == set():
        return []
    eps = list(importlib.metadata.entry_points(group=PLUGIN_GROUP))
    found = {ep.name for ep in eps}
    if allowed is not None and (missing := sorted(allowed - found)):
        raise PluginError(
            f"{PLUGIN_ENV} names plugin(s) {missing} but no installed distribution declares them in the "
            f"entry-point group {PLUGIN_GROUP!r}; installed plugins: {sorted(found) or '(none)'}"
        )
    out: list[BackendSpec] = []
    for ep in eps:
        if allowed is not None and ep.name not in allowed:
            continue
        try:
            obj = ep.load()
            specs = obj() if callable(obj) else obj
            specs = list(cast(Iterable[BackendSpec], specs))
        except Exception as exc:
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}. "
                f"Fix or uninstall it, or drop it from {PLUGIN_ENV}"
            ) from exc
        for s in specs:
            if not isinstance(s, BackendSpec):
                raise PluginError(
                    f"plugin {ep.name!r} returned {type(s).__name__}, expected underlay.registry.BackendSpec"
                )
            out.append(
                BackendSpec(s.kind, s.name, s.target, s.priority, s.description, s.probe, s.devices, ep.name)
            )
    return out


def backends(kind: str) -> list[BackendSpec]:
    """Registered backends of ``kind``, highest priority first."""
    if kind not in KINDS:
        raise ConfigError(f"unknown backend kind {kind!r}; kinds: {', '.join(KINDS)}")
    with _lock:
        return sorted(_specs().get(kind, {}).values(), key=lambda s: (-s.priority, s.name))


def _spec(kind: str, name: str) -> BackendSpec:
    table = _specs().get(kind, {})
    if name not in table:
        raise UnknownBackend(kind, name, [s.name for s in backends(kind)])
    return table[name]


def probe(kind: str, name: str) -> ProbeResult:
    """The (cached) probe result of one backend. Raises ``UnknownBackend`` for an unknown name."""
    with _lock:
        spec = _spec(kind, name)
        key = (kind, name)
        if key not in _state.probes:
            try:
                _state.probes[key] = spec.probe()
            except Exception as exc:  # a broken probe is a reason, not a crash
                _state.probes[key] = ProbeResult.fail(f"probe raised {type(exc).__name__}: {exc}")
        return _state.probes[key]


def _available(kind: str, device: str | None) -> list[str]:
    return [
        s.name
        for s in backends(kind)
        if probe(kind, s.name).available and (device is None or s.works_with(device))
    ]


# --------------------------------------------------------------------------------------- resolution


@contextmanager
def override(**names: str) -> Iterator[None]:
    """Select backends for the duration of a ``with`` block, like setting their environment variables
    (``override(device="cpu", attention="eager")``). Clears cached selections on entry and exit."""
    bad = sorted(set(names) - set(KINDS))
    if bad:
        raise ConfigError(f"override: unknown kinds {bad}; kinds: {', '.join(KINDS)}")
    with _lock:
        _state.overrides.append(dict(names))
        _clear_selected()
    try:
        yield
    finally:
        with _lock:
            _state.overrides.pop()
            _clear_selected()


def _clear_selected() -> None:
    _state.selections.clear()
    _state.instances.clear()


def _requested(kind: str) -> tuple[str | None, str]:
    for layer in reversed(_state.overrides):
        if kind in layer:
            return layer[kind], "override"
    env = ENV_VARS.get(kind)
    if env:
        value = _env.get_optional(env)
        if value:
            return value, "environment"
    return None, ""


def resolve(kind: str, name: str | None = None, *, spec: AttentionSpec | None = None) -> Selection:
    """Decide which backend of ``kind`` to use, without building it.

    Raises ``UnknownBackend``, ``BackendUnavailable``, ``IncompatibleBackends`` or ``ConfigError``
    (an explicit ``name`` that contradicts the environment/override).
    """
    with _lock:
        if kind not in KINDS:
            raise ConfigError(f"unknown backend kind {kind!r}; kinds: {', '.join(KINDS)}")
        requested, source = _requested(kind)
        # DESIGN.md: an explicit argument beats the environment, and when both are given and differ
        # it is an error; an explicit "auto" differs from UNDERLAY_DEVICE=npu too
        if name is not None and requested not in (None, "auto") and requested != name:
            env = ENV_VARS.get(kind, kind)
            raise ConfigError(
                f"{kind} backend requested as {name!r} by argument but {requested!r} by {source} ({env}); "
                f"remove one of them or make them agree"
            )
        if name is not None:
            requested, source = name, "argument"
        if requested is None and kind in _DEFAULT_WHEN_UNSET:
            requested, source = _DEFAULT_WHEN_UNSET[kind], "default"
        if kind == "weight_loader" and requested is None:
            requested, source = resolve("engine").name, "engine"
        key = (kind, requested, repr(spec))
        if key in _state.selections:
            return _state.selections[key]
        device = None if kind == "device" else resolve("device").name
        if requested in (None, "auto"):
            sel = _auto(kind, device, spec)
        else:
            sel = _explicit(kind, requested, source, device)
        _state.selections[key] = sel
        return sel


def _explicit(kind: str, name: str, source: str, device: str | None) -> Selection:
    spec = _spec(kind, name)
    result = probe(kind, name)
    if not result.available:
        raise BackendUnavailable(kind, name, result.reason, _available(kind, device), result.hint)
    if device is not None and not spec.works_with(device):
        raise IncompatibleBackends(
            f"{kind} backend {name!r} works only with device(s) {list(spec.devices)}, but the selected device "
            f"is {device!r}; set UNDERLAY_DEVICE to one of them or pick another {kind} backend "
            f"(usable with {device!r}: {', '.join(_available(kind, device)) or '(none)'})"
        )
    return Selection(kind, name, source, f"requested by {source}")


def _auto(kind: str, device: str | None, attn: AttentionSpec | None) -> Selection:
    skipped: list[str] = []
    for spec in backends(kind):
        result = probe(kind, spec.name)
        if not result.available:
            skipped.append(f"{spec.name}: {result.reason}")
            continue
        if device is not None and not spec.works_with(device):
            skipped.append(f"{spec.name}: needs device {list(spec.devices)}")
            continue
        if kind in ("device", "attention"):
            # Building is the deeper check (an extension that fails to import, no visible hardware,
            # a kernel for other GPU generations); attention kernels are cheap to build.
            try:
                built = _build(kind, spec.name, None)
            except BackendUnavailable as exc:
                skipped.append(f"{spec.name}: {exc.reason}")
                continue
            if attn is not None and (reasons := built.supports(attn)):
                skipped.append(f"{spec.name}: {'; '.join(reasons)}")
                continue
        why = f"highest priority available ({spec.priority})" + (f"; skipped {skipped}" if skipped else "")
        log.info("underlay: auto-selected %s backend %r: %s", kind, spec.name, why)
        return Selection(kind, spec.name, "auto", why)
    raise BackendUnavailable(kind, "auto", "no registered backend can run here: " + "; ".join(skipped), [])


def _build(kind: str, name: str, *args: Any) -> Any:
    """Import the backend's target and instantiate it (cached for stateless kinds)."""
    key = (kind, name)
    cacheable = kind in ("device", "attention", "logprob", "quant", "weight_loader")
    if cacheable and key in _state.instances:
        return _state.instances[key]
    spec = _spec(kind, name)
    module_name, _, attr = spec.target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:
        where = "plugin " + repr(spec.origin) if spec.origin != "builtin" else "underlay"
        raise BackendUnavailable(
            kind,
            name,
            f"importing {spec.target} from {where} failed: {type(exc).__name__}: {exc}",
            [n for n in _available(kind, None if kind == "device" else resolve("device").name) if n != name],
        ) from exc
    try:
        if kind == "device":
            obj = factory()
        elif kind in ("attention", "logprob", "quant", "weight_loader"):
            obj = factory(get_device())
        else:
            obj = factory(*args)
    except BackendUnavailable as exc:
        if exc.available or kind == "device":
            raise
        # a backend's constructor does not know its alternatives: name them here
        others = [n for n in _available(kind, resolve("device").name) if n != name]
        raise BackendUnavailable(exc.kind, exc.name, exc.reason, others, exc.hint) from exc
    if cacheable:
        _state.instances[key] = obj
    return obj


# ---------------------------------------------------------------------------------------- factories


def get_device(name: str | None = None) -> Device:
    """The device backend (``UNDERLAY_DEVICE=auto|cpu|cuda|npu``), cached per process."""
    with _lock:
        return cast(Device, _build("device", resolve("device", name).name))


def get_attention(name: str | None = None, *, spec: AttentionSpec | None = None) -> AttentionKernel:
    """The attention kernel (``UNDERLAY_ATTENTION``). With ``auto`` and a ``spec``, the highest-priority
    kernel whose ``supports(spec)`` is empty; an explicit kernel that cannot run ``spec`` raises
    ``BackendUnavailable`` with its reasons."""
    with _lock:
        sel = resolve("attention", name, spec=spec)
        kernel = cast(AttentionKernel, _build("attention", sel.name))
        if spec is not None and sel.source != "auto" and (reasons := kernel.supports(spec)):
            raise BackendUnavailable(
                "attention",
                sel.name,
                f"it cannot run {spec}: {'; '.join(reasons)}",
                _available("attention", resolve("device").name),
            )
        return kernel


def get_logprob_kernel(name: str | None = None) -> LogprobKernel:
    """The fused linear -> log-prob kernel (``UNDERLAY_LOGPROB_KERNEL``): triton on cuda, torch elsewhere."""
    with _lock:
        return cast(LogprobKernel, _build("logprob", resolve("logprob", name).name))


def get_quantizer(name: str | None = None) -> Fp8Quantizer:
    """The blockwise FP8 quantiser (``UNDERLAY_QUANT``): triton on cuda, torch elsewhere."""
    with _lock:
        return cast(Fp8Quantizer, _build("quant", resolve("quant", name).name))


def get_profiler(
    config: ProfilerConfig | Mapping[str, Any] | None = None, name: str | None = None
) -> Profiler:
    """A new profiler (``UNDERLAY_PROFILER=off|torch|nvtx|mstx``, default ``off``) for ``config``."""
    cfg = config if isinstance(config, ProfilerConfig) else ProfilerConfig.load(config or {})
    with _lock:
        sel = resolve("profiler", name)
        return cast(Profiler, _build("profiler", sel.name, cfg, get_device()))


def get_engine(config: EngineConfig, name: str | None = None) -> ParallelEngine:
    """Build a parallel engine (``UNDERLAY_ENGINE``, default ``fsdp2``) for ``config`` on the selected
    device. Collective when a process group is initialised."""
    with _lock:
        sel = resolve("engine", name)
        device = get_device()
    return cast(ParallelEngine, _build("engine", sel.name, config, device))


def engine_options(name: str) -> type[EngineOptions] | None:
    """The options dataclass of engine ``name`` (``None`` when it declares none). Imports only the
    module named by its ``BackendSpec.options``. ``UnknownBackend`` for an unregistered engine,
    ``BackendUnavailable`` when that module does not import."""
    spec = _spec("engine", name)
    if not spec.options:
        return None
    module_name, _, attr = spec.options.partition(":")
    try:
        return cast("type[EngineOptions]", getattr(importlib.import_module(module_name), attr))
    except Exception as exc:
        raise BackendUnavailable(
            "engine", name, f"importing its options {spec.options} failed: {type(exc).__name__}: {exc}", []
        ) from exc


def _options_info(name: str) -> dict[str, Any]:
    """``underlay info``'s view of an engine's options and recompute policies."""
    try:
        cls = engine_options(name)
    except BackendUnavailable as exc:
        return {"options": [], "recompute": {}, "options_error": str(exc)}
    if cls is None:
        return {"options": [], "recompute": {}}
    policies: dict[str, str] = {}
    for policy in ("auto", "none", "full", "selective"):
        probe_result = cls.supports_recompute(policy)
        policies[policy] = "yes" if probe_result.available else f"no: {probe_result.reason}"
    out: dict[str, Any] = {"options": [o.__dict__ for o in describe_options(cls)], "recompute": policies}
    auto = getattr(cls, "auto_defaults", None)
    if callable(auto):  # optional: what the engine's auto options become per device family
        out["auto_defaults"] = {d: auto(d) for d in ("cuda", "npu", "cpu")}
    return out


def get_weight_loader(name: str | None = None) -> WeightLoader:
    """The weight loader of the selected engine (or ``name``)."""
    with _lock:
        return cast(WeightLoader, _build("weight_loader", resolve("weight_loader", name).name))


def info() -> dict[str, Any]:
    """Everything ``underlay info`` prints: versions, hardware, every ``UNDERLAY_*`` variable with its
    current value and meaning (``environment``, from :mod:`underlay.utils.env`), each backend with its
    probe and what ``auto`` picks. Selection errors are reported in the entries, not raised, except an invalid
    environment value, which raises (``UnknownBackend``/``BackendUnavailable``)."""
    import platform
    import sys

    from underlay._version import __version__

    versions: dict[str, str | None] = {
        "underlay": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch.cuda": torch.version.cuda,
    }
    for pkg in ("transformers", "triton", "flash-attn", "megatron-core", "torch-npu", "safetensors", "peft"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    out: dict[str, Any] = {
        "versions": versions,
        "platform": platform.platform(),
        "accelerator": _current_accelerator(),
        "plugins_allowed": _env.get(PLUGIN_ENV),
        "environment": _env.describe(),
        "backends": {},
        "selected": {},
    }
    device_sel = resolve("device")
    dev = get_device()
    out["hardware"] = {
        "device": dev.name,
        "count": dev.device_count(),
        "model": dev.model_name(),
        "peak_bf16_tflops": (lambda p: None if p is None else p / 1e12)(dev.peak_flops(torch.bfloat16)),
    }
    out["selected"]["device"] = device_sel.__dict__
    for kind in KINDS:
        rows = []
        for s in backends(kind):
            p = probe(kind, s.name)
            rows.append(
                {
                    "name": s.name,
                    "available": p.available and s.works_with(dev.name),
                    "reason": p.reason
                    or ("" if s.works_with(dev.name) else f"needs device {list(s.devices)}"),
                    "hint": p.hint,
                    "priority": s.priority,
                    "description": s.description,
                    "origin": s.origin,
                    "devices": list(s.devices),
                    **(_options_info(s.name) if kind == "engine" else {}),
                }
            )
        out["backends"][kind] = rows
        if kind != "device":
            try:
                out["selected"][kind] = resolve(kind).__dict__
            except (BackendUnavailable, IncompatibleBackends, UnknownBackend) as exc:
                if ENV_VARS.get(kind) and _env.get_optional(ENV_VARS[kind]):
                    raise
                out["selected"][kind] = {"kind": kind, "name": None, "source": "error", "reason": str(exc)}
    return out
