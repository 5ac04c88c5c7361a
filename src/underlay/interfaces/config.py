"""Frozen configuration of an engine, shared by every ``ParallelEngine`` backend.

Each dataclass validates itself on construction (``ConfigError`` names the field and the fix) and loads
from plain dicts through ``from_dict`` (OmegaConf containers: pass ``OmegaConf.to_container(cfg)``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from underlay.interfaces.errors import ConfigError
from underlay.interfaces.kernels import AttentionKernel
from underlay.interfaces.types import RecomputePolicy

__all__ = [
    "EngineConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ProfilerConfig",
    "from_dict",
]

T = TypeVar("T")

_DTYPES = ("float32", "bfloat16", "float16")


def _int(owner: str, name: str, value: object, low: int, fix: str = "") -> None:
    """``ConfigError`` unless ``value`` is an int (a bool is not) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{owner}.{name}={value!r}: must be an int >= {low}{fix}")


def _real(
    owner: str, name: str, value: object, low: float, high: float, *, closed_high: bool = True
) -> float:
    """``ConfigError`` unless ``value`` is a finite real number (not a bool) in ``[low, high]``
    (``[low, high)`` when not ``closed_high``); returns it as a float."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    v = float(value) if ok else math.nan  # type: ignore[arg-type]
    inside = low <= v <= high if closed_high else low <= v < high
    if not (math.isfinite(v) and inside):
        bound = "]" if closed_high else ")"
        raise ConfigError(f"{owner}.{name}={value!r}: must be a finite number in [{low}, {high}{bound}")
    return v


def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
    """Build dataclass ``cls`` from a mapping, recursing into nested dataclass fields.

    Unknown keys raise ``ConfigError`` listing the valid ones (a typo never passes silently), as do a
    ``data`` that is not a mapping with str keys, a missing required key and a ``cls`` that is not a
    dataclass.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ConfigError(f"from_dict: {cls!r} is not a dataclass; pass a config class such as EngineConfig")
    if not isinstance(data, Mapping) or not all(isinstance(k, str) for k in data):
        raise ConfigError(
            f"from_dict({cls.__name__}): expected a mapping with str keys, got {type(data).__name__} "
            f"({data!r:.80}); OmegaConf containers: pass OmegaConf.to_container(cfg)"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown keys {unknown}; valid keys: {sorted(fields)}")
    missing = sorted(
        n
        for n, f in fields.items()
        if f.init
        and n not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    )
    if missing:
        raise ConfigError(f"{cls.__name__}: required keys {missing} are missing")
    kwargs: dict[str, Any] = {}
    hints = {name: f.type for name, f in fields.items()}
    for key, value in data.items():
        sub = _NESTED.get((cls.__name__, key))
        if sub is not None and isinstance(value, Mapping):
            value = from_dict(sub, value)
        elif isinstance(value, list) and "tuple" in str(hints[key]):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (through peft): only adapter weights train.

    ``target_modules``: module names to adapt, or ``"all-linear"`` (every linear layer except the
    output head, peft's rule). ``exclude_modules``: names (or a regex string) never adapted, even when
    ``target_modules`` matches them. ``adapter_path``: a peft adapter directory
    (``adapter_config.json`` + ``adapter_model.safetensors``, e.g. from ``export_adapters``) whose
    weights the adapters start from; its rank, alpha and targets must equal these (build the config
    with :meth:`from_adapter` to take them from the file). ``ConfigError`` for invalid values.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj", "o_proj")
    exclude_modules: tuple[str, ...] | str = ()
    adapter_path: str | None = None

    def __post_init__(self) -> None:
        _int("LoraConfig", "rank", self.rank, 1)
        _real("LoraConfig", "alpha", self.alpha, 0.0, math.inf, closed_high=False)
        _real("LoraConfig", "dropout", self.dropout, 0.0, 1.0, closed_high=False)
        for name in ("target_modules", "exclude_modules"):
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))
                v = getattr(self, name)
            if not isinstance(v, (str, tuple)) or (
                isinstance(v, tuple) and not all(isinstance(x, str) for x in v)
            ):
                raise ConfigError(f"LoraConfig.{name}={v!r}: give module names (a tuple of str) or one str")
        if not self.target_modules:
            raise ConfigError(
                "LoraConfig.target_modules is empty: name the linear layers to adapt, or 'all-linear'"
            )
        if self.adapter_path is not None and not isinstance(self.adapter_path, str):
            object.__setattr__(self, "adapter_path", str(self.adapter_path))

    @classmethod
    def from_adapter(cls, path: str, **overrides: Any) -> LoraConfig:
        """The config of the peft adapter directory ``path`` (rank, alpha, dropout, targets and
        exclusions from its ``adapter_config.json``), starting from its weights. ``ConfigError`` when the
        directory has no adapter config or it is not a LoRA adapter."""
        import json
        from pathlib import Path

        f = Path(path) / "adapter_config.json"
        if not f.is_file():
            raise ConfigError(f"LoraConfig.from_adapter({path!r}): no adapter_config.json there")
        data = json.loads(f.read_text())
        if str(data.get("peft_type", "LORA")).upper() != "LORA":
            raise ConfigError(
                f"LoraConfig.from_adapter({path!r}): peft_type {data.get('peft_type')!r} is not LORA"
            )
        targets = data.get("target_modules") or ()
        excl = data.get("exclude_modules") or ()
        kw: dict[str, Any] = dict(
            rank=int(data.get("r", 8)),
            alpha=float(data.get("lora_alpha", 16.0)),
            dropout=float(data.get("lora_dropout", 0.0)),
            target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)),
            exclude_modules=excl if isinstance(excl, str) else tuple(sorted(excl)),
            adapter_path=str(path),
        )
        kw.update(overrides)
        return cls(**kw)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to build and how to prepare it.

    Exactly one of ``path`` (a local Hugging Face directory: ``config.json``, ``*.safetensors``, optional
    tokenizer files) or ``hf_config`` (a ``transformers.PretrainedConfig``; random initialisation from
    ``seed``) is given. ``kind`` is ``"causal_lm"`` (policy/reference: log-probs) or ``"value"``
    (critic/reward: one scalar per token). ``overrides`` changes fields of the Hugging Face config
    before the model is built and its weights load (``{"max_position_embeddings": 8192,
    "rope_scaling": {...}}``, dotted keys for sub-configs: ``"text_config.rope_scaling"``); the engine's
    ``hf_config`` and exports carry them. Keys must exist in the config, keep their value's type, not
    change parameter shapes while loading from ``path``, and not have a field of their own here
    (``attention``, ``kind``) or in ``EngineConfig`` (``param_dtype``): ``ConfigError`` otherwise.

    ``attention``: the attention kernel of every attention layer: a registry name (``"torch"``,
    ``"eager"``, ...; ``None``: ``UNDERLAY_ATTENTION`` or ``auto``, chosen per call's ``AttentionSpec``),
    or a kernel built by the caller, which is how a kernel's constructor options reach the engine
    (``TorchAttention(device, dense_uniform=True)``); a given kernel that cannot run a layer's case raises
    ``BackendUnavailable`` at that layer's first call.

    ``training_randomness``: ``"off"`` (default) runs training forwards without any of the model's
    training-mode randomness (no dropout of any kind, LoRA's ``LoraConfig.dropout`` included, no MoE
    router jitter, in every module), so
    ``forward_backward`` computes the log-probs ``infer`` computes for the same weights (on-policy
    ratios are exactly 1); ``"keep"`` applies them as transformers' training does. Attention dropout is
    refused either way (the attention kernels have none).
    """

    path: str | None = None
    hf_config: Any | None = None
    kind: Literal["causal_lm", "value"] = "causal_lm"
    load_weights: bool = True
    seed: int = 0
    attention: str | AttentionKernel | None = None
    remove_padding: bool = True
    fused_head: bool = True
    tiled_mlp_tiles: int | None = None
    lora: LoraConfig | None = None
    overrides: Mapping[str, Any] | None = None
    training_randomness: Literal["off", "keep"] = "off"

    def __post_init__(self) -> None:
        if self.training_randomness not in ("off", "keep"):
            raise ConfigError(
                f"ModelConfig.training_randomness={self.training_randomness!r}: use 'off' (no dropout, no "
                "router jitter: training and inference forwards agree) or 'keep' (the model's own)"
            )
        if self.overrides is not None:
            if not isinstance(self.overrides, Mapping) or not all(isinstance(k, str) for k in self.overrides):
                raise ConfigError(
                    f"ModelConfig.overrides={self.overrides!r}: give a mapping of Hugging Face config keys "
                    "to values, e.g. {'max_position_embeddings': 8192}"
                )
            object.__setattr__(self, "overrides", copy.deepcopy(dict(self.overrides)))
        if (self.path is None) == (self.hf_config is None):
            raise ConfigError(
                "ModelConfig: give exactly one of path= (a local HF model directory) or hf_config= "
                f"(a transformers config); got path={self.path!r}, hf_config={type(self.hf_config).__name__}"
            )
        if self.kind not in ("causal_lm", "value"):
            raise ConfigError(f"ModelConfig.kind={self.kind!r}: use 'causal_lm' or 'value'")
        if self.tiled_mlp_tiles is not None:
            _int("ModelConfig", "tiled_mlp_tiles", self.tiled_mlp_tiles, 1, " or None")
        _int("ModelConfig", "seed", self.seed, 0)
        if self.attention is not None and not (
            (isinstance(self.attention, str) and self.attention)
            or (not isinstance(self.attention, str) and isinstance(self.attention, AttentionKernel))
        ):
            raise ConfigError(
                f"ModelConfig.attention={self.attention!r}: name a registered attention backend "
                "(underlay.list_attention()), give a built AttentionKernel (e.g. "
                "TorchAttention(device, dense_uniform=True)) or leave None to select one"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Requested sizes of each parallel dimension; ``dp_shard`` is what remains of the world size.

    Names and rules are those of ``ParallelLayout``: ``vpp`` virtual pipeline chunks per pipeline
    rank, ``etp`` expert tensor parallel (``None``: equal to ``tp``, Megatron-Core's default),
    ``ulysses`` the Ulysses sequence-parallel size (called ``sp`` before contract v2). Each engine
    refuses the dimensions it does not implement (``ConfigError`` naming them).
    """

    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    ulysses: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "etp" and v is None:
                continue
            _int("ParallelConfig", f.name, v, 1)
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError(f"ParallelConfig.vpp={self.vpp} needs pp > 1 (got pp={self.pp}); set vpp=1")


# torch.optim optimizers that cannot be the engines' optimizer, and why
_UNSUPPORTED_OPTIMIZERS = {
    "lbfgs": "it needs a closure that re-evaluates the loss; the engines step once per optimizer_step",
    "sparseadam": "it needs sparse gradients; the engines' gradients are dense",
    "muon": "it updates 2-D weight matrices only; a model also has 1-D norms and biases",
}
# keyword arguments the engine sets itself (never through OptimConfig.options)
_ENGINE_OWNED_OPTIONS = ("params", "lr", "weight_decay", "fused", "foreach", "differentiable")


def standard_optimizer_args(cls: Any) -> tuple[str, ...]:
    """Which of ``OptimConfig.betas`` / ``eps`` the optimizer class takes in their usual form (a pair of
    floats, a float): those the engine passes; other forms (Adafactor's ``eps`` pair) go in ``options``."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    out = []
    if "betas" in params and isinstance(params["betas"].default, tuple) and len(params["betas"].default) == 2:
        out.append("betas")
    if "eps" in params and isinstance(params["eps"].default, float):
        out.append("eps")
    return tuple(out)


def optimizer_class(name: str) -> Any:
    """The ``torch.optim`` class named ``name`` (case-insensitive; ``"adamw"`` is ``torch.optim.AdamW``).
    ``ConfigError`` naming the choices for an unknown or unsupported name."""
    import torch

    classes = {
        n.lower(): c
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    }
    key = name.lower() if isinstance(name, str) else ""
    if key in _UNSUPPORTED_OPTIMIZERS:
        raise ConfigError(f"OptimConfig.name={name!r} is not supported: {_UNSUPPORTED_OPTIMIZERS[key]}")
    if key not in classes:
        known = sorted(c.__name__ for k, c in classes.items() if k not in _UNSUPPORTED_OPTIMIZERS)
        raise ConfigError(f"OptimConfig.name={name!r}: not a torch.optim optimizer; use one of {known}")
    return classes[key]


def _check_optimizer(cfg: OptimConfig) -> None:
    import inspect

    cls = optimizer_class(cfg.name)
    if not isinstance(cfg.options, Mapping):
        raise ConfigError(
            f"OptimConfig.options={cfg.options!r}: give a mapping of {cls.__name__} keyword arguments"
        )
    object.__setattr__(cfg, "options", dict(cfg.options))
    params = inspect.signature(cls.__init__).parameters
    standard = standard_optimizer_args(cls)
    for key in cfg.options:
        if key in _ENGINE_OWNED_OPTIONS or key in standard:
            raise ConfigError(
                f"OptimConfig.options[{key!r}]: set by the engine or by OptimConfig.{key} itself, not in options"
            )
        if key not in params:
            accepted = sorted(k for k in params if k not in ("self", *_ENGINE_OWNED_OPTIONS, *standard))
            raise ConfigError(
                f"OptimConfig.options[{key!r}]: {cls.__name__} takes no such argument (it takes {accepted})"
            )
    defaults = {f.name: f.default for f in dataclasses.fields(OptimConfig) if f.name in ("betas", "eps")}
    for key in ("betas", "eps"):
        if key not in standard and tuple(_as_tuple(getattr(cfg, key))) != tuple(_as_tuple(defaults[key])):
            raise ConfigError(
                f"OptimConfig.{key}={getattr(cfg, key)!r}: {cls.__name__} has no {key}; leave it at its default"
            )
    try:  # the optimizer's own argument checks (negative momentum, nesterov without momentum, ...)
        import torch

        probe = torch.nn.Parameter(torch.zeros(1))
        kw = {k: getattr(cfg, k) for k in standard}
        cls([probe], lr=cfg.lr, weight_decay=cfg.weight_decay, **kw, **cfg.options)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ConfigError(f"OptimConfig: {cls.__name__} refuses options {cfg.options!r}: {exc}") from exc


def _as_tuple(v: Any) -> tuple[Any, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer and its learning-rate schedule.

    ``name``: ``"adamw"`` (default; the engines' fused or host-offloaded AdamW) or the name of any
    ``torch.optim`` optimizer (case-insensitive: ``"SGD"``, ``"Adam"``, ``"RMSprop"``, ``"Adagrad"``,
    ``"NAdam"``, ``"RAdam"``, ``"Adamax"``, ``"Adadelta"``, ``"ASGD"``; not ``LBFGS`` (needs a closure) or
    ``SparseAdam`` (sparse gradients)). ``lr`` and ``weight_decay`` go to every optimizer; ``betas`` and
    ``eps`` to those that take them (changing them for one that does not is refused); ``options`` are the
    optimizer's other keyword arguments (``{"momentum": 0.9, "nesterov": True}`` for SGD), checked
    against its signature. Engines may support fewer optimizers (Megatron-Core: ``adamw`` and ``sgd``)
    and refuse the others by name.

    ``schedule``: ``"constant"`` (after linear warmup), ``"cosine"`` (warmup, then cosine to
    ``min_lr_ratio * lr`` at ``total_steps``), ``"wsd"`` (warmup-stable-decay; ``decay_ratio`` of the
    steps at the end decay linearly to ``min_lr_ratio * lr``). ``grad_clip`` is the global L2 norm limit
    (``None`` or <= 0 disables clipping; the norm is still computed and a non-finite one skips the step).
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = 1.0
    schedule: Literal["constant", "cosine", "wsd"] = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    decay_ratio: float = 0.1
    name: str = "adamw"
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a NaN/inf lr or eps turns every weight into NaN while the step still reports success, and a
        # NaN grad_clip silently disables clipping: only finite values in range enter
        _real("OptimConfig", "lr", self.lr, 0.0, math.inf, closed_high=False)
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ConfigError(f"OptimConfig.betas={betas!r}: give two numbers (beta1, beta2) in [0, 1)")
        for i, b in enumerate(betas):
            _real("OptimConfig", f"betas[{i}]", b, 0.0, 1.0, closed_high=False)
        _real("OptimConfig", "eps", self.eps, 0.0, math.inf, closed_high=False)
        _real("OptimConfig", "weight_decay", self.weight_decay, 0.0, math.inf, closed_high=False)
        if self.grad_clip is not None:
            _real(
                "OptimConfig",
                "grad_clip (None or 0 disables clipping)",
                self.grad_clip,
                0.0,
                math.inf,
                closed_high=False,
            )
        _int("OptimConfig", "warmup_steps", self.warmup_steps, 0)
        if self.total_steps is not None:
            _int("OptimConfig", "total_steps", self.total_steps, 1, " or None")
            if self.warmup_steps > self.total_steps:
                raise ConfigError(
                    f"OptimConfig.warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}; "
                    "lower the warmup or raise total_steps"
                )
        for name in ("min_lr_ratio", "decay_ratio"):
            _real("OptimConfig", name, getattr(self, name), 0.0, 1.0)
        if self.schedule not in ("constant", "cosine", "wsd"):
            raise ConfigError(f"OptimConfig.schedule={self.schedule!r}: use 'constant', 'cosine' or 'wsd'")
        if self.schedule != "constant" and not self.total_steps:
            raise ConfigError(f"OptimConfig.schedule={self.schedule!r} needs total_steps > 0")
        _check_optimizer(self)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine backend needs to build, shard and train one model.

    ``micro_batch_max_tokens`` bounds the real tokens of one packed micro-batch
    (``ops.plan_micro_batches``). ``param_dtype``/``reduce_dtype`` are the mixed-precision policy
    (compute in ``param_dtype``, reduce gradients in ``reduce_dtype``; master weights and optimizer
    state stay fp32). ``recompute`` is the activation recomputation policy (``RecomputePolicy``:
    ``"auto"`` (default): the engine chooses at build from the model size, ``micro_batch_max_tokens``
    and the device memory, and logs its choice; ``"none"``, ``"full"``: each decoder layer in
    backward, ``"selective"`` where the engine supports it; an explicit policy is always obeyed, and an
    engine refuses one it does not support with ``ConfigError`` and its reason).
    ``activation_checkpointing`` is the deprecated spelling of ``recompute`` (``True`` -> ``"full"``,
    ``False`` -> ``"none"``; a ``DeprecationWarning``; ``ConfigError`` when it contradicts
    ``recompute``). ``options`` holds engine-specific settings: a mapping validated against the
    engine's options dataclass (``underlay.registry.engine_options(name)``) or that dataclass itself.

    ``role``: ``"trainable"`` (default: master weights, optimizer, gradients) or ``"reference"``: an
    inference-only engine (a reference policy, a reward model) that holds the weights in ``param_dtype``
    only (no fp32 master copy, no optimizer, no gradient buffers); ``infer``, ``load_hf``,
    ``load_checkpoint`` (the weights of a trainable engine's checkpoint), ``offload``/``onload`` and the
    weight streams work, while ``forward_backward``, ``optimizer_step``, ``lr_scheduler_step`` and
    ``save_checkpoint`` raise ``UnsupportedOperation`` naming the role. A reference engine takes no
    LoRA (use ``disable_adapter()`` of the trainable engine for LoRA's reference). Engines that cannot
    build one refuse it with ``ConfigError`` (Megatron-Core: ``docs/roles.md``).
    """

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_max_tokens: int = 16384
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    recompute: RecomputePolicy = "auto"
    activation_checkpointing: bool | Literal["none", "full"] | None = None
    cpu_offload: bool = False
    temperature: float = 1.0
    with_entropy: bool = True
    options: Mapping[str, Any] | Any = field(default_factory=dict)
    role: Literal["trainable", "reference"] = "trainable"

    def __post_init__(self) -> None:
        if self.role not in ("trainable", "reference"):
            raise ConfigError(
                f"EngineConfig.role={self.role!r}: use 'trainable' (weights, optimizer, gradients) or "
                "'reference' (inference only: weights in param_dtype, no optimizer)"
            )
        if self.role == "reference" and self.model.lora is not None:
            raise ConfigError(
                "EngineConfig.role='reference' with ModelConfig.lora: a reference engine trains nothing; "
                "drop lora (merge the adapter into the weights first), or take the reference log-probs "
                "of the LoRA engine itself inside engine.disable_adapter()"
            )
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v not in _DTYPES:
                raise ConfigError(f"EngineConfig.{name}={v!r}: use one of {_DTYPES}")
        _int("EngineConfig", "micro_batch_max_tokens", self.micro_batch_max_tokens, 1)
        _check_temperature("EngineConfig.temperature", self.temperature)
        for name in ("cpu_offload", "with_entropy"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"EngineConfig.{name}={getattr(self, name)!r}: use True or False")
        if self.recompute not in _RECOMPUTE:
            raise ConfigError(f"EngineConfig.recompute={self.recompute!r}: use one of {_RECOMPUTE}")
        ac = self.activation_checkpointing
        if ac is not None:
            if not isinstance(ac, (bool, str)) or ac not in _AC_MODES:
                raise ConfigError(
                    f"EngineConfig.activation_checkpointing={ac!r}: use one of False, True, 'none' or "
                    "'full' (deprecated: use recompute='none'|'full'|'selective')"
                )
            warnings.warn(
                "EngineConfig.activation_checkpointing is deprecated; use recompute='full' or 'none'",
                DeprecationWarning,
                stacklevel=3,
            )
            mode = _AC_MODES[ac]
            if self.recompute not in ("auto", "none", mode):
                raise ConfigError(
                    f"EngineConfig: activation_checkpointing={ac!r} contradicts recompute="
                    f"{self.recompute!r}; give recompute alone"
                )
            object.__setattr__(self, "recompute", mode)
        is_dataclass_options = dataclasses.is_dataclass(self.options) and not isinstance(self.options, type)
        if not isinstance(self.options, Mapping) and not is_dataclass_options:
            raise ConfigError(
                f"EngineConfig.options is a {type(self.options).__name__}; give a mapping or the engine's "
                "options dataclass"
            )

    @property
    def activation_checkpointing_mode(self) -> RecomputePolicy:
        """Deprecated alias of ``recompute``."""
        return self.recompute


_RECOMPUTE: tuple[RecomputePolicy, ...] = ("auto", "none", "full", "selective")


def _check_temperature(where: str, value: object) -> None:
    """``ConfigError`` unless ``value`` is a finite number > 0 (``inf`` flattens every distribution
    to uniform and ``nan`` poisons every log-prob)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(float(value)) and float(value) > 0):  # type: ignore[arg-type]
        raise ConfigError(
            f"{where}={value!r}: must be a finite number > 0 (1.0 leaves the logits as they are)"
        )


_AC_MODES: dict[object, Literal["none", "full"]] = {
    False: "none",
    True: "full",
    "none": "none",
    "full": "full",
}


_NESTED: dict[tuple[str, str], type[Any]] = {
    ("EngineConfig", "model"): ModelConfig,
    ("EngineConfig", "parallel"): ParallelConfig,
    ("EngineConfig", "optim"): OptimConfig,
    ("ModelConfig", "lora"): LoraConfig,
}


@dataclass(frozen=True)
class ProfilerConfig:
    """What a profiler records.

    ``ranks``: global ranks that record (empty = all). ``steps``: the step indices (0-based, counted by
    ``Profiler.step()``) that record; empty = every step between ``start`` and ``stop``. For the
    ``torch`` backend the steps become a wait/warmup/active schedule: ``warmup`` steps before the
    first recorded step are run under the profiler without recording. ``output_dir`` receives one trace
    per rank; ``format`` is ``"chrome"`` (JSON trace) or ``"tensorboard"``. ``options`` holds
    backend-specific settings.
    """

    enabled: bool = True
    ranks: tuple[int, ...] = (0,)
    steps: tuple[int, ...] = ()
    output_dir: str = "profiles"
    with_memory: bool = False
    with_stack: bool = False
    record_shapes: bool = False
    warmup: int = 1
    format: Literal["chrome", "tensorboard"] = "chrome"
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("ranks", "steps"):
            value = getattr(self, name)
            try:
                iterable = not isinstance(value, (str, bytes)) and bool(tuple(value)) in (True, False)
            except TypeError:
                iterable = False
            if not iterable:
                raise ConfigError(
                    f"ProfilerConfig.{name}={getattr(self, name)!r}: must be a tuple of ints >= 0 (e.g. (0,))"
                )
        for s in self.steps:
            _int("ProfilerConfig", "steps[...]", s, 0)
        for r in self.ranks:
            _int("ProfilerConfig", "ranks[...]", r, 0)
        _int("ProfilerConfig", "warmup", self.warmup, 0)
        if self.format not in ("chrome", "tensorboard"):
            raise ConfigError(f"ProfilerConfig.format={self.format!r}: use 'chrome' or 'tensorboard'")

    @classmethod
    def load(cls, data: Mapping[str, Any] | Any) -> ProfilerConfig:
        """From a plain dict or an OmegaConf ``DictConfig`` (anything with ``items()``)."""
        if not isinstance(data, Mapping):
            try:
                from omegaconf import OmegaConf

                data = OmegaConf.to_container(data, resolve=True)
            except ImportError as exc:  # pragma: no cover - omegaconf absent
                raise ConfigError(
                    f"ProfilerConfig.load: expected a mapping, got {type(data).__name__}"
                ) from exc
        assert isinstance(data, Mapping)
        return from_dict(cls, {str(k): v for k, v in data.items()})
