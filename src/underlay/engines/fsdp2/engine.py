"""``FSDP2Engine``: the ``ParallelEngine`` protocol on PyTorch FSDP2 (``fully_shard``).

Build order: validate the layout (dp_replicate x dp_shard, Ulysses inside dp_shard; tp/pp/vpp/cp/ep/etp
are refused), build the model with parameters on the meta device (peft LoRA adapters when configured),
activation checkpointing, ``underlay.models.prepare_model`` (attention routing, Ulysses), ``apply_fsdp``
(per decoder layer, then the root), ``to_empty`` on the device and materialise the shards: streamed
from the safetensors of ``config.model.path`` or copied from the seed-initialised cpu model (so the
sharded model equals the single-process model built with the same seed), then AdamW and the LR schedule.

Engine options: ``FSDP2Options`` (``underlay.engines.fsdp2.options``; ``EngineConfig.options`` is a
mapping of its fields or an instance). Its speed and memory fields default to ``None`` (auto) and
``EngineConfig.recompute`` to ``"auto"``: right after the meta model is built they are decided once
(``_auto.resolve_for`` -> the pure ``defaults.resolve``: per-device speed settings, then the memory
policy), logged with their reasons and kept in ``resolved_options``/``option_reasons``/``recompute``.
``single_device`` (auto: at world size 1 when the parameters stay unsharded) skips ``fully_shard``:
fp32 masters in the module, a persistent compute-dtype copy for forwards (``single.ComputeCopy``).
``grad_sync="per_step"`` reduces a ``forward_backward``'s gradients once, at its last micro-batch
(FSDP2's ``set_requires_gradient_sync``; see ``forward_backward``).
Recompute policies: ``"auto"``, ``"none"`` and ``"full"`` (``"selective"`` is refused with the reason,
see ``FSDP2Options.supports_recompute``). ``compile_memory_budget`` is applied
only around this engine's own forward/backward calls (``torch._functorch.config.patch``), where its
compiled graphs are partitioned, so two engines in one process keep their own budgets.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from underlay.engines._buckets import bucket_full_tensors, check_bucket_args
from underlay.engines._core import (
    EngineBase,
    LiveState,
    check_token_batch,
    load_transaction,
    report_nonfinite,
)
from underlay.engines._loss import MetricReducer, check_loss_fn, checked_loss, count_loss
from underlay.engines.fsdp2 import _auto, _build
from underlay.engines.fsdp2.act_offload import ActivationOffloader, install_activation_offload
from underlay.engines.fsdp2.options import FSDP2Options
from underlay.engines.fsdp2.parallelize import (
    apply_activation_checkpointing,
    apply_fsdp,
    build_layout,
    build_meshes,
    compile_layer_parts,
    decoder_layers,
    mp_policy_for,
    offload_policy_for,
    torch_dtype,
    validate_ulysses,
)
from underlay.engines.fsdp2.single import ComputeCopy, check_single_device, to_empty_keeping_ties
from underlay.engines.fsdp2.weightmap import fsdp2_weight_map, persistent_buffers
from underlay.interfaces import (
    CheckpointError,
    ConfigError,
    Device,
    EngineConfig,
    InvalidInput,
    LossFn,
    OptimizerStepResult,
    ParallelLayout,
    ProbeResult,
    ProcessGroups,
    RecomputePolicy,
    StepResult,
    TokenBatch,
    TokenOutputs,
    UnsupportedOperation,
    WeightMap,
    resolve_options,
)
from underlay.parallel.agree import agreed
from underlay.parallel.rank import current_rank

__all__ = ["FSDP2Engine"]

_STATE_FILE = "engine_state.pt"
_SIGNATURE_FILE = "engine_signature.json"


class FSDP2Engine(EngineBase):
    """A model sharded with FSDP2 over the default process group, with AdamW and an LR schedule.

    Collective: every rank of the default process group constructs it (a single process without a
    group starts a 1-rank group through ``underlay.parallel.init_distributed``). Raises ``ConfigError``
    for unknown or invalid options, an unsupported recompute policy (both before any work), tp/pp/vpp/
    cp/ep/etp > 1, a world size that ``dp_replicate`` or ``ulysses`` does not divide, attention heads
    the Ulysses head rule refuses, or a model directory without ``config.json``.
    """

    Options = FSDP2Options
    """The options dataclass of this engine (``EngineConfig.options``)."""

    def __init__(self, config: EngineConfig, device: Device) -> None:
        from underlay.parallel.distributed import init_distributed

        options: FSDP2Options = resolve_options(FSDP2Options, config.options, "fsdp2")
        support = FSDP2Options.supports_recompute(config.recompute)  # before any work
        if not support.available:
            raise ConfigError(
                f"EngineConfig.recompute={config.recompute!r}: {support.reason}; {support.hint}"
            )
        if not dist.is_initialized():
            init_distributed(device)
        self._config = config
        self._options = options
        self._device = device
        world = dist.get_world_size()
        layout = build_layout(config.parallel, world)
        self._hf_config = _build.hf_config_of(config.model)
        validate_ulysses(self._hf_config, layout.ulysses)
        self._torch_device = device.torch_device() if device.is_accelerator else torch.device("cpu")
        self._meshes = build_meshes(layout, device.device_type)
        # the engine's own collectives use these handles (a size-1 group is still a real group here)
        self._dp_group = self._meshes.group("dp")
        self._ulysses_group = self._meshes.group("ulysses") if layout.ulysses > 1 else None
        self._layout = ParallelLayout(
            world_size=layout.world_size,
            dp_replicate=layout.dp_replicate,
            dp_shard=layout.dp_shard,
            ulysses=layout.ulysses,
            groups=ProcessGroups(
                world=dist.group.WORLD if world > 1 else None,
                dp=self._dp_group if layout.dp > 1 else None,
                dp_cp=self._dp_group if layout.dp > 1 else None,
                edp=dist.group.WORLD if world > 1 else None,
                ulysses=self._ulysses_group,
                mp=self._ulysses_group,
                device_mesh=self._meshes.fsdp,
            ),
        )
        self._param_dtype = torch_dtype(config.param_dtype)
        self._reference = config.role == "reference"
        if self._reference and options.optimizer_offload:
            raise ConfigError(
                "FSDP2Options.optimizer_offload=True with EngineConfig.role='reference': a reference "
                "engine has no optimizer; leave optimizer_offload unset"
            )
        model = _build.build_model(config.model, self._hf_config, meta=True)
        if self._reference:  # the weights themselves in the compute dtype: no fp32 master copy
            _build.frozen_in_dtype(model, self._param_dtype)
        # the auto options (None) and recompute="auto" are decided once, here, and logged
        self._options_given = options
        self._resolved = _auto.resolve_for(model, self._hf_config, config, options, device, layout)
        options = self._resolved.options
        self._options = options
        self._recompute = self._resolved.recompute
        check_single_device(
            bool(options.single_device),
            self._options_given.single_device,
            world,
            config.cpu_offload,
            bool(options.reshard_after_forward),
        )
        # parameters stay unsharded from forward to backward: then also from one micro-batch to the next
        self._keep_unsharded = not options.reshard_after_forward and not options.single_device
        buffers = {n: b for n, b in model.named_buffers()}
        apply_activation_checkpointing(model, self._recompute)
        self._prepare(model)
        compile_opt = options.compile
        self._compile_auto = self._resolved.reasons.get("compile") != "given" and bool(compile_opt)
        self._compile_warmup = _auto.CompileWarmup()
        if compile_opt:
            compile_layer_parts(
                model,
                backend=_compile_backend(),
                scope="layer_parts" if compile_opt is True else str(compile_opt),
                dynamic=True if self._recompute == "full" else None,
            )
        # outermost around each layer's (compiled, checkpointed) forward: see act_offload
        self._act_offload = install_activation_offload(model, device, options)
        if not options.single_device:
            apply_fsdp(
                model,
                self._meshes.fsdp,
                mp_policy_for(config.param_dtype, config.reduce_dtype),
                offload_policy_for(config.cpu_offload, pin_memory=device.is_accelerator),
                reshard_after_forward=not self._keep_unsharded,
            )
        self._weight_map = fsdp2_weight_map(
            [*model.named_parameters(remove_duplicate=False), *persistent_buffers(model)],
            self._hf_config,
            config.model.kind,
        )
        if options.single_device:
            to_empty_keeping_ties(model, self._torch_device)
        else:
            model.to_empty(device="cpu" if config.cpu_offload else self._torch_device)
        self._restore_buffers(model, buffers)
        self._model = model
        self._materialise()
        # world size 1 (options.single_device): fp32 masters registered, a compute copy for forwards
        self._single = (
            ComputeCopy(model, self._param_dtype, [model, *decoder_layers(model)])
            if options.single_device
            else None
        )
        self._global_step = 0
        # whether sharded gradients may exist: a forward_backward completed since the last zero_grad
        self._grads_pending = False
        self._skip_next = False  # a non-finite loss or metric since the last optimizer step
        self._offloaded: dict[str, Any] = {}
        self._adapter_disabled = False
        self._logprob_kernel = self._pick_logprob_kernel()
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        if not self._reference:
            self._build_optimizer(model, options, device)

    def _build_optimizer(self, model: torch.nn.Module, options: FSDP2Options, device: Device) -> None:
        """The optimizer over the trainable sharded parameters and its LR schedule."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        fused = bool(options.fused_adamw) and device.is_accelerator
        optim = self._config.optim
        optimizer: torch.optim.Optimizer
        if optim.name.lower() != "adamw":
            optimizer = _named_optimizer(trainable, optim, bool(options.optimizer_offload))
        elif options.optimizer_offload:
            from underlay.engines.fsdp2.optim_offload import HostOffloadAdamW

            optimizer = HostOffloadAdamW(
                trainable,
                lr=optim.lr,
                betas=optim.betas,
                eps=optim.eps,
                weight_decay=optim.weight_decay,
                fused=fused,
                pin_memory=device.is_accelerator,
            )
        else:
            optimizer = torch.optim.AdamW(
                trainable,
                lr=optim.lr,
                betas=optim.betas,
                eps=optim.eps,
                weight_decay=optim.weight_decay,
                **({"fused": True} if fused else {"foreach": True}),
            )
        from underlay.ops import build_lr_scheduler

        self._optimizer = optimizer
        self._scheduler = build_lr_scheduler(optimizer, optim)

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

    def _materialise(self) -> None:
        """Fill the shards: from the safetensors of ``model.path`` (a value head or LoRA adapters the
        files lack are initialised from the seed), or entirely from the seed."""
        from underlay.engines._value_head import refuse_unread_tensors
        from underlay.engines.fsdp2.weights import load_hf_into

        mc = self._config.model
        fill: set[str] | None = None
        if mc.path is not None and mc.load_weights:
            # strict for value models too: only their score head is optional (lm_head is ignored), so
            # a router or expert the map cannot find is an error, never a seed-initialised tensor
            report = load_hf_into(self, mc.path, strict=True)
            fill = set()
            for hf in report.missing:
                rule = self._weight_map.rule_for_hf(hf)
                if rule is not None:
                    fill.add(rule.engine_name)
            if fill and mc.kind == "value":  # no head in the files: none under another name either
                rows = int(self._hf_config.get_text_config().vocab_size)
                refuse_unread_tensors(mc.path, self._weight_map, rows, "fsdp2")
            if not fill and mc.lora is None:
                return
        full = _build.seeded_state(mc, self._hf_config)
        if mc.lora is not None and mc.lora.adapter_path is not None:
            adapters = _build.adapter_tensors(mc.lora)
            live = {n for n, _ in self._model.named_parameters() if "lora_" in n}
            if set(adapters) != live:
                raise CheckpointError(
                    f"LoraConfig.adapter_path={mc.lora.adapter_path!r} does not fit the adapted model: missing "
                    f"{sorted(live - set(adapters))[:4]}, unexpected {sorted(set(adapters) - live)[:4]}"
                )
            full.update(adapters)
        for name, param in self._model.named_parameters():
            if fill is None or "lora_" in name or name in fill:
                _build.copy_into_param(param, full[name], name)

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

    # --------------------------------------------------------------------------------- compute

    def _check_batch(self, batch: TokenBatch) -> TokenBatch:
        """``batch`` validated (``_core.check_token_batch``, then the vision inputs) and on the device;
        ``InvalidInput`` before any state changes."""
        check_token_batch(batch, int(getattr(self._hf_config, "vocab_size", 0) or 0), shared_prompts=True)
        from underlay.models import check_vision_batch

        check_vision_batch(self._hf_config, batch)
        if batch.prompt_groups is not None:
            from underlay.models.shared_prompts import check_shared_prompts

            if self._ulysses_group is not None:
                raise InvalidInput(
                    f"TokenBatch.prompt_groups with Ulysses (ulysses={self._layout.ulysses}): shared prompts "
                    "need each group's whole stream on one rank; give the batch without prompt_groups"
                )
            check_shared_prompts(self._model)
        return batch.to(self._torch_device)

    def _plan(self, batch: TokenBatch) -> list[list[int]]:
        from underlay.models import sequence_costs
        from underlay.ops import plan_micro_batches

        if batch.prompt_groups is not None:  # whole groups, each costing the tokens it computes shared
            from underlay.ops.prompt_sharing import shared_prompt_costs

            rows_of, costs = shared_prompt_costs(batch.input_ids, batch.attention_mask, batch.prompt_groups)
            big = max(range(len(costs)), key=costs.__getitem__)
            if costs[big] > self._config.micro_batch_max_tokens:
                raise InvalidInput(
                    f"TokenBatch.prompt_groups: the group of rows {rows_of[big]} computes {costs[big]} tokens "
                    f"shared > micro_batch_max_tokens={self._config.micro_batch_max_tokens} (a group stays in "
                    "one micro-batch); raise micro_batch_max_tokens or give the batch without prompt_groups"
                )
            plan = plan_micro_batches(costs, self._config.micro_batch_max_tokens, group=self._dp_group)
            return [[r for g in mb for r in rows_of[g]] for mb in plan]
        # tokens, plus the vision patches of a row's images weighted by models.patch_cost
        seqlens = sequence_costs(self._hf_config, batch)
        return plan_micro_batches(seqlens, self._config.micro_batch_max_tokens, group=self._dp_group)

    def _forward(self, batch: TokenBatch, temperature: float, with_entropy: bool) -> TokenOutputs:
        """Packed forward of one micro-batch (shared prompts with ``prompt_groups``); outputs padded
        back to ``[b, S]``."""
        from underlay.models import packed_forward
        from underlay.ops import pad, unpad

        if batch.prompt_groups is not None:
            from underlay.models.shared_prompts import shared_prompt_forward
            from underlay.ops.prompt_sharing import share_prompts

            shared = share_prompts(batch.input_ids, batch.attention_mask, batch.prompt_groups)
            packed = shared.packed
            with self._compile_scope():
                out = shared_prompt_forward(
                    self._model,
                    shared,
                    temperature=temperature,
                    with_entropy=with_entropy,
                    logprob_kernel=self._logprob_kernel,
                )
            return TokenOutputs(
                *(None if t is None else pad(t, packed) for t in (out.log_probs, out.entropy, out.values))
            )
        packed = unpad(batch.input_ids, batch.attention_mask)
        multimodal, zero_passes = self._vision_inputs(batch)
        with self._compile_scope():  # AOTAutograd partitions forward/backward when forward compiles
            out = packed_forward(
                self._model,
                packed,
                temperature=temperature,
                with_entropy=with_entropy,
                logprob_kernel=self._logprob_kernel,
                sp_group=self._ulysses_group,
                multimodal=multimodal,
                zero_vision_passes=zero_passes,
            )

        def back(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else pad(t, packed)

        return TokenOutputs(back(out.log_probs), back(out.entropy), back(out.values), out.aux_loss)

    def _vision_inputs(self, batch: TokenBatch) -> tuple[dict[str, torch.Tensor] | None, int]:
        """A vision-language micro-batch's ``multimodal`` inputs, and how many zero-weight vision
        passes this rank adds: the vision blocks are FSDP units, so every rank runs the tower as many
        times as the rank with the most (images: one run, videos: another; agreed by one all-reduce
        over the world per micro-batch, only for VLMs on more than one rank)."""
        from underlay.models import is_vision_config, multimodal_inputs, vision_calls

        if not is_vision_config(self._hf_config):
            return None, 0
        calls = vision_calls(batch)
        most = calls
        if self._layout.world_size > 1:
            agreed_calls = torch.tensor([calls], dtype=torch.int64, device=self._torch_device)
            dist.all_reduce(agreed_calls, op=dist.ReduceOp.MAX)
            most = int(agreed_calls.item())
        return multimodal_inputs(batch), most - calls

    def forward_backward(self, batch: TokenBatch, loss_fn: LossFn) -> StepResult:
        """Accumulate gradients of the sum of ``loss_fn``'s contributions over ``batch`` (this rank's
        share; loss contract v3, ``interfaces.LossFn``).

        Micro-batches come from ``ops.plan_micro_batches`` (same count on every dp rank); each is
        packed, run through ``models.packed_forward``, padded back and handed to ``loss_fn`` with its
        ``LossContext`` (global counts once per Ulysses group, ``engines._loss``). Every contribution
        is scaled by ``world_size`` before backward, which undoes FSDP's mean over ranks: gradients sum
        over micro-batches and dp ranks. Metrics reduce as declared (``"loss"``: the sum of the
        contributions).

        Gradient sync (``options.grad_sync``): ``"per_micro_batch"`` reduce-scatters each micro-batch's
        gradients into the sharded ones; ``"per_step"`` only at the last micro-batch (FSDP2 accumulates
        the unsharded gradients in the reduce dtype until then), when the plan has more than one
        micro-batch and no gradients are pending from an earlier call before the optimizer step (that
        call then syncs per micro-batch, so unsharded and sharded gradients never add up). The same
        gradients up to floating-point summation order. An exception leaves no gradient behind (the
        earlier calls' included), resets FSDP's per-iteration state and restores gradient sync."""
        self._trainable("forward_backward")
        check_loss_fn(loss_fn)
        if self._adapter_disabled:
            raise InvalidInput(
                "forward_backward inside disable_adapter(): the adapters are bypassed there, nothing would "
                "train; leave the block first (use it for the reference log-probs of infer)"
            )
        batch = self._check_batch(batch)
        self._ensure_onloaded("forward_backward")
        dp_group = self._dp_group
        counts = count_loss(batch.loss_mask, dp_group, self._layout.dp, self._torch_device)
        reducer = MetricReducer(self._torch_device)
        scale = self._layout.world_size  # FSDP averages gradients over every rank: sum instead
        plan = self._plan(batch)
        from underlay.models.randomness import set_training_mode

        set_training_mode(self._model, self._config.model.training_randomness)
        # the same on every rank: the plan has as many micro-batches on every dp rank, and the
        # pending flag follows the calls, which are collective
        sync_once = self._options.grad_sync == "per_step" and len(plan) > 1 and not self._grads_pending
        completed = False
        filled: list[_ZeroFilled] = []
        warm = self._compile_warmup.start() if self._options.compile else None
        if self._single is not None:  # the compute copies stay in for backward and recomputation
            self._single.swap_in()
        try:
            for i, idx in enumerate(plan):
                last = i == len(plan) - 1
                # with reshard_after_forward=False the parameters are unsharded for the whole
                # micro-batch anyway: keep them so until the last backward (no all-gather per micro-batch)
                self._set_reshard_after_backward(not self._keep_unsharded or last)
                if sync_once:
                    self._set_requires_gradient_sync(last)
                    if last:
                        filled = _fill_late_accumulators(self._model)
                if not idx:
                    self._dummy_backward(batch)
                    continue
                sub = batch.select(idx)
                outputs = self._forward(sub, self._config.temperature, self._config.with_entropy)
                ctx = counts.context(i, len(plan), idx, sub.loss_mask)
                loss, metrics = checked_loss(loss_fn(outputs, sub, ctx))
                (loss * scale).backward()  # type: ignore[no-untyped-call]
                reducer.add(loss, metrics)
            completed = True
        finally:
            if self._single is not None:
                self._single.swap_out()
            _unfill(filled, completed)
            if sync_once:
                self._set_requires_gradient_sync(True)  # after a failure too: the next call syncs
            if not completed:
                # a failed micro-batch must not leak the earlier ones' gradients into the next step
                self._drop_unreduced_grads()
                self.zero_grad()
            if self._keep_unsharded:
                self._set_reshard_after_backward(True)
                self._reshard()  # after a failed micro-batch too: the optimizer works on the shards
        self._grads_pending = True
        if warm is not None:
            self._compile_warmup.stop(warm, self._global_step, self._compile_auto)
        metrics_out = reducer.reduce(dp_group, self._layout.dp)
        if report_nonfinite("forward_backward", metrics_out, reducer.local(), self._torch_device):
            self._skip_next = True
        return StepResult(metrics_out, len(plan), counts.global_tokens, counts.global_sequences)

    def _dummy_backward(self, batch: TokenBatch) -> None:
        """This rank has no sequence for a micro-batch that other dp ranks run: take part in FSDP's
        collectives with a one-token forward whose loss is multiplied by zero."""
        from underlay.models import is_vision_config

        sub = batch.select([0])
        ids = sub.input_ids[:, :1]
        if is_vision_config(self._hf_config):  # token 0, never an image placeholder without its image
            ids = torch.zeros_like(ids)
        one = TokenBatch(
            ids,
            torch.ones_like(sub.attention_mask[:, :1]),
            torch.zeros_like(sub.loss_mask[:, :1]),
        )
        out = self._forward(one, self._config.temperature, False)
        tensor = out.values if out.values is not None else out.log_probs
        assert tensor is not None
        (tensor.sum() * 0.0).backward()  # type: ignore[no-untyped-call]

    @torch.no_grad()
    def infer(
        self, batch: TokenBatch, *, temperature: float | None = None, with_entropy: bool = False
    ) -> TokenOutputs:
        """Per-token log-probs (causal LM; entropy when ``with_entropy``) or values (value model),
        ``[B, S]`` fp32 on the device, rows in the order of ``batch``; 0 at position 0 and padding."""
        batch = self._check_batch(batch)
        self._ensure_onloaded("infer")
        temp = self._config.temperature if temperature is None else temperature
        ok = isinstance(temp, (int, float)) and not isinstance(temp, bool)
        if not (ok and math.isfinite(temp) and temp > 0):
            raise InvalidInput(f"infer: temperature={temp!r} must be a finite number > 0")
        self._model.eval()
        shape = tuple(batch.input_ids.shape)
        result: dict[str, torch.Tensor] = {}
        warm = self._compile_warmup.start() if self._options.compile else None
        for idx in self._plan(batch):
            if not idx:
                self._forward(batch.select([0]), temp, False)
                continue
            with self._compute_view():
                out = self._forward(batch.select(idx), temp, with_entropy)
            rows = torch.as_tensor(idx, device=self._torch_device)
            for key in ("log_probs", "entropy", "values"):
                t = getattr(out, key)
                if t is not None:
                    buf = result.setdefault(
                        key, torch.zeros(shape, dtype=torch.float32, device=self._torch_device)
                    )
                    buf[rows] = t.to(torch.float32)
        self._reshard()
        if warm is not None:  # inference compiles its own (no-grad) graphs once too
            self._compile_warmup.stop(warm, self._global_step, self._compile_auto)
        return TokenOutputs(result.get("log_probs"), result.get("entropy"), result.get("values"))

    def _compute_view(self) -> contextlib.AbstractContextManager[Any]:
        """World size 1 (``options.single_device``): the modules hold the compute-dtype copies inside
        (``single.ComputeCopy``); under FSDP2 nothing to do."""
        return self._single.compute_view() if self._single is not None else contextlib.nullcontext()

    def _set_reshard_after_backward(self, value: bool) -> None:
        setter = getattr(self._model, "set_reshard_after_backward", None)
        if callable(setter):
            setter(value)

    def _set_requires_gradient_sync(self, value: bool) -> None:
        """Whether the next backward reduce-scatters gradients, for the root and every layer."""
        setter = getattr(self._model, "set_requires_gradient_sync", None)
        if callable(setter):
            setter(value)

    def _drop_unreduced_grads(self) -> None:
        """After a failed ``forward_backward``: reset FSDP's per-iteration state (in-flight collectives
        waited on, parameters resharded, the backward bookkeeping of an interrupted backward cleared)
        and drop the unsharded gradients FSDP holds between backward passes: the reduce-dtype
        accumulation of ``grad_sync="per_step"`` and a layer's gradient whose reduction never ran
        (``reset_iter_state`` keeps both, and the next backward would add to them). These live on
        FSDP2's internal ``FSDPParam`` objects (torch 2.13: ``unsharded_accumulated_grad`` and
        ``_unsharded_param``); ``tests/distributed/test_fsdp2_grad_sync.py`` checks that the step after
        a failure equals a clean one."""
        reset = getattr(self._model, "reset_iter_state", None)
        if callable(reset):
            reset()
        for fsdp_param in _fsdp_params(self._model):
            if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None

    def _reshard(self) -> None:
        """Free every unsharded parameter: ``FSDPModule.reshard`` acts on its own module's parameters
        only, so each decoder layer is resharded too (with ``reshard_after_forward=False`` a forward
        without backward, as in ``infer`` or a failed micro-batch, leaves the layers unsharded)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self._model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def zero_grad(self) -> None:
        """Drop accumulated gradients (set to ``None``); nothing to drop for ``role="reference"``."""
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=True)
        self._grads_pending = False
        self._skip_next = False

    def optimizer_step(self) -> OptimizerStepResult:
        """Clip to ``optim.grad_clip`` by the global L2 norm over all shards, then step AdamW; a
        non-finite norm, or a non-finite loss/metric in a ``forward_backward`` since the last step or
        ``zero_grad``, skips the update on every rank. Gradients are zeroed in both cases;
        ``global_step`` grows. ``UnsupportedOperation`` for ``role="reference"``."""
        optimizer = self._trainable("optimizer_step")
        self._ensure_onloaded("optimizer_step")
        params = [p for p in self._model.parameters() if p.requires_grad and p.grad is not None]
        lr = float(optimizer.param_groups[0]["lr"])
        clip = self._config.optim.grad_clip
        if params:
            if clip is not None and clip > 0:
                norm_t = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            else:
                norm_t = torch.nn.utils.get_total_norm(
                    [p.grad for p in params if p.grad is not None], foreach=True
                )
            if isinstance(norm_t, DTensor):
                norm_t = norm_t.full_tensor()
            norm = float(norm_t.item())
        else:
            norm = 0.0
        # a non-finite loss or metric since the last step (reported by forward_backward) skips too
        skipped = not math.isfinite(norm) or self._skip_next
        if not skipped:
            optimizer.step()
            if self._single is not None:
                self._single.invalidate()
        self.zero_grad()
        self._global_step += 1
        return OptimizerStepResult(grad_norm=norm, skipped=skipped, lr=lr)

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule one step; returns the new learning rate. ``UnsupportedOperation`` for
        ``role="reference"``."""
        optimizer = self._trainable("lr_scheduler_step")
        self._scheduler.step()
        return float(optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------------------ offloading

    def offload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move parameters, gradients and/or optimizer state to host memory and release the device
        memory (``device.empty_cache``). Idempotent per kind. With ``cpu_offload`` the sharded
        parameters already live on the host and stay there. A reference engine has only parameters
        (``grads``/``optimizer`` move nothing)."""
        host = torch.device("cpu")
        pin = self._device.is_accelerator
        if self._act_offload is not None:
            self._act_offload.release()  # held activations and the free pinned buffers
        if grads and "grads" not in self._offloaded:
            saved = {}
            for i, p in enumerate(self._model.parameters()):
                if p.grad is not None:
                    saved[i] = _to_host(p.grad, pin)
                    p.grad = None
            self._offloaded["grads"] = saved
        if optimizer and "optimizer" not in self._offloaded and self._optimizer is not None:
            state: dict[int, dict[str, Any]] = {}
            # optimizer_offload: the AdamW state already lives in host memory; nothing to move
            host_state = bool(self._options.optimizer_offload)
            for i, group_param in enumerate([] if host_state else _optim_params(self._optimizer)):
                entry = self._optimizer.state.get(group_param)
                if entry:
                    state[i] = {k: _to_host(v, pin) for k, v in entry.items()}
                    self._optimizer.state[group_param] = {}
            self._offloaded["optimizer"] = state
        if params and "params" not in self._offloaded:
            if self._single is not None:
                self._single.release()  # rebuilt from the masters at the next forward
            if not self._config.cpu_offload and self._device.is_accelerator:
                self._model.to(host)
            self._offloaded["params"] = True
        self._device.synchronize()
        self._device.empty_cache()

    def onload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Bring offloaded state back to where it lived before ``offload``; values are bit-identical."""
        moved = params and self._offloaded.pop("params", None) is not None
        if moved and not self._config.cpu_offload and self._device.is_accelerator:
            self._model.to(self._torch_device)
        if grads and "grads" in self._offloaded:
            saved = self._offloaded.pop("grads")
            for i, p in enumerate(self._model.parameters()):
                if i in saved:
                    p.grad = _to_device(saved[i])
        if optimizer and "optimizer" in self._offloaded and self._optimizer is not None:
            state = self._offloaded.pop("optimizer")
            for i, group_param in enumerate(_optim_params(self._optimizer)):
                if i in state:
                    self._optimizer.state[group_param] = {k: _to_device(v) for k, v in state[i].items()}
        self._device.synchronize()

    # ----------------------------------------------------------------------------------- weights

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) parameters by engine name (fp32; ``param_dtype`` for ``role="reference"``), in ``weight_map.rules`` order, one at a time;
        LoRA adapters are merged into their base weights (``W + scaling * B @ A``) and not yielded.
        Collective: every rank iterates and receives every tensor, on the compute device. On a world
        of 1 a tensor may share storage with the live parameter: clone it to keep it across
        optimizer steps."""
        self._ensure_onloaded("weights")
        self._reshard()
        lora = _lora_modules(self._model)
        params = self._params_by_name()
        for rule in self._weight_map.rules:
            name = rule.engine_name
            full = self._full(params[name])
            prefix = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
            if prefix is not None and prefix in lora and name.endswith(".base_layer.weight"):
                module = lora[prefix]
                for adapter in module.active_adapters:
                    a = self._full(params[f"{prefix}.lora_A.{adapter}.weight"])
                    b = self._full(params[f"{prefix}.lora_B.{adapter}.weight"])
                    full = full + module.scaling[adapter] * (b @ a)
            yield name, full

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``named_full_parameters`` converted to Hugging Face tensors by ``weight_map`` (fp32, one
        engine parameter at a time). Collective."""
        yield from self._weight_map.to_hf(self.named_full_parameters())

    def copy_full_parameter(self, engine_name: str, full: torch.Tensor) -> int:
        """Copy this rank's FSDP shard of ``full`` into parameter ``engine_name`` (no communication;
        every rank passes the same tensor). ``InvalidInput`` for an unknown name, ``CheckpointError``
        for a shape mismatch, before writing. Returns the bytes written on this rank."""
        param = self._params_by_name().get(engine_name)
        if param is None:
            raise InvalidInput(f"copy_full_parameter: the model has no parameter {engine_name!r}")
        return _build.copy_into_param(param, full, engine_name)

    def _params_by_name(self) -> dict[str, torch.Tensor]:
        # persistent buffers (routing biases) load and export like parameters (see fsdp2_weight_map)
        return {**dict(persistent_buffers(self._model)), **dict(self._model.named_parameters())}

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Inside the block the LoRA adapters are bypassed: ``infer`` gives the base model's outputs
        (the reference policy of LoRA RL, without a second copy of the model). ``forward_backward``
        inside it raises ``InvalidInput`` (nothing trains there). ``InvalidInput`` for an engine
        without LoRA. Not re-entrant; every rank enters it together."""
        toggle = getattr(self._model, "disable_adapter", None)
        if self._config.model.lora is None or toggle is None:
            raise InvalidInput("disable_adapter: the engine has no LoRA adapters (ModelConfig.lora is None)")
        if self._adapter_disabled:
            raise InvalidInput("disable_adapter: already inside a disable_adapter() block")
        self._adapter_disabled = True
        try:
            with toggle():
                yield
        finally:
            self._adapter_disabled = False

    def named_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full LoRA adapter tensors (peft names without the ``.default`` adapter segment, as
        ``PeftModel.save_pretrained`` writes them), one at a time. Empty without LoRA. Collective."""
        self._reshard()
        for name, param in self._model.named_parameters():
            if "lora_" in name:
                yield name.replace(".default.", "."), self._full(param)

    def _full(self, param: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return param.detach().to(self._torch_device)
        dt: DTensor = param
        local = dt.to_local()
        if local.device.type != dt.device_mesh.device_type:
            dt = DTensor.from_local(
                local.to(self._torch_device),
                dt.device_mesh,
                dt.placements,
                shape=dt.shape,
                stride=dt.stride(),
            )
        with torch.no_grad():
            return dt.full_tensor()

    def iter_weights(
        self, bucket_bytes: int = 1 << 29, *, ranks: Collection[int] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of ``(hf_name, full tensor)`` in ``param_dtype`` on the device, each about
        ``bucket_bytes`` (a tensor larger than that gets a bucket of its own); LoRA: merged weights.
        Collective. ``ranks``: the global ranks that receive tensors (``None``: all); the others get
        the same number of buckets, each empty. Every tensor is all-gathered by FSDP on every rank,
        so a non-receiver holds one gathered tensor at a time (dropped at once), never a bucket.
        ``InvalidInput`` for ``bucket_bytes < 1`` or a rank outside the world, before any collective."""
        receive = check_bucket_args(bucket_bytes, ranks, self._layout.world_size)
        yield from bucket_full_tensors(self.named_full_tensors(), bucket_bytes, self._param_dtype, receive)

    # ------------------------------------------------------------------------------ checkpoints

    def model_signature(self) -> Mapping[str, Any]:
        """Architecture, kind, LoRA rank, and every parameter's engine name and full shape."""
        cfg = self._hf_config
        lora = self._config.model.lora
        return {
            "engine": "fsdp2",
            "architecture": type(cfg).__name__,
            "model_type": getattr(cfg, "model_type", None),
            "kind": self._config.model.kind,
            "lora_rank": lora.rank if lora is not None else None,
            "params": {n: list(p.shape) for n, p in self._model.named_parameters()},
        }

    def save_checkpoint(self, directory: Path) -> None:
        """Sharded model and optimizer state with ``torch.distributed.checkpoint`` (loadable at another
        world size), plus the LR schedule, ``global_step`` and the model signature (rank 0).
        ``directory`` must exist. Collective. ``UnsupportedOperation`` for ``role="reference"`` (no
        training state to save; ``export_hf`` writes its weights)."""
        optimizer = self._trainable("save_checkpoint")
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        self._ensure_onloaded("save_checkpoint")
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(f"save_checkpoint: {directory} is not an existing directory")
        self._reshard()
        state = {
            "model": get_model_state_dict(self._model),
            "optim": get_optimizer_state_dict(self._model, optimizer),
        }
        try:
            dcp_save(state, checkpoint_id=str(directory))
        except CheckpointException as exc:  # a BaseException: convert so callers can handle it
            raise CheckpointError(
                f"save_checkpoint({directory}): {str(exc).strip().splitlines()[-1]}"
            ) from exc
        # rank 0 writes alone: every rank raises its reason instead of waiting in the next collective
        with agreed(f"save_checkpoint({directory})", error_type=CheckpointError):
            if current_rank() == 0:
                extra = {"global_step": self._global_step, "scheduler": self._scheduler.state_dict()}
                torch.save(extra, directory / _STATE_FILE)
                (directory / _SIGNATURE_FILE).write_text(json.dumps(self.model_signature(), sort_keys=True))

    def check_signature(self, directory: Path) -> None:
        """Raise ``CheckpointError`` unless ``directory`` holds an engine checkpoint of this model
        (same architecture, kind, LoRA rank, parameter names and shapes). Changes nothing."""
        sig_path = Path(directory) / _SIGNATURE_FILE
        if not sig_path.is_file() or not (Path(directory) / _STATE_FILE).is_file():
            raise CheckpointError(
                f"{directory} is not a complete fsdp2 engine checkpoint (missing {_SIGNATURE_FILE} or "
                f"{_STATE_FILE}); pass a directory written by save_checkpoint"
            )
        try:
            saved = json.loads(sig_path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{sig_path} is not valid JSON ({exc}); the checkpoint is corrupt") from exc
        mine = json.loads(json.dumps(self.model_signature()))
        diff = signature_diff(saved, mine)
        if diff:
            raise CheckpointError(
                f"checkpoint {directory} belongs to another model: {diff}; load it into an engine built "
                "from the same model config"
            )

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what ``save_checkpoint`` wrote, at any world size. The signature is checked first:
        ``CheckpointError`` before any state changes when it belongs to another model or shape.
        ``role="reference"``: the weights (rounded to ``param_dtype``) and ``global_step`` of a trainable
        engine's checkpoint; its optimizer state and LR schedule are not read."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from underlay.utils.safe_dcp import safe_dcp_load

        directory = Path(directory)
        self.check_signature(directory)
        self._ensure_onloaded("load_checkpoint")
        try:
            extra = torch.load(directory / _STATE_FILE, weights_only=True)
            step = extra["global_step"]
            scheduler_state = extra["scheduler"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"global_step={step!r} is not an int >= 0")
            if not isinstance(scheduler_state, dict):
                raise ValueError(f"scheduler state is a {type(scheduler_state).__name__}, not a dict")
        except Exception as exc:
            raise CheckpointError(f"{directory / _STATE_FILE}: unreadable engine state ({exc})") from exc
        self._reshard()
        if self._optimizer is None:
            self._load_reference_weights(directory, step)
            return
        # load into copies: the live weights and optimizer state change only after the whole
        # checkpoint was read (a corrupt shard fails here with the run's state untouched)
        model_sd = _fresh(get_model_state_dict(self._model))
        optim_sd = _fresh(get_optimizer_state_dict(self._model, self._optimizer))
        # a parameter that never had a gradient when the checkpoint was saved (a vision tower in
        # text-only training, an unused expert) has no optimizer state there; torch's template for
        # this engine has one for every parameter: those entries are not read, and dropped after
        stateless = {fqn: optim_sd["state"].pop(fqn) for fqn in _stateless_params(optim_sd, directory)}
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        live = LiveState(
            [*self._model.parameters(), *_optim_params(self._optimizer)], [self._optimizer], [self._scheduler]
        )
        with load_transaction(f"load_checkpoint({directory})", live):
            safe_dcp_load(state, directory)
            set_model_state_dict(self._model, model_sd)
            optim_sd["state"].update(stateless)  # torch's setter wants every parameter's entry
            set_optimizer_state_dict(self._model, self._optimizer, optim_sd)
            params = dict(self._model.named_parameters())
            for fqn in stateless:  # as at save: no state until the parameter's first gradient
                param = params.get(fqn)
                if param is not None:
                    self._optimizer.state.pop(param, None)
            self._scheduler.load_state_dict(scheduler_state)
        self._global_step = step
        self.zero_grad()

    def _load_reference_weights(self, directory: Path, step: int) -> None:
        """``load_checkpoint`` of a reference engine: the checkpoint's fp32 weights are read into fp32
        copies of the shards (no dtype conversion inside the checkpoint reader), then rounded into the
        live ``param_dtype`` weights; a failed read leaves them untouched."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        from underlay.utils.safe_dcp import safe_dcp_load

        model_sd = {k: _fresh(v).to(torch.float32) for k, v in get_model_state_dict(self._model).items()}
        live = LiveState(list(self._model.parameters()), [], [])
        with load_transaction(f"load_checkpoint({directory})", live):
            safe_dcp_load({"model": model_sd}, directory)
            set_model_state_dict(self._model, model_sd)
        self._global_step = step


def signature_diff(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str:
    """Human-readable first differences between two model signatures ("" when equal)."""
    problems: list[str] = []
    for key in sorted(set(saved) | set(mine)):
        if key == "params":
            continue
        if saved.get(key) != mine.get(key):
            problems.append(f"{key}: checkpoint {saved.get(key)!r} != model {mine.get(key)!r}")
    sp, mp = saved.get("params", {}), mine.get("params", {})
    missing = sorted(set(mp) - set(sp))
    extra = sorted(set(sp) - set(mp))
    if missing:
        problems.append(f"parameters missing from the checkpoint: {missing[:3]}")
    if extra:
        problems.append(f"parameters the model does not have: {extra[:3]}")
    shapes = [f"{n} {sp[n]} != {mp[n]}" for n in sorted(set(sp) & set(mp)) if sp[n] != mp[n]]
    if shapes:
        problems.append(f"shape mismatch: {shapes[:3]}")
    return "; ".join(problems)


def _compile_backend() -> str:
    """``UNDERLAY_COMPILE_BACKEND`` (default ``inductor``), checked against torch's registered
    backends when the engine is built, not at the first compiled forward."""
    import torch._dynamo

    from underlay.utils import env

    name = env.get("UNDERLAY_COMPILE_BACKEND")
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ConfigError(
            f"UNDERLAY_COMPILE_BACKEND={name!r} is not a torch.compile backend; use one of {known}"
        )
    return name


def _fresh(tree: Any) -> Any:
    """A copy of a (nested) state dict with every tensor cloned (DTensors stay DTensors)."""
    if torch.is_tensor(tree):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _fresh(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_fresh(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_fresh(v) for v in tree)
    return tree


def _stateless_params(optim_sd: Mapping[str, Any], directory: Path) -> list[str]:
    """The parameter names of ``optim_sd["state"]`` (torch's ``get_optimizer_state_dict`` layout) for
    which the DCP checkpoint in ``directory`` holds no optimizer state."""
    from underlay.utils.safe_dcp import SafeFileSystemReader

    saved = SafeFileSystemReader(str(directory)).read_metadata().state_dict_metadata
    prefixes = {k.rsplit(".", 1)[0] for k in saved if k.startswith("optim.state.")}
    return [fqn for fqn in optim_sd.get("state", {}) if f"optim.state.{fqn}" not in prefixes]


def _optim_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


@dataclass(frozen=True)
class _Saved:
    """A host copy of a tensor (or a DTensor's local shard) and what is needed to rebuild it."""

    host: torch.Tensor
    device: torch.device
    dtensor: tuple[Any, ...] | None


def _to_host(t: Any, pin: bool) -> Any:
    """``_Saved`` host copy of a tensor or DTensor; other values are returned unchanged."""
    if not torch.is_tensor(t):
        return t
    meta = None
    local = t
    if isinstance(t, DTensor):
        local = t.to_local()
        meta = (t.device_mesh, t.placements, t.shape, t.stride())
    host = torch.empty_like(local, device="cpu", pin_memory=pin and local.device.type != "cpu")
    host.copy_(local)
    return _Saved(host, local.device, meta)


def _to_device(saved: Any) -> Any:
    """Inverse of ``_to_host``: the same values on the device they came from."""
    if not isinstance(saved, _Saved):
        return saved
    local = saved.host.to(saved.device)
    if saved.dtensor is None:
        return local
    mesh, placements, shape, stride = saved.dtensor
    return DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)


def _fsdp_param_groups(model: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's parameter groups (``FSDPParamGroup``: one reduce-scatter each) of every ``FSDPModule``
    in ``model``."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch before the list of groups per module
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        yield from groups


def _fsdp_params(model: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's per-parameter state objects (``FSDPParam``) of every ``FSDPModule`` in ``model``."""
    for group in _fsdp_param_groups(model):
        yield from group.fsdp_params


@dataclass
class _ZeroFilled:
    """An accumulator ``_fill_late_accumulators`` created, and whether a gradient reached it."""

    fsdp_param: Any
    handle: Any
    used: bool = False


def _fill_late_accumulators(model: torch.nn.Module) -> list[_ZeroFilled]:
    """Before the syncing (last) micro-batch of ``grad_sync="per_step"``: FSDP2 reduce-scatters one
    parameter group in one dtype, so a parameter whose first gradient of the step comes in that
    micro-batch (compute dtype) next to group members holding a reduce-dtype accumulation (a vision
    tower's merger on the first image micro-batch, a module skipped until then) would fail the reduce.
    Such parameters get a zero accumulation in the reduce dtype, and a hook that records whether
    autograd gives them a gradient; ``_unfill`` drops the sharded gradient of those that got none, so
    they stay without a gradient as with per-micro-batch sync."""
    filled: list[_ZeroFilled] = []
    for group in _fsdp_param_groups(model):
        params = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        held = [fp.unsharded_accumulated_grad for fp in params if fp.unsharded_accumulated_grad is not None]
        if not held or len(held) == len(params):
            continue
        for fp in params:
            if fp.unsharded_accumulated_grad is not None:
                continue
            fp.unsharded_accumulated_grad = torch.zeros_like(fp.unsharded_param, dtype=held[0].dtype)
            entry = _ZeroFilled(fp, None)

            def mark(_param: torch.Tensor, entry: _ZeroFilled = entry) -> None:
                entry.used = True

            entry.handle = fp.unsharded_param.register_post_accumulate_grad_hook(mark)
            filled.append(entry)
    return filled


def _unfill(filled: list[_ZeroFilled], completed: bool) -> None:
    """Remove ``_fill_late_accumulators``'s hooks; after a completed step, drop the (zero) sharded
    gradient of each filled parameter that no micro-batch gave a gradient."""
    for entry in filled:
        entry.handle.remove()
        if completed and not entry.used:
            entry.fsdp_param.sharded_param.grad = None


def _lora_modules(model: torch.nn.Module) -> dict[str, Any]:
    """peft LoRA layers by module name (empty without peft)."""
    found: dict[str, Any] = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "scaling") and hasattr(module, "base_layer"):
            found[name] = module
    return found


def _named_optimizer(params: list[torch.nn.Parameter], optim: Any, offload: bool) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer ``optim.name`` (not AdamW) over ``params``: ``lr``,
    ``weight_decay``, the ``betas``/``eps`` it takes, and ``optim.options`` (validated by
    ``OptimConfig``). Host-offloaded state exists for AdamW only: ``ConfigError`` with
    ``optimizer_offload``."""
    from underlay.interfaces.config import optimizer_class, standard_optimizer_args

    cls = optimizer_class(optim.name)
    if offload:
        raise ConfigError(
            f"optimizer_offload keeps AdamW's state in host memory; OptimConfig.name={optim.name!r} has no "
            "host-offloaded variant: use name='adamw' or turn optimizer_offload off (engine.offload() still "
            "moves any optimizer's state between steps)"
        )
    kw = {k: getattr(optim, k) for k in standard_optimizer_args(cls)}
    opt: torch.optim.Optimizer = cls(
        params, lr=optim.lr, weight_decay=optim.weight_decay, **kw, **optim.options
    )
    return opt
