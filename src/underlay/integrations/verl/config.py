"""verl's engine configuration mapped onto underlay's ``EngineConfig``; what cannot be honoured is refused.

verl builds an engine from four configs: ``HFModelConfig`` (the model), an engine config
(``FSDPEngineConfig`` or :class:`UnderlayEngineConfig`), ``FSDPOptimizerConfig`` and
``CheckpointConfig``. :func:`to_underlay_config` maps each field that has an exact underlay
counterpart, accepts fields that only tune verl's own FSDP wrapper (they have no effect on the
numbers), and raises ``ConfigError`` naming every field set to a value underlay cannot honour.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl.workers.config import FSDPEngineConfig

from underlay.interfaces import (
    ConfigError,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
)

__all__ = ["UnderlayEngineConfig", "to_underlay_config"]

_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
_DTYPES.update({"fp16": "float16", "float16": "float16"})


@dataclass
class UnderlayEngineConfig(FSDPEngineConfig):  # type: ignore[misc]
    """verl's FSDP engine config with ``strategy="underlay"`` (what selects this backend in
    ``EngineRegistry``) and underlay's fields: ``underlay_engine`` (``"fsdp2"``, ``"mcore"``, or
    ``None``: ``UNDERLAY_ENGINE``, default ``fsdp2``), ``micro_batch_max_tokens`` (the token budget
    of one packed micro-batch; ``None``: ``max_token_len_per_gpu``, else 16384), ``temperature``
    (the sampling temperature training log-probs are computed at; a batch's ``temperature`` must
    equal it), and the model-parallel sizes under the names of verl's ``McoreEngineConfig``:
    ``tensor_model_parallel_size`` and ``pipeline_model_parallel_size`` (``ParallelConfig.tp`` and
    ``pp``; the underlay engine refuses sizes it does not implement). Every FSDP field keeps its
    meaning; :func:`to_underlay_config` says which it honours.
    """

    strategy: str = "underlay"
    underlay_engine: str | None = None
    micro_batch_max_tokens: int | None = None
    temperature: float = 1.0
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.strategy != "underlay":
            raise ConfigError(
                f"UnderlayEngineConfig.strategy={self.strategy!r}: this config selects the 'underlay' "
                "backend; set strategy='underlay' (or use verl's FSDPEngineConfig for its own engine)"
            )
        if self.underlay_engine not in (None, "fsdp2", "mcore"):
            raise ConfigError(
                f"UnderlayEngineConfig.underlay_engine={self.underlay_engine!r}: use 'fsdp2', 'mcore' or "
                "None (UNDERLAY_ENGINE, default fsdp2)"
            )


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    """``cfg.name`` for a dataclass or a mapping (OmegaConf containers included)."""
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _refuse(bad: list[str]) -> None:
    if bad:
        raise ConfigError(
            "the underlay verl backend cannot honour: " + "; ".join(bad) + ". Unset these fields (their "
            "defaults) or use verl's own engine (strategy fsdp/fsdp2) for this run"
        )


def _model(model_config: Any, model_type: str, bad: list[str]) -> ModelConfig:
    """``HFModelConfig`` -> ``ModelConfig``."""
    path = _get(model_config, "local_path") or _get(model_config, "path")
    if not path:
        raise ConfigError(
            "HFModelConfig.local_path/path is empty: give the local Hugging Face model directory"
        )
    kind = {"language_model": "causal_lm", "value_model": "value"}.get(model_type)
    if kind is None:
        raise ConfigError(
            f"model_type={model_type!r}: the underlay backend serves 'language_model' and 'value_model'"
        )
    if _get(model_config, "override_config"):
        bad.append(
            f"model.override_config={dict(_get(model_config, 'override_config'))!r} (load a model whose config.json has it)"
        )
    for name in ("use_liger", "enable_activation_offload"):
        if _get(model_config, name):
            bad.append(f"model.{name}=True (underlay has its own kernels and offload: set it False)")
    mtp = _get(model_config, "mtp")
    if mtp is not None and _get(mtp, "enable", False):
        bad.append("model.mtp.enable=True (multi-token prediction heads are not trained by underlay)")
    tiled = _get(model_config, "tiled_mlp") or {}
    tiles = int(_get(tiled, "num_shards", 4)) if _get(tiled, "enabled", False) else None
    lora = None
    adapter = _get(model_config, "lora_adapter_path")
    rank = int(_get(model_config, "lora_rank", 0) or 0)
    if adapter:  # verl's PeftModel.from_pretrained: the adapter directory's own rank, alpha and targets
        lora = LoraConfig.from_adapter(str(adapter))
    elif rank > 0:
        if _get(model_config, "target_parameters"):
            bad.append(
                f"model.target_parameters={_get(model_config, 'target_parameters')!r} (underlay adapts linear "
                "modules, not bare parameters)"
            )
        targets = _get(model_config, "target_modules") or "all-linear"
        exclude = _get(model_config, "exclude_modules") or ()
        lora = LoraConfig(
            rank=rank,
            alpha=float(_get(model_config, "lora_alpha", 16)),
            target_modules=targets if isinstance(targets, str) else tuple(targets),
            exclude_modules=exclude if isinstance(exclude, str) else tuple(exclude),
        )
    return ModelConfig(
        path=str(path),
        kind=kind,  # type: ignore[arg-type]
        remove_padding=bool(_get(model_config, "use_remove_padding", True)),
        tiled_mlp_tiles=tiles,
        lora=lora,
    )


def _optim(optim: Any, bad: list[str]) -> OptimConfig:
    """``FSDPOptimizerConfig`` -> ``OptimConfig``: the ``torch.optim`` optimizer verl names, its
    ``override_optimizer_config`` as options (``eps`` to ``OptimConfig.eps``), with a constant (linear
    warmup) or cosine (warmup, half cycle) schedule."""
    if optim is None:  # forward-only engines (reference policy) carry no optimizer config
        return OptimConfig()
    name = str(_get(optim, "optimizer", "AdamW"))
    if _get(optim, "optimizer_impl", "torch.optim") != "torch.optim":
        bad.append(
            f"optim.optimizer_impl={_get(optim, 'optimizer_impl')!r} (underlay builds torch.optim optimizers by name)"
        )
    # verl's build_optimizer: lr and weight_decay always, betas for Adam-like names, then the overrides
    options = dict(_get(optim, "override_optimizer_config") or {})
    for key in ("lr", "weight_decay", "betas"):
        if key in options:
            bad.append(f"optim.override_optimizer_config[{key!r}] (set optim.{key} instead)")
            options.pop(key)
    eps = float(options.pop("eps", 1e-8))
    kind = _get(optim, "lr_scheduler_type", "constant")
    if kind not in ("constant", "cosine"):
        bad.append(f"optim.lr_scheduler_type={kind!r} (use 'constant' or 'cosine')")
        kind = "constant"
    total = int(_get(optim, "total_training_steps", -1) or -1)
    warmup = int(_get(optim, "lr_warmup_steps", -1) or -1)
    if warmup <= 0:
        warmup = int(float(_get(optim, "lr_warmup_steps_ratio", 0.0) or 0.0) * total) if total > 0 else 0
    if warmup > 0:
        bad.append(
            f"optim warmup of {warmup} steps (lr_warmup_steps/lr_warmup_steps_ratio): verl's warmup factor is "
            "k/warmup at step k, underlay's (k+1)/warmup; train without warmup or use verl's engine"
        )
        warmup = 0
    if kind == "cosine":
        if not math.isclose(float(_get(optim, "num_cycles", 0.5)), 0.5):
            bad.append(
                f"optim.num_cycles={_get(optim, 'num_cycles')!r} (underlay's cosine is one half cycle: 0.5)"
            )
        if total <= 0:
            bad.append("optim.lr_scheduler_type='cosine' with total_training_steps <= 0")
    if not _get(optim, "zero_indexed_step", True):
        bad.append("optim.zero_indexed_step=False (underlay's schedule counts steps from 0)")
    clip = _get(optim, "clip_grad", None)
    if clip is None:
        clip = _get(optim, "grad_clip", None)
    min_lr = _get(optim, "min_lr_ratio", None)
    adam_like = "adam" in name.lower()
    return OptimConfig(
        name=name.lower(),
        options=options,
        lr=float(_get(optim, "lr", 1e-6)),
        eps=eps,
        betas=tuple(float(b) for b in _get(optim, "betas", (0.9, 0.999))) if adam_like else (0.9, 0.999),  # type: ignore[arg-type]
        weight_decay=float(_get(optim, "weight_decay", 0.01)),
        grad_clip=None if clip is None else float(clip),
        schedule=kind,
        warmup_steps=max(warmup, 0),
        total_steps=total if total > 0 else None,
        min_lr_ratio=0.0 if min_lr is None else float(min_lr),
    )


def _precision(engine: Any, bad: list[str]) -> tuple[str, str]:
    """``mixed_precision``/``model_dtype`` -> ``(param_dtype, reduce_dtype)``. underlay keeps fp32 master
    weights (verl's default ``model_dtype='fp32'`` for training)."""
    mp = _get(engine, "mixed_precision") or {}
    param = _DTYPES.get(str(_get(mp, "param_dtype", "bf16")))
    reduce = _DTYPES.get(str(_get(mp, "reduce_dtype", "fp32")))
    buffer = _DTYPES.get(str(_get(mp, "buffer_dtype", "fp32")))
    if param is None or reduce is None or buffer != "float32":
        bad.append(
            f"engine.mixed_precision={dict(mp)!r} (param/reduce dtype in fp32, bf16, fp16; buffers fp32)"
        )
    master = _get(engine, "model_dtype", "fp32")
    if (
        master is not None
        and _DTYPES.get(str(master)) != "float32"
        and not _get(engine, "forward_only", False)
    ):
        bad.append(f"engine.model_dtype={master!r} (underlay trains fp32 master weights: 'fp32')")
    return param or "bfloat16", reduce or "float32"


def to_underlay_config(
    model_config: Any,
    engine_config: Any,
    optimizer_config: Any,
    checkpoint_config: Any,
    model_type: str,
    world_size: int,
) -> tuple[EngineConfig, str | None]:
    """The underlay ``EngineConfig`` and engine name (``None``: ``UNDERLAY_ENGINE``) for verl's four configs.

    Fields mapped: model path, ``model_type`` (value models: ``kind='value'``),
    ``enable_gradient_checkpointing`` (recompute full/none), ``use_remove_padding``, ``tiled_mlp``,
    LoRA rank/alpha/target list, ``mixed_precision`` param/reduce dtypes, ``fsdp_size`` (HSDP
    replicas), ``ulysses_sequence_parallel_size``, ``tensor_model_parallel_size`` and
    ``pipeline_model_parallel_size`` (:class:`UnderlayEngineConfig`; tp, pp), ``seed``, AdamW lr/betas/weight decay/clip,
    constant or cosine schedule with warmup, ``max_token_len_per_gpu`` (micro-batch token budget).
    Raises ``ConfigError`` naming every field set to a value underlay cannot honour, before anything
    is built.
    """
    bad: list[str] = []
    model = _model(model_config, model_type, bad)
    param_dtype, reduce_dtype = _precision(engine_config, bad)
    refused = {
        "pad_to_length": "static packed lengths; underlay packs each micro-batch to its own length",
        "full_determinism": "underlay does not switch torch into deterministic algorithms",
    }
    for name, why in refused.items():
        value = _get(engine_config, name, False)
        if value:
            bad.append(f"engine.{name}={value!r} ({why})")
    if _get(engine_config, "wrap_policy"):
        bad.append(
            f"engine.wrap_policy={dict(_get(engine_config, 'wrap_policy'))!r} (underlay shards per decoder layer)"
        )
    if _get(engine_config, "turbo_config"):
        bad.append("engine.turbo_config (fsdp_turbo is verl's own engine)")
    qat = _get(engine_config, "qat")
    if qat is not None and _get(qat, "enable", False):
        bad.append("engine.qat.enable=True (quantization-aware training)")
    replay = _get(engine_config, "router_replay")
    if replay is not None and _get(replay, "mode", "disabled") != "disabled":
        bad.append(f"engine.router_replay.mode={_get(replay, 'mode')!r}")
    if checkpoint_config is not None:
        for name in ("save_contents", "load_contents"):
            contents = set(_get(checkpoint_config, name, ["model", "optimizer", "extra"]) or ())
            if not {"model", "optimizer", "extra"} <= contents:
                bad.append(
                    f"checkpoint.{name}={sorted(contents)!r} (underlay checkpoints hold model, optimizer and extra together)"
                )
        for name in ("async_save", "save_lora_only"):
            if _get(checkpoint_config, name, False):
                bad.append(f"checkpoint.{name}=True")
    ulysses = int(_get(engine_config, "ulysses_sequence_parallel_size", 1) or 1)
    fsdp_size = int(_get(engine_config, "fsdp_size", -1) or -1)
    replicate = 1
    if 0 < fsdp_size < world_size:
        if world_size % fsdp_size:
            bad.append(f"engine.fsdp_size={fsdp_size} does not divide the world size {world_size}")
        else:
            replicate = world_size // fsdp_size
    optim = _optim(optimizer_config, bad)
    budget = (
        _get(engine_config, "micro_batch_max_tokens") or _get(engine_config, "max_token_len_per_gpu") or 16384
    )
    temperature = float(_get(engine_config, "temperature", 1.0))
    seed = int(_get(engine_config, "seed", 42))
    _refuse(bad)
    config = EngineConfig(
        model=ModelConfig(
            path=model.path,
            kind=model.kind,
            seed=seed,
            remove_padding=model.remove_padding,
            tiled_mlp_tiles=model.tiled_mlp_tiles,
            lora=model.lora,
        ),
        parallel=ParallelConfig(
            dp_replicate=replicate,
            ulysses=ulysses,
            tp=int(_get(engine_config, "tensor_model_parallel_size", 1) or 1),
            pp=int(_get(engine_config, "pipeline_model_parallel_size", 1) or 1),
        ),
        optim=optim,
        micro_batch_max_tokens=int(budget) * ulysses,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        recompute="full" if _get(model_config, "enable_gradient_checkpointing", True) else "none",
        temperature=temperature,
        cpu_offload=bool(_get(engine_config, "offload_policy", False)),
        with_entropy=model.kind == "causal_lm",
    )
    return config, _get(engine_config, "underlay_engine")
