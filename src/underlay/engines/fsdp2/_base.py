"""The fsdp2 engine's state (``FSDP2Base`` declares what ``FSDP2Engine.__init__`` sets), its
construction helpers (model preparation, buffers, the log-prob kernel, the compile scope) and its
read-only properties."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from underlay.engines._core import EngineBase
from underlay.engines.fsdp2 import _auto
from underlay.engines.fsdp2.act_offload import ActivationOffloader
from underlay.engines.fsdp2.defaults import Resolved
from underlay.engines.fsdp2.options import FSDP2Options
from underlay.engines.fsdp2.parallelize import Meshes
from underlay.engines.fsdp2.single import ComputeCopy
from underlay.interfaces import (
    ParallelLayout,
    ProbeResult,
    RecomputePolicy,
    UnsupportedOperation,
    WeightMap,
)


class FSDP2Base(EngineBase):
    """The fsdp2 engine's state, its construction helpers and its read-only properties
    (``FSDP2Engine.__init__`` sets the state; every part of the engine reads it)."""

    # what ``FSDP2Engine.__init__`` sets (every part of the engine reads them)
    _options: FSDP2Options
    _options_given: FSDP2Options  # the user's, before the auto fields were decided
    _torch_device: torch.device
    _meshes: Meshes
    _dp_group: Any
    _ulysses_group: Any
    _layout: ParallelLayout
    _reference: bool
    _resolved: Resolved
    _recompute: RecomputePolicy
    _keep_unsharded: bool
    _compile_auto: bool
    _compile_warmup: _auto.CompileWarmup
    _act_offload: ActivationOffloader | None
    _weight_map: WeightMap
    _model: torch.nn.Module
    _grads_pending: bool  # whether sharded gradients may exist (see FSDP2Engine.__init__)
    _skip_next: bool  # a non-finite loss or metric since the last optimizer step
    _logprob_kernel: Any
    _optimizer: torch.optim.Optimizer | None
    _scheduler: Any
    _single: ComputeCopy | None  # world size 1 (options.single_device): the compute-dtype copies

    def _trainable(self, what: str) -> torch.optim.Optimizer:
        """The optimizer; ``UnsupportedOperation`` naming ``what`` and the role on a reference engine."""
        if self._optimizer is None:
            raise UnsupportedOperation(
                f"{what}: this fsdp2 engine has EngineConfig.role='reference' (inference only: weights in "
                f"{self._config.param_dtype}, no optimizer, no gradients); build the engine with "
                "role='trainable' to train or save training state"
            )
        return self._optimizer

    # ------------------------------------------------------------------------------ construction

    def _prepare(self, model: torch.nn.Module) -> None:
        from underlay.models import prepare_model

        mc = self._config.model
        prepare_model(
            model,
            attention=mc.attention,
            sp_group=self._ulysses_group,
            tiled_mlp_tiles=mc.tiled_mlp_tiles,
        )

    def _restore_buffers(self, model: torch.nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
        """Buffers were created on the cpu; ``to_empty`` emptied them: put the saved values back on the
        compute device (buffers are not sharded)."""
        for name, value in buffers.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            owner._buffers[leaf] = value.to(self._torch_device)

    def _pick_logprob_kernel(self) -> Any:
        if not self._config.model.fused_head or self._config.model.kind != "causal_lm":
            return None
        from underlay.registry import get_logprob_kernel

        return get_logprob_kernel()

    def _compile_scope(self) -> contextlib.AbstractContextManager[Any]:
        """Where this engine's compiled graphs are traced and partitioned (their first calls, and
        recompiles): ``compile_memory_budget`` is set for that span only, then restored."""
        budget = self._options.compile_memory_budget
        if not self._options.compile:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        if budget is not None:
            import torch._functorch.config as functorch_config

            stack.enter_context(functorch_config.patch(activation_memory_budget=float(budget)))
        if self._compile_auto:
            # compile was the engine's choice, not the user's: a frame torch.compile cannot compile
            # runs eagerly (torch logs why) instead of failing the step
            import torch._dynamo.config as dynamo_config

            stack.enter_context(dynamo_config.patch(suppress_errors=True))
        return stack

    # ------------------------------------------------------------------------------- properties

    @property
    def name(self) -> str:
        """``"fsdp2"``."""
        return "fsdp2"

    @property
    def layout(self) -> ParallelLayout:
        """dp_replicate x dp_shard (Ulysses inside dp_shard); groups ``world``, ``dp`` = ``dp_cp`` (one
        rank per Ulysses group: distinct data), ``ulysses`` = ``mp`` (ranks sharing a data shard),
        ``edp`` (every rank: no expert parallelism) and ``device_mesh`` (the FSDP mesh); a group of
        size 1 is ``None``. tp/pp/cp/ep/etp are 1 and their groups ``None``."""
        return self._layout

    @property
    def options(self) -> FSDP2Options:
        """The engine options in effect: the user's, with every auto field (``None``) decided at build
        (same as ``resolved_options``)."""
        return self._options

    @property
    def activation_offloader(self) -> ActivationOffloader | None:
        """The activation offloader (``options.activation_offload``; its ``stats`` count what moved),
        or ``None``."""
        return self._act_offload

    @property
    def resolved_options(self) -> FSDP2Options:
        """The options in effect, no auto field left (see ``option_reasons`` for why each was chosen)."""
        return self._options

    @property
    def recompute(self) -> str:
        """The recompute policy in effect (``"none"`` or ``"full"``; ``config.recompute="auto"``
        decided by the memory policy)."""
        return self._recompute

    @property
    def option_reasons(self) -> Mapping[str, str]:
        """Why each auto option got its value (``"given"`` for the user's), by option name, plus
        ``"recompute"``."""
        return dict(self._resolved.reasons)

    @property
    def memory_estimate(self) -> Any:
        """The memory policy's decision (``underlay.engines.fsdp2.defaults.MemoryPolicy``: the chosen
        configuration, its estimated device bytes by part, the usable bytes), or ``None`` when the
        user fixed recompute, resharding, optimizer offload and gradient sync."""
        return self._resolved.memory

    @property
    def compile_warmup(self) -> Mapping[str, float]:
        """One-time torch.compile cost so far: ``{"steps": n, "seconds": s, "graphs": g}``: the
        ``forward_backward`` and ``infer`` calls in which torch.compile compiled graphs, their host wall
        time, and the graphs compiled (torch's process-wide counter, read before and after each call).
        Zeros when not compiling."""
        return self._compile_warmup.as_dict()

    def __repr__(self) -> str:
        o = self._options
        return (
            f"FSDP2Engine(world={self._layout.world_size}, dp_shard={self._layout.dp_shard}, "
            f"device={self._device.device_type}, recompute={self._recompute!r}, compile={o.compile!r}, "
            f"compile_memory_budget={o.compile_memory_budget!r}, fused_adamw={o.fused_adamw!r}, "
            f"reshard_after_forward={o.reshard_after_forward!r}, grad_sync={o.grad_sync!r}, "
            f"optimizer_offload={o.optimizer_offload!r}, role={self._config.role!r}, "
            f"training_randomness={self._config.model.training_randomness!r})"
        )

    @property
    def weight_map(self) -> WeightMap:
        """HF names of the parameters (``underlay.engines.fsdp2.weightmap``)."""
        return self._weight_map

    def supports_recompute(self, policy: RecomputePolicy) -> ProbeResult:
        """``"none"`` and ``"full"``; ``"selective"`` is refused (``FSDP2Options.supports_recompute``)."""
        return FSDP2Options.supports_recompute(policy)

    @property
    def model(self) -> torch.nn.Module:
        """The FSDP2-sharded module (a peft ``PeftModel`` when LoRA is configured); with
        ``options.single_device`` (world size 1) the plain module, its parameters the fp32 masters as
        plain tensors (``single.ComputeCopy`` swaps the compute copies in for forward and backward)."""
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the trainable sharded parameters; ``UnsupportedOperation`` for
        ``role="reference"``."""
        return self._trainable("optimizer")

    def _reshard(self) -> None:
        """Free every unsharded parameter: ``FSDPModule.reshard`` acts on its own module's parameters
        only, so each decoder layer is resharded too (with ``reshard_after_forward=False`` a forward
        without backward, as in ``infer`` or a failed micro-batch, leaves the layers unsharded)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self._model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
