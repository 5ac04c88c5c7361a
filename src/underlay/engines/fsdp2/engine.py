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

The class is assembled from one part per concern, each a base class in its own module:
``_base.FSDP2Base`` (the state, construction helpers, properties), ``_params.FSDP2Params`` (full
parameters, LoRA, weight streaming), ``_optim.FSDP2Optim`` (optimizer, gradients, offloading),
``_step.FSDP2Step`` (batches, ``forward_backward``, ``infer``) and ``_checkpoint.FSDP2Checkpoint``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from underlay.engines._inductor import compile_backend
from underlay.engines.fsdp2 import _auto, _build
from underlay.engines.fsdp2._checkpoint import FSDP2Checkpoint
from underlay.engines.fsdp2._checkpoint import signature_diff as signature_diff
from underlay.engines.fsdp2._grad_sync import _fsdp_params as _fsdp_params
from underlay.engines.fsdp2._optim import _named_optimizer as _named_optimizer
from underlay.engines.fsdp2._step import FSDP2Step
from underlay.engines.fsdp2.act_offload import install_activation_offload
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
    ParallelLayout,
    ProcessGroups,
    resolve_options,
)

__all__ = ["FSDP2Engine"]


class FSDP2Engine(FSDP2Step, FSDP2Checkpoint):
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
        # the HF model before peft and FSDP wrap it: its checkpoint conversions are looked up by class
        get_base = getattr(model, "get_base_model", None)
        hf_model = get_base() if callable(get_base) else model
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
                backend=compile_backend(),
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
            hf_model,
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
