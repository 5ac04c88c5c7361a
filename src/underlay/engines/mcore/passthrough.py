"""Validated pass-through of megatron-core config fields: ``MCoreOptions.transformer`` (fields of
megatron's ``TransformerConfig``), ``MCoreOptions.optimizer`` (``OptimizerConfig``) and
``MCoreOptions.ddp`` (``DistributedDataParallelConfig``).

A passed field reaches megatron unchanged unless underlay owns it: a field the engine sets itself (the
architecture from the HF config, the parallel sizes, the dtypes, the recompute granularity, the fused
kernels, the callbacks) is refused by name with the place that sets it, and so is a name megatron's
dataclass does not have. Fields that change which layers a pipeline stage holds are limited to
``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` (the engine's weight
map follows megatron's own layer offsets for those). Megatron's own validation of the merged config
(its ``__post_init__``) is turned into ``ConfigError`` by ``build``.

No heavy imports at module level: ``MCoreOptions`` validates the owned names without megatron.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from underlay.interfaces import ConfigError

__all__ = ["OWNED", "build", "check_names", "check_owned", "merge"]

T = TypeVar("T")

_PARALLEL = "ParallelConfig (tp, pp, vpp, cp, ep, etp)"
_DTYPE = "EngineConfig.param_dtype"
_ARCH = "the HF model config (ModelConfig); the conversion sets it so the model computes transformers'"
_TE = "a fused kernel of transformer_engine/apex, which the local layer spec does not use"
_CALLBACK = "an engine callback (gradient reduction and synchronisation run through the engine)"
_UNVERIFIED_SPLIT = (
    "another pipeline layer split than the engine's weight map follows; use "
    "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"
)

OWNED: dict[str, dict[str, str]] = {
    "transformer": {
        "tensor_model_parallel_size": _PARALLEL,
        "pipeline_model_parallel_size": _PARALLEL,
        "virtual_pipeline_model_parallel_size": _PARALLEL,
        "context_parallel_size": _PARALLEL,
        "expert_model_parallel_size": _PARALLEL,
        "expert_tensor_parallel_size": _PARALLEL,
        "sequence_parallel": "MCoreOptions.sequence_parallel",
        "batch_p2p_comm": "MCoreOptions.batch_p2p_comm",
        "bias_activation_fusion": "MCoreOptions.fused_elementwise",
        "params_dtype": _DTYPE,
        "pipeline_dtype": _DTYPE,
        "bf16": _DTYPE,
        "fp16": _DTYPE,
        "fp8": "low-precision training that the engine does not verify; not supported",
        "fp4": "low-precision training that the engine does not verify; not supported",
        "recompute_granularity": "EngineConfig.recompute ('full' or 'selective')",
        "masked_softmax_fusion": _TE,
        "bias_dropout_fusion": _TE,
        "persist_layer_norm": _TE,
        "gradient_accumulation_fusion": _TE,
        "apply_rope_fusion": _TE,
        "cross_entropy_loss_fusion": "the engine's log-prob kernel (it computes log-probs, not megatron's loss)",
        "hidden_dropout": _ARCH,
        "attention_dropout": _ARCH,
        "multi_latent_attention": _ARCH,
        "window_size": _ARCH,
        "rotary_interleaved": _ARCH,
        "num_layers_per_virtual_pipeline_stage": _PARALLEL,
        "pipeline_model_parallel_layout": _UNVERIFIED_SPLIT,
        "account_for_embedding_in_pipeline_split": _UNVERIFIED_SPLIT,
        "account_for_loss_in_pipeline_split": _UNVERIFIED_SPLIT,
        "finalize_model_grads_func": _CALLBACK,
        "no_sync_func": _CALLBACK,
        "grad_sync_func": _CALLBACK,
        "param_sync_func": _CALLBACK,
        "grad_scale_func": _CALLBACK,
        "calculate_per_token_loss": "the engine's loss contract (every loss_fn returns its own contribution)",
        "variable_seq_lengths": "the engine's packing (one length per micro-batch, or one per step with vpp)",
        "moe_token_dispatcher_type": "the engine (the alltoall dispatcher is the one that takes packed lengths)",
        "moe_router_load_balancing_type": _ARCH,
        "moe_aux_loss_coeff": _ARCH,
        "perform_initialization": "the engine: weights come from the HF files or the seed model",
        "use_cpu_initialization": "the engine: weights come from the HF files or the seed model",
    },
    "optimizer": {
        "optimizer": "OptimConfig.name",
        "lr": "OptimConfig.lr",
        "min_lr": "OptimConfig (the LR schedule runs in the engine)",
        "weight_decay": "OptimConfig.weight_decay",
        "adam_beta1": "OptimConfig.betas",
        "adam_beta2": "OptimConfig.betas",
        "adam_eps": "OptimConfig.eps",
        "sgd_momentum": "OptimConfig.options['momentum']",
        "clip_grad": "OptimConfig.grad_clip",
        "bf16": _DTYPE,
        "fp16": _DTYPE,
        "params_dtype": _DTYPE,
        "use_distributed_optimizer": "MCoreOptions.distributed_optimizer",
        "optimizer_cpu_offload": "EngineConfig offload (engine.offload/onload)",
        "overlap_param_gather": "MCoreOptions.overlap_param_gather",
        "overlap_param_gather_with_optimizer_step": "the engine (not verified); use MCoreOptions.overlap_param_gather",
    },
    "ddp": {
        "use_distributed_optimizer": "MCoreOptions.distributed_optimizer",
        "grad_reduce_in_fp32": "EngineConfig.reduce_dtype",
        "overlap_grad_reduce": "MCoreOptions.overlap_grad_reduce",
        "overlap_param_gather": "MCoreOptions.overlap_param_gather",
        "average_in_collective": "the engine's loss contract (gradients sum over data-parallel ranks)",
        "use_megatron_fsdp": "the engine (megatron FSDP is not verified); use the fsdp2 engine for FSDP",
        "use_custom_fsdp": "the engine (megatron FSDP is not verified); use the fsdp2 engine for FSDP",
        "data_parallel_sharding_strategy": "the engine (megatron FSDP is not verified)",
    },
}
"""Per pass-through mapping: the fields underlay owns, each with where it is set instead."""


def check_owned(kind: str, fields: Mapping[str, Any]) -> None:
    """``ConfigError`` naming the first field of ``fields`` (the ``MCoreOptions.<kind>`` mapping) that
    underlay owns, and where to set it instead; also for a non-string key. No megatron import."""
    owned = OWNED[kind]
    for name in fields:
        if not isinstance(name, str):
            raise ConfigError(f"mcore: options {kind}: field names must be str, got {name!r}")
        if name in owned:
            raise ConfigError(
                f"mcore: options {kind}[{name!r}] is set by underlay ({owned[name]}); set it there, not "
                "in the pass-through"
            )


def merge(
    kind: str,
    cls: type[Any],
    base: Mapping[str, Any],
    extra: Mapping[str, Any] | None,
    overridable: Collection[str] = (),
) -> dict[str, Any]:
    """``base`` (the engine's keyword arguments for megatron dataclass ``cls``) plus the pass-through
    ``extra`` (``MCoreOptions.<kind>``). ``ConfigError`` for a field ``cls`` does not have (with the
    closest names), one underlay owns (``OWNED``), or one the engine already sets in ``base`` (except
    the ``overridable`` ones: defaults the pass-through may replace)."""
    out = dict(base)
    if not extra:
        return out
    check_owned(kind, extra)
    names = {f.name for f in dataclasses.fields(cls)}
    for name, value in extra.items():
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names), n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise ConfigError(
                f"mcore: options {kind}[{name!r}]: megatron-core's {cls.__name__} has no field {name!r}{hint}"
            )
        if name in base and name not in overridable:
            raise ConfigError(
                f"mcore: options {kind}[{name!r}] is set by underlay for this model and layout "
                f"(to {base[name]!r}); it cannot be overridden"
            )
        out[name] = value
    return out


def build(kind: str, cls: Callable[..., T], kwargs: Mapping[str, Any], extra: Mapping[str, Any] | None) -> T:
    """``cls(**kwargs)``, turning megatron's own validation error (``ValueError``, ``AssertionError``,
    ``TypeError``) into ``ConfigError`` that names the pass-through fields ``extra`` in play."""
    try:
        return cls(**kwargs)
    except (ValueError, AssertionError, TypeError) as exc:
        given = dict(extra or {})
        raise ConfigError(
            f"mcore: megatron-core refuses the {kind} config{f' with options {kind}={given!r}' if given else ''}: "
            f"{exc}"
        ) from exc


def check_names(transformer_cls: type[Any], options: Any, transformer_base: Mapping[str, Any]) -> None:
    """Check every pass-through mapping of ``options`` (``MCoreOptions``) against megatron's dataclass
    (``transformer_cls`` for the model's TransformerConfig class, ``OptimizerConfig``,
    ``DistributedDataParallelConfig``) before anything is built: ``ConfigError`` as ``merge`` raises
    for an unknown or owned name (``transformer_base``: the engine's TransformerConfig keyword
    arguments for this model). Imports megatron's config modules only (no process state)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    classes = {
        "transformer": transformer_cls,
        "optimizer": OptimizerConfig,
        "ddp": DistributedDataParallelConfig,
    }
    for kind, cls in classes.items():
        base = transformer_base if kind == "transformer" else {}
        merge(kind, cls, base, getattr(options, kind), ("recompute_method", "recompute_num_layers"))
