"""``MCoreEngine``: the ``ParallelEngine`` protocol on megatron-core (TP, PP, VPP, SP, CP, EP).

Build order: validate options and sizes (``ConfigError`` before any process group exists), initialise
megatron's ``parallel_state``, build one ``GPTModel`` per virtual pipeline chunk (local spec with
underlay's RMSNorm and attention core, or TE's spec), fill the parameters (streamed from the safetensors
of ``config.model.path`` or converted from the seed-initialised Hugging Face model, so both engines start
from the same weights), wrap each chunk in megatron's DDP, and build megatron's (distributed) optimizer.

Training runs megatron's pipeline schedules (``get_forward_backward_func``) over packed THD micro-batches
(``PackedSeqParams``); the output layer returns the final hidden states and the log-probs come from the
vocab-parallel ``LogprobKernel`` over the TP group, so ``[T, V]`` logits are never built. The
``loss_fn``'s contributions (loss contract v3) are backpropagated as they are and their gradients sum
over micro-batches and dp x cp (megatron's per-token-loss mode, ``calculate_per_token_loss``, sums in
its DDP; the token count it would divide by is reported as 0). A value
model's last stage runs ``layers.ValueHead`` instead (per-token values, no vocabulary projection).
Context parallelism splits each micro-batch's sequences into megatron's load-balanced chunks
(``context_parallel``); per-token outputs (log-probs, entropy, values) are gathered back so every CP
rank sees the whole micro-batch, and every replicated parameter (the value head's too) gets its
gradient summed over dp x cp by megatron's DDP.

Host synchronisation: batches are validated, planned and packed on the host (micro-batch tensors are
queued to the device without waiting; the attention kernel gets the host lengths), so the data path
reads no device values (without context parallelism); per step what is read back is the global
loss counts at the start of ``forward_backward`` and its metrics at the end (one all-reduce each) and
the grad norm in ``optimizer_step`` (it decides a skip).

Options (``EngineConfig.options``, see ``MCoreOptions``).

The class is assembled from one part per concern, each a base class in its own module:
``_build.MCoreBuild`` (the state and its construction), ``_params.MCoreParams`` (weight map, loading and
gathering parameters), ``_optim.MCoreOptim`` (gradients, optimizer step, offloading),
``_step.MCoreStep`` (batches, ``forward_backward``, ``infer``) and ``_checkpoint.MCoreCheckpoint``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from underlay.engines._inductor import compile_backend, inductor_ok
from underlay.engines.mcore import passthrough
from underlay.engines.mcore._build import _compat_shims, _megatron_optimizer, _process_groups
from underlay.engines.mcore._checkpoint import MCoreCheckpoint
from underlay.engines.mcore._step import MCoreStep
from underlay.engines.mcore.config import (
    MCoreArch,
    arch_of,
    check_expert_tp,
    check_layout,
    check_training_randomness,
    config_class,
    transformer_config_keys,
    transformer_config_kwargs,
    value_arch,
    with_padded_vocab,
)
from underlay.engines.mcore.options import MCoreOptions
from underlay.engines.mcore.stages import check_recompute_fields, stage_layer_counts
from underlay.interfaces import (
    BackendUnavailable,
    ConfigError,
    Device,
    EngineConfig,
    ParallelLayout,
    ProbeResult,
    RecomputePolicy,
    resolve_options,
)
from underlay.utils import env as _env

__all__ = ["CPU_FIXTURE_ENV", "MCoreEngine", "MCoreOptions"]

CPU_FIXTURE_ENV = "UNDERLAY_MCORE_CPU_FIXTURE"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MCoreEngine(MCoreStep, MCoreCheckpoint):
    """A Hugging Face causal LM (or, with ``ModelConfig.kind="value"``, its token-classification value
    model: ``layers.ValueHead`` in place of the output layer) as megatron-core ``GPTModel`` chunks with
    DDP and megatron's optimizer.

    Collective over the default process group. Needs an accelerator device; on a CPU device it raises
    ``BackendUnavailable`` unless the test-only fixture ``tests/mcore/_cpu_fixture.py`` (which maps
    megatron's CUDA calls to the CPU and sets ``UNDERLAY_MCORE_CPU_FIXTURE=1``) is installed.
    Raises ``ConfigError`` for sizes the world or model does not divide, an unsupported architecture,
    LoRA on modules ``mcore.lora`` cannot adapt and ``batch_p2p_comm=True`` with virtual pipelines at
    ``pp=2``. With ``ModelConfig.lora`` only the adapters train (``mcore.lora``). Virtual
    pipelines run megatron's interleaved schedule over micro-batches padded to one token count per
    step; expert parallelism runs megatron's alltoall dispatcher."""

    def __init__(self, config: EngineConfig, device: Device) -> None:
        opts: MCoreOptions = resolve_options(MCoreOptions, config.options, "mcore")
        support = MCoreOptions.supports_recompute(config.recompute)
        if not support.available:
            raise ConfigError(f"mcore: recompute={config.recompute!r}: {support.reason}; {support.hint}")
        if config.role != "trainable":
            raise ConfigError(
                f"mcore: EngineConfig.role={config.role!r} is not supported by the mcore engine (it "
                "always builds megatron's DDP gradient buffers and optimizer with its fp32 main copies); "
                "use the fsdp2 engine for an inference-only reference model"
            )
        mc = config.model
        if mc.kind not in ("causal_lm", "value"):
            raise ConfigError(f"mcore: ModelConfig.kind={mc.kind!r}; use 'causal_lm' or 'value'")
        par = config.parallel
        if par.ulysses > 1:
            raise ConfigError(
                f"mcore: ulysses={par.ulysses}: Ulysses sequence parallelism is an fsdp2 feature; megatron "
                "splits the sequence inside TP instead (options sequence_parallel=True with tp > 1)"
            )
        if par.vpp > 1 and par.pp == 2 and opts.batch_p2p_comm:
            raise ConfigError(
                f"mcore: batch_p2p_comm=True with pp=2, vpp={par.vpp}: the interleaved schedule then "
                "receives from and sends to the one peer in both directions inside one batched call, "
                "whose transfers pair up by posting order, so activations and gradients swap (wrong "
                "results); leave batch_p2p_comm unset (megatron's unbatched path keeps the directions "
                "apart) or use pp > 2"
            )
        if par.dp_replicate != 1:
            raise ConfigError(
                f"mcore: dp_replicate={par.dp_replicate}; data parallelism is what tp*pp*cp leaves"
            )
        _megatron_optimizer(config.optim)  # refuse an optimizer megatron lacks before anything is built
        from underlay.engines.mcore._hf import hf_config_of, value_hf_config

        self._value = mc.kind == "value"
        self._hf_config = hf_config_of(mc)
        self._arch = arch_of(self._hf_config)
        check_training_randomness(self._hf_config, mc.training_randomness)
        if self._value:
            self._hf_config = value_hf_config(self._hf_config)
            self._arch = value_arch(self._arch, self._hf_config)
        # unknown or owned pass-through fields, before any state (the key set does not depend on sizes)
        passthrough.check_names(config_class(self._arch), opts, transformer_config_keys(self._arch))
        check_recompute_fields("none" if config.recompute == "auto" else config.recompute, opts.transformer)
        check_expert_tp(self._arch, tp=par.tp, etp=par.etp if par.etp is not None else par.tp)
        self._lora = None
        if mc.lora is not None:  # peft's selection, checked against what mcore.lora adapts
            from underlay.engines.mcore.lora import select

            self._lora = select(mc, self._hf_config, self._arch, pp=par.pp)
        if not device.is_accelerator and not _env.get_bool(CPU_FIXTURE_ENV):
            raise BackendUnavailable(
                "engine",
                "mcore",
                "megatron-core calls CUDA directly and needs an accelerator device; this is a CPU device",
                ["fsdp2"],
                "use UNDERLAY_ENGINE=fsdp2 on the CPU; tests run mcore on the CPU only under the "
                "test fixture tests/mcore/_cpu_fixture.py",
            )
        recompute = "none" if config.recompute == "auto" else config.recompute  # no memory policy here
        # megatron-core's default (TransformerConfig and initialize_model_parallel): expert TP = TP
        etp = par.etp if par.etp is not None else par.tp
        if not dist.is_initialized():
            from underlay.parallel.distributed import init_distributed

            init_distributed(device)
        world = dist.get_world_size()
        dp = check_layout(
            self._arch,
            world=world,
            tp=par.tp,
            pp=par.pp,
            vpp=par.vpp,
            cp=par.cp,
            ep=par.ep,
            etp=etp,
            sequence_parallel=opts.sequence_parallel,
            stage_layers=stage_layer_counts(opts.transformer),
        )
        self._arch = with_padded_vocab(self._arch, par.tp)  # vocab rows a multiple of tp (vocab.py)
        self._config = config
        self._device = device
        self._opts = opts
        self._torch_device = device.torch_device() if device.is_accelerator else torch.device("cpu")
        # the local spec's elementwise chains (norms, RoPE, SwiGLU) as compiled kernels: by default on
        # cuda when inductor can generate code there (triton imports), as fsdp2's default compile;
        # their eager kernels cost about a sixth of the step on the H200
        self._fused_elementwise = (
            inductor_ok(device.device_type) is True
            if opts.fused_elementwise is None
            else bool(opts.fused_elementwise)
        )
        if self._fused_elementwise:
            compile_backend()  # a bad UNDERLAY_COMPILE_BACKEND is refused here, not at the first forward
        self._param_dtype = _DTYPES[config.param_dtype]
        gloo = dist.get_backend() == "gloo"
        # off on gloo (wrong interleaved results there) and for the interleaved schedule at pp=2 (see
        # the refusal above); megatron's default otherwise
        batch_p2p = (
            not gloo and not (par.vpp > 1 and par.pp == 2)
            if opts.batch_p2p_comm is None
            else bool(opts.batch_p2p_comm)
        )
        self._init_parallel_state(par.tp, par.pp, par.vpp, par.cp, par.ep, etp)
        _compat_shims()
        from megatron.core import parallel_state as ps

        tf_cls = config_class(self._arch)
        tf_kwargs = transformer_config_kwargs(
            self._arch,
            tp=par.tp,
            pp=par.pp,
            vpp=par.vpp,
            cp=par.cp,
            ep=par.ep,
            etp=etp,
            sequence_parallel=opts.sequence_parallel,
            params_dtype=self._param_dtype,
            recompute=recompute,
            batch_p2p_comm=batch_p2p,
            fused_elementwise=self._fused_elementwise,
        )
        # partial recompute: megatron's method and unit replace the engine's uniform 1-layer default
        unit = ("recompute_method", "recompute_num_layers")
        merged = passthrough.merge("transformer", tf_cls, tf_kwargs, opts.transformer, unit)
        self._tf_config = passthrough.build("transformer", tf_cls, merged, opts.transformer)
        self._layout = ParallelLayout(
            world,
            1,
            dp,
            tp=par.tp,
            pp=par.pp,
            vpp=par.vpp,
            cp=par.cp,
            ep=par.ep,
            etp=etp,
            groups=_process_groups(ps, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, etp=etp, dp=dp),
        )
        # Megatron's groups as they are (also for size 1): the engine's own collectives use these, so a
        # size-1 dimension is a one-rank group, never the world group that ``None`` would mean.
        self._pg: dict[str, Any] = {
            "dp": ps.get_data_parallel_group(),
            "tp": ps.get_tensor_model_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(),
        }
        from underlay.engines.mcore.layers import have_te

        self._host_cu_seqlens = not have_te()  # the local spec: underlay's CoreAttention (see _micro_batch)
        self._build_weight_map()  # from the arch and layout alone; _fill checks files against it
        from underlay.engines.mcore.lora import sites_of

        self._lora_sites = sites_of(self._where, self._lora.modules, self._value) if self._lora else []
        self._adapter_disabled = False
        chunks = self._build_chunks()
        for v, chunk in enumerate(chunks):
            self._attach_adapters(chunk, v)  # LoRA: adapters added, the rest frozen (before DDP)
        self._chunks = self._wrap_ddp(chunks)
        self._gather_pending = False  # read by copy_full_parameter, so set before the fill
        # into megatron's DDP buffers (the parameters are views of them), before the optimizer takes
        # its master copies
        self._fill()
        self._build_optimizer()
        self._global_step = 0
        self._grads = "clean"  # "clean" | "local" (unreduced, accumulating) | "reduced"
        self._skip_next = False  # a non-finite loss or metric since the last optimizer step
        self._masters_stale = False  # parameters written outside the optimizer (see _sync_master_params)
        self._offloaded: dict[str, Any] = {}
        from underlay.registry import get_logprob_kernel

        self._logprob_kernel = get_logprob_kernel()

    # ------------------------------------------------------------------------------- properties

    def __repr__(self) -> str:
        lay = self._layout
        return (
            f"MCoreEngine(world={lay.world_size}, tp={lay.tp}, pp={lay.pp}, vpp={lay.vpp}, cp={lay.cp}, "
            f"ep={lay.ep}, device={self._device.device_type}, kind={self._config.model.kind!r}, "
            f"lora={None if self._lora is None else len(self._lora.modules)}, "
            f"training_randomness={self._config.model.training_randomness!r})"
        )

    @property
    def name(self) -> str:
        """``"mcore"``."""
        return "mcore"

    @property
    def layout(self) -> ParallelLayout:
        """dp x tp x pp (x cp); groups ``world``, ``dp``, ``dp_cp``, ``tp``, ``pp``, ``ep``."""
        return self._layout

    @property
    def model(self) -> torch.nn.Module:
        """A ``ModuleList`` of this rank's DDP-wrapped pipeline chunks."""
        return torch.nn.ModuleList(self._chunks)

    @property
    def arch(self) -> MCoreArch:
        """The converted architecture facts."""
        return self._arch

    @property
    def chunks(self) -> list[torch.nn.Module]:
        """This rank's DDP-wrapped pipeline chunks (one per virtual stage)."""
        return self._chunks

    def supports_recompute(self, policy: RecomputePolicy) -> ProbeResult:
        """``"none"``, ``"full"`` and ``"selective"`` (``MCoreOptions.supports_recompute``)."""
        return MCoreOptions.supports_recompute(policy)
