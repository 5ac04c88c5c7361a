"""Construction of the mcore engine: megatron's parallel state, the ``GPTModel`` chunks (one per
virtual pipeline stage, with the value head or the hidden-state output layer), megatron's DDP and
optimizer, and the typed process groups. ``MCoreBuild`` declares the state every part reads."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from underlay.engines._core import (
    EngineBase,
)
from underlay.engines.mcore import passthrough
from underlay.engines.mcore._chunks import torch_optimizers as _torch_optimizers
from underlay.engines.mcore.config import (
    MCoreArch,
)
from underlay.engines.mcore.options import MCoreOptions
from underlay.engines.mcore.weightmap import Rule
from underlay.interfaces import (
    ConfigError,
    ParallelLayout,
    ProcessGroups,
)
from underlay.interfaces.weightmap import WeightMap


class MCoreBuild(EngineBase):
    """The mcore engine's state and its construction steps (``MCoreEngine.__init__`` runs them)."""

    # what ``MCoreEngine.__init__`` and the construction steps set (every part of the engine reads them)
    _opts: MCoreOptions
    _value: bool
    _arch: MCoreArch
    _torch_device: torch.device
    _fused_elementwise: bool
    _tf_config: Any
    _layout: ParallelLayout
    _pg: dict[str, Any]
    _host_cu_seqlens: bool
    _chunks: list[torch.nn.Module]
    _finalize_model_grads: Any
    _optimizer: Any
    _schedulers: list[Any]
    _weight_map: WeightMap
    _where: dict[str, tuple[int, int, int, Rule]]
    _grads: str  # "clean" | "local" (unreduced, accumulating) | "reduced"
    _skip_next: bool  # a non-finite loss or metric since the last optimizer step
    _masters_stale: bool  # parameters written outside the optimizer (see _sync_master_params)
    _gather_pending: bool  # overlap_param_gather: the step's parameter all-gather not yet finished
    _logprob_kernel: Any

    @staticmethod
    def _init_parallel_state(tp: int, pp: int, vpp: int, cp: int, ep: int, etp: int) -> None:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            have = (
                ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_world_size() or 1,
                ps.get_context_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(),
            )
            if have != (tp, pp, vpp, cp, ep):
                raise ConfigError(
                    f"mcore: megatron's parallel state already holds tp,pp,vpp,cp,ep={have} in this process; "
                    f"an engine with {(tp, pp, vpp, cp, ep)} cannot share it (every mcore engine of a "
                    "process uses one layout)"
                )
            return
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)

    def _build_chunks(self) -> list[torch.nn.Module]:
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel

        from underlay.engines.mcore.layers import block_spec, mark_tensor_parallel, position_embedding_type

        arch = self._arch
        vpp = self._layout.vpp
        chunks: list[torch.nn.Module] = []
        for v in range(vpp):
            vp = v if vpp > 1 else None
            spec = block_spec(
                arch,
                self._tf_config,
                attention=self._config.model.attention,
                vp_stage=vp,
                fused_elementwise=self._fused_elementwise,
            )
            model = GPTModel(
                config=self._tf_config,
                transformer_layer_spec=spec,
                vocab_size=arch.vocab_rows,
                max_sequence_length=arch.max_positions,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                share_embeddings_and_output_weights=arch.tied,
                position_embedding_type=position_embedding_type(),
                rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
                vp_stage=vp,
            )
            if model.post_process and arch.value_head:
                model.output_layer = self._value_head()
            elif model.post_process:
                _return_hidden(model.output_layer, self._tf_config.sequence_parallel)
            # before DDP and the optimizer: both read these attributes (grad norm, optimizer shards)
            mark_tensor_parallel(model)
            if self._layout.etp != self._layout.tp:
                _mark_expert_replicas(model)
            model.to(self._torch_device)
            chunks.append(model)
        return chunks

    def _value_head(self) -> torch.nn.Module:
        """The value model's head for the last stage (replaces the vocabulary output layer); its dropout
        seed differs per data-parallel and per context-parallel rank (and per TP rank under sequence
        parallelism): each of those holds different tokens."""
        from megatron.core import parallel_state as ps

        from underlay.engines.mcore.layers import ValueHead

        a = self._arch
        # CP ranks score different tokens (their own chunks): their masks must be independent too
        rank = ps.get_data_parallel_rank() * self._layout.cp + ps.get_context_parallel_rank()
        if self._tf_config.sequence_parallel:
            rank = rank * self._layout.tp + ps.get_tensor_model_parallel_rank()
        return ValueHead(
            self._tf_config,
            a.hidden,
            bias=a.value_bias,
            dropout=a.value_dropout if self._config.model.training_randomness == "keep" else 0.0,
            seed=self._config.model.seed * 65_537 + rank,
            tp_group=ps.get_tensor_model_parallel_group(),
        )

    def _wrap_ddp(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        ddp_kwargs = dict(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=self._opts.overlap_grad_reduce,
            overlap_param_gather=self._opts.overlap_param_gather,
            use_distributed_optimizer=self._opts.distributed_optimizer,
        )
        merged = passthrough.merge("ddp", DistributedDataParallelConfig, ddp_kwargs, self._opts.ddp)
        ddp_config = passthrough.build("ddp", DistributedDataParallelConfig, merged, self._opts.ddp)
        wrapped = [
            DistributedDataParallel(
                config=self._tf_config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0
            )
            for i, c in enumerate(chunks)
        ]
        # megatron's schedule would call finalize_model_grads at the end of every forward_backward: it
        # reduces (DP, TP-duplicated norms, tied embeddings) the WHOLE grad buffer, so a second call
        # before the optimizer step would reduce the first call's already reduced gradients again.
        # The engine reduces once per optimizer step instead (``finalize_grads``).
        self._tf_config.finalize_model_grads_func = None
        self._finalize_model_grads = finalize_model_grads
        self._tf_config.no_sync_func = (
            [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
        )
        self._tf_config.grad_scale_func = None
        return list(wrapped)

    def _build_optimizer(self) -> None:
        import inspect

        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self._config.optim
        clip = o.grad_clip if o.grad_clip is not None and o.grad_clip > 0 else 0.0
        kind, extra = _megatron_optimizer(o)
        oc_kwargs = dict(
            optimizer=kind,
            **extra,
            lr=o.lr,
            min_lr=0.0,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            clip_grad=clip,
            bf16=self._param_dtype == torch.bfloat16,
            fp16=self._param_dtype == torch.float16,
            params_dtype=self._param_dtype,
            use_distributed_optimizer=self._opts.distributed_optimizer,
            # the optimizer then leaves the parameter all-gather to the next forward's pre-hooks
            overlap_param_gather=self._opts.overlap_param_gather,
        )
        passed = self._opts.optimizer
        merged = passthrough.merge("optimizer", OptimizerConfig, oc_kwargs, passed)
        oc = passthrough.build("optimizer", OptimizerConfig, merged, passed)
        kwargs: dict[str, Any] = {}
        if "config_overrides" in inspect.signature(get_megatron_optimizer).parameters:
            # decay every parameter, as the fsdp2 engine's AdamW does (megatron skips 1-D params by default)
            kwargs["config_overrides"] = {}
        self._optimizer = get_megatron_optimizer(oc, self._chunks, **kwargs)
        from underlay.ops import build_lr_scheduler

        self._schedulers = [build_lr_scheduler(inner, o) for inner in _torch_optimizers(self._optimizer)]


def _compat_shims() -> None:
    """megatron-core 0.16.1 without Transformer Engine: ``moe_utils`` refers to ``te_general_gemm``
    that its failed TE import never bound (``NameError`` in the MoE router; fixed in 0.19). Binding the
    missing name to ``None`` selects its plain ``torch.mm`` path. Touches nothing when the name exists."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _mark_expert_replicas(model: torch.nn.Module) -> None:
    """Mark every expert weight ``allreduce=False`` (megatron's flag for expert-parallel parameters)
    when ``etp != tp``. Megatron sets the flag only with ``ep > 1``; with ``ep == 1`` and ``etp < tp``
    each expert is replicated over ``tp / etp`` TP ranks that route different (sequence-parallel)
    tokens to it, and only the flag puts its gradient in DDP's expert buffers, summed over the expert
    data-parallel group that contains those ranks (unflagged, each rank kept its own tokens' share)."""
    for module in model.modules():
        if getattr(module, "is_expert", False):
            for p in module.parameters(recurse=False):
                p.allreduce = False  # type: ignore[attr-defined]


def _return_hidden(output_layer: Any, sequence_parallel: bool) -> None:
    """Make ``output_layer`` return the final hidden states (gathered along the sequence under sequence
    parallelism) instead of logits: the engine computes log-probs from them with the vocab-parallel
    kernel. The kernel gives every TP rank the full hidden gradient, so the gather's backward takes
    this rank's slice (no reduction)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    def forward(
        hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=ps.get_tensor_model_parallel_group()
            )
        return hidden, None

    output_layer.forward = forward


def _process_groups(ps: Any, *, tp: int, pp: int, cp: int, ep: int, etp: int, dp: int) -> ProcessGroups:
    """The typed groups of the layout from megatron's ``parallel_state`` (``None`` for size-1
    dimensions, as ``ProcessGroups`` specifies; ``mp`` is megatron's model-parallel group tp x pp)."""

    def pick(size: int, get: Any) -> Any:
        return get() if size > 1 else None

    world = dist.get_world_size()
    return ProcessGroups(
        world=dist.group.WORLD,
        dp=pick(dp, ps.get_data_parallel_group),
        dp_cp=pick(dp * cp, lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        tp=pick(tp, ps.get_tensor_model_parallel_group),
        pp=pick(pp, ps.get_pipeline_model_parallel_group),
        cp=pick(cp, ps.get_context_parallel_group),
        ep=pick(ep, ps.get_expert_model_parallel_group),
        etp=pick(etp, ps.get_expert_tensor_parallel_group),
        edp=pick(world // (pp * ep * etp), ps.get_expert_data_parallel_group),
        ulysses=None,
        mp=pick(tp * pp * cp, ps.get_model_parallel_group),
    )


def _megatron_optimizer(o: Any) -> tuple[str, dict[str, Any]]:
    """Megatron-Core's name and extra ``OptimizerConfig`` fields for ``OptimConfig`` ``o``: ``adamw``
    -> ``"adam"`` (megatron's Adam is AdamW: decoupled weight decay), ``sgd`` -> ``"sgd"`` with
    ``sgd_momentum``. ``ConfigError`` for any other optimizer or SGD option megatron does not have."""
    name = o.name.lower()
    if name == "adamw" and not o.options:
        return "adam", {}
    if name == "sgd":
        unknown = sorted(k for k, v in o.options.items() if k != "momentum" and v not in (0, 0.0, False))
        if not unknown:
            return "sgd", {"sgd_momentum": float(o.options.get("momentum", 0.0))}
        raise ConfigError(
            f"the mcore engine's SGD (megatron-core's) takes momentum only; OptimConfig.options sets {unknown}"
        )
    raise ConfigError(
        f"OptimConfig.name={o.name!r} (options {dict(o.options)!r}): the mcore engine runs megatron-core's "
        "optimizers, 'adamw' (no options) and 'sgd' (momentum); use one of them or the fsdp2 engine"
    )
