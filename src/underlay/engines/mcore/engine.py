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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from underlay.engines._buckets import bucket_full_tensors, check_bucket_args
from underlay.engines._core import (
    EngineBase,
    LiveState,
    check_token_batch,
    load_transaction,
    report_nonfinite,
)
from underlay.engines._inductor import inductor_ok
from underlay.engines._loss import MetricReducer, check_loss_fn, checked_loss, count_loss
from underlay.engines.mcore._chunks import torch_optimizers as _torch_optimizers
from underlay.engines.mcore._chunks import unwrap as _unwrap
from underlay.engines.mcore.config import (
    MCoreArch,
    arch_of,
    check_interleaved_count,
    check_layout,
    config_class,
    transformer_config_kwargs,
    value_arch,
    with_padded_vocab,
)
from underlay.engines.mcore.context_parallel import CPSplit
from underlay.engines.mcore.options import MCoreOptions
from underlay.engines.mcore.weightmap import VALUE_HEAD_NAMES, Rule, hf_shapes, stage_rules
from underlay.interfaces import (
    IGNORE_INDEX,
    BackendUnavailable,
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
    resolve_options,
)
from underlay.interfaces.weightmap import WeightMap
from underlay.parallel.rank import current_rank
from underlay.utils import env as _env

__all__ = ["CPU_FIXTURE_ENV", "MCoreEngine", "MCoreOptions"]

CPU_FIXTURE_ENV = "UNDERLAY_MCORE_CPU_FIXTURE"
_STATE_FILE = "engine_state.pt"
_SIGNATURE_FILE = "engine_signature.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _MicroBatch:
    """One packed micro-batch as every pipeline chunk sees it."""

    sub: TokenBatch | None  # None: a one-token dummy for a rank without a sequence in this slot
    packed: Any
    input_ids: torch.Tensor  # [1, T'] (T' = T plus padding for sequence parallelism)
    position_ids: torch.Tensor  # [1, T']
    labels: torch.Tensor  # [T'] next-token ids, IGNORE_INDEX at sequence ends and padding
    params: Any  # PackedSeqParams
    real: int  # T
    rows: torch.Tensor  # [b] int64 rows of the whole batch (device), empty for the stand-in
    cp: CPSplit | None = None  # context parallelism: how this rank's tokens map to the micro-batch


class MCoreEngine(EngineBase):
    """A Hugging Face causal LM (or, with ``ModelConfig.kind="value"``, its token-classification value
    model: ``layers.ValueHead`` in place of the output layer) as megatron-core ``GPTModel`` chunks with
    DDP and megatron's optimizer.

    Collective over the default process group. Needs an accelerator device; on a CPU device it raises
    ``BackendUnavailable`` unless the test-only fixture ``tests/mcore/_cpu_fixture.py`` (which maps
    megatron's CUDA calls to the CPU and sets ``UNDERLAY_MCORE_CPU_FIXTURE=1``) is installed.
    Raises ``ConfigError`` for sizes the world or model does not divide, an unsupported architecture,
    LoRA, ``etp != tp``, and ``batch_p2p_comm=True`` with virtual pipelines at ``pp=2``. Virtual
    pipelines run megatron's interleaved schedule over micro-batches padded to one token count per
    step; expert parallelism runs megatron's alltoall dispatcher."""

    def __init__(self, config: EngineConfig, device: Device) -> None:
        opts: MCoreOptions = resolve_options(MCoreOptions, config.options, "mcore")
        support = MCoreOptions.supports_recompute(config.recompute)
        if not support.available:
            raise ConfigError(f"mcore: recompute={config.recompute!r}: {support.reason}; {support.hint}")
        mc = config.model
        if mc.lora is not None:
            raise ConfigError(
                "mcore: LoRA is not supported by the mcore engine (megatron-core has no simple LoRA); "
                "use the fsdp2 engine for LoRA"
            )
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
        if par.etp is not None and par.etp != par.tp:
            raise ConfigError(
                f"mcore: etp={par.etp} with tp={par.tp}: the mcore engine runs experts with expert tensor "
                f"parallel size equal to tp (megatron's default); leave ParallelConfig.etp unset or set "
                f"etp={par.tp}"
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
        if self._value:
            self._hf_config = value_hf_config(self._hf_config)
            self._arch = value_arch(self._arch, self._hf_config)
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

        self._tf_config = config_class(self._arch)(
            **transformer_config_kwargs(
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
        )
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
        chunks = self._build_chunks()
        self._fill(chunks)
        self._chunks = self._wrap_ddp(chunks)
        self._build_optimizer()
        self._global_step = 0
        self._grads = "clean"  # "clean" | "local" (unreduced, accumulating) | "reduced"
        self._skip_next = False  # a non-finite loss or metric since the last optimizer step
        self._masters_stale = False  # parameters written outside the optimizer (see _sync_master_params)
        self._offloaded: dict[str, Any] = {}
        from underlay.registry import get_logprob_kernel

        self._logprob_kernel = get_logprob_kernel()

    # ------------------------------------------------------------------------------ construction

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

    def chunk_rules(self, chunk: torch.nn.Module) -> list[Rule]:
        """The weight-map rules of one (unwrapped) pipeline chunk on this rank."""
        from megatron.core import parallel_state as ps

        inner = _unwrap(chunk)
        layers = inner.decoder.layers
        first = int(layers[0].layer_number) - 1 if len(layers) else 0
        local_e = 0
        offset = 0
        if self._arch.is_moe:
            local_e = self._arch.num_experts // ps.get_expert_model_parallel_world_size()
            offset = ps.get_expert_model_parallel_rank() * local_e
        return stage_rules(
            self._arch,
            first_layer=first,
            num_layers=len(layers),
            pre_process=bool(inner.pre_process),
            post_process=bool(inner.post_process),
            expert_offset=offset,
            local_experts=local_e,
        )

    def _tp_coords(self, rule: Rule) -> tuple[int, int]:
        from megatron.core import parallel_state as ps

        if rule.expert:
            return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()

    def load_tensors(self, chunks: list[torch.nn.Module], read: Any) -> tuple[int, list[str]]:
        """Fill every parameter of ``chunks`` through the weight map; ``read(name)`` returns the full HF
        tensor (or ``None`` when absent). Returns ``(parameters filled, missing HF names)``; shapes
        are checked before anything is copied into a parameter."""
        loaded = 0
        missing: list[str] = []
        shapes = hf_shapes(self._arch)
        for chunk in chunks:
            params = _named_tensors(chunk)
            for rule in self.chunk_rules(chunk):
                tensors = []
                for name in rule.hf:
                    t = read(name)
                    if t is None:
                        missing.append(name)
                        break
                    if tuple(t.shape) != shapes[name]:
                        raise CheckpointError(
                            f"{name}: shape {tuple(t.shape)} in the files != {shapes[name]} of the model config"
                        )
                    tensors.append(t)
                if len(tensors) != len(rule.hf):
                    continue
                rank, size = self._tp_coords(rule)
                piece = rule.shard(tensors, rank, size)
                param = params[rule.name]
                if tuple(piece.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"{rule.name}: converted shape {tuple(piece.shape)} != parameter {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(piece.to(param.dtype))
                self._masters_stale = True
                loaded += 1
        return loaded, missing

    def _fill(self, chunks: list[torch.nn.Module]) -> None:
        """Parameters from the safetensors of ``model.path`` (a value model's head, when the files lack
        it, e.g. a causal-LM checkpoint, from the seed: the whole seed model is built, so the head is
        the fsdp2 engine's), or all from the seed model. ``CheckpointError`` for anything else missing."""
        mc = self._config.model
        only: set[str] | None = None
        if mc.path is not None and mc.load_weights:
            from underlay.engines.mcore.weights import SafetensorsReader

            with SafetensorsReader(Path(mc.path)) as reader:
                _, missing = self.load_tensors(chunks, reader.get)
            head = set(VALUE_HEAD_NAMES) if self._value else set()
            if set(missing) - head:
                raise CheckpointError(
                    f"mcore: {len(missing)} tensors missing from {mc.path}: {sorted(set(missing))[:5]}"
                )
            if not missing:
                return
            from underlay.engines._value_head import refuse_unread_tensors

            # the head is missing: it is in no file under another name either
            refuse_unread_tensors(mc.path, self._weight_map, int(self._hf_config.vocab_size), "mcore")
            only = set(missing)
        from underlay.engines.mcore._hf import seeded_hf_state

        state = seeded_hf_state(mc, self._hf_config)
        if only is not None:
            state = {n: t for n, t in state.items() if n in only}
        _, missing = self.load_tensors(chunks, state.get)
        if only is None and missing:
            raise CheckpointError(
                f"mcore: the seeded model lacks {sorted(set(missing))[:5]} (conversion bug)"
            )

    def _wrap_ddp(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self._opts.distributed_optimizer,
        )
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
        oc = OptimizerConfig(
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
        )
        kwargs: dict[str, Any] = {}
        if "config_overrides" in inspect.signature(get_megatron_optimizer).parameters:
            # decay every parameter, as the fsdp2 engine's AdamW does (megatron skips 1-D params by default)
            kwargs["config_overrides"] = {}
        self._optimizer = get_megatron_optimizer(oc, self._chunks, **kwargs)
        from underlay.ops import build_lr_scheduler

        self._schedulers = [build_lr_scheduler(inner, o) for inner in _torch_optimizers(self._optimizer)]

    # ------------------------------------------------------------------------------- properties

    def __repr__(self) -> str:
        lay = self._layout
        return (
            f"MCoreEngine(world={lay.world_size}, tp={lay.tp}, pp={lay.pp}, vpp={lay.vpp}, cp={lay.cp}, "
            f"ep={lay.ep}, device={self._device.device_type}, kind={self._config.model.kind!r}, "
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

    # --------------------------------------------------------------------------------- compute

    def _check_batch(self, batch: TokenBatch) -> TokenBatch:
        """Validate ``batch`` and return it on the host (cpu).

        Every check reads host tensors: a batch given on the host (what data pipelines produce) is
        validated, planned and packed without any device->host synchronisation; a batch given on the
        device is copied to the host once here (one synchronisation instead of one per check and per
        micro-batch). ``InvalidInput`` before any state changes."""
        if batch.has_vision:
            raise InvalidInput(
                "TokenBatch carries images/videos but the mcore engine runs text decoders only; train "
                "vision-language models with the fsdp2 engine (UNDERLAY_ENGINE=fsdp2)"
            )
        tensors = [batch.input_ids, batch.attention_mask, batch.loss_mask, *batch.extras.values()]
        host = batch if all(t.device.type == "cpu" for t in tensors) else batch.to(torch.device("cpu"))
        check_token_batch(host, self._arch.vocab)
        return host

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (host) on the engine's device without waiting for it: the copy is queued on the current
        stream (a pageable source is staged by CUDA before the call returns, so ``t`` may be freed)."""
        return t.to(self._torch_device, non_blocking=True)

    def _batch_to_device(self, batch: TokenBatch) -> TokenBatch:
        return TokenBatch(
            self._to_device(batch.input_ids),
            self._to_device(batch.attention_mask),
            self._to_device(batch.loss_mask),
            {k: self._to_device(v) for k, v in batch.extras.items()},
        )

    def _plan(self, host: TokenBatch) -> list[list[int]]:
        """Micro-batches of ``host`` (a host batch from ``_check_batch``): lengths are read on the host;
        the count is agreed over data parallel (one all-reduce; none at dp = 1)."""
        from underlay.ops import plan_micro_batches

        seqlens = host.attention_mask.sum(dim=1).tolist()
        pp = self._layout.pp
        multiple = pp if self._layout.vpp > 1 else 1
        plan = plan_micro_batches(
            seqlens,
            self._config.micro_batch_max_tokens,
            group=self._pg["dp"] if self._layout.dp_shard > 1 else None,
            multiple_of=multiple,
        )
        check_interleaved_count(
            len(plan),
            pp=pp,
            vpp=self._layout.vpp,
            group_size=self._tf_config.microbatch_group_size_per_vp_stage,
        )
        return plan

    def _micro_batches(self, host: TokenBatch, plan: list[list[int]]) -> list[_MicroBatch]:
        """The packed micro-batches of ``plan``. With virtual pipelines every micro-batch of the step is
        padded to one token count (the longest, agreed over the model-parallel group, a multiple of
        tp under sequence parallelism) and megatron runs with fixed shapes: its per-micro-batch shape
        exchange (``variable_seq_lengths``) posts both directions' receives from the one peer at pp=2
        in a single batched call, where they pair with the peer's sends by posting order and the
        shapes swap (gloo then hangs on a size mismatch). The agreement is one small all-reduce."""
        if self._layout.vpp == 1:
            return [self._micro_batch(host, idx) for idx in plan]
        from megatron.core import parallel_state as ps

        lengths = host.attention_mask.sum(dim=1).tolist()
        longest = max(max(sum(int(lengths[i]) for i in idx) for idx in plan), 1)
        agreed = torch.tensor([longest], dtype=torch.int64).to(self._torch_device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ps.get_model_parallel_group())
        length = int(agreed.item())
        if self._tf_config.sequence_parallel:
            length = -(-length // self._layout.tp) * self._layout.tp
        return [self._micro_batch(host, idx, length) for idx in plan]

    def _micro_batch(self, host: TokenBatch, idx: list[int], length: int | None = None) -> _MicroBatch:
        """Pack the rows ``idx`` of the host batch on the host (lengths, labels, ``cu_seqlens`` and the
        longest sequence are host values), then queue the packed tensors to the device; ``length``
        pads the micro-batch to that many tokens with a masked padding sequence (virtual pipelines)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        from underlay.engines.mcore.layers import DEVICE_CU_ATTR
        from underlay.ops import unpad
        from underlay.ops.attention import attach_seqlens

        if idx:
            sub: TokenBatch | None = host.select(idx)
            assert sub is not None
            packed = unpad(sub.input_ids, sub.attention_mask)
        else:  # a one-token stand-in: this dp rank has no sequence in this slot
            sub = None
            one = host.select([0])
            packed = unpad(one.input_ids[:, :1], torch.ones_like(one.attention_mask[:, :1]))
        ids = packed.input_ids
        pos = packed.position_ids
        cu = packed.cu_seqlens.to(torch.int32)
        real = int(ids.numel())
        tp = self._layout.tp
        if length is not None:  # a fixed token count (virtual pipelines): a masked padding sequence
            pad = length - real
        else:
            pad = (-real) % tp if self._tf_config.sequence_parallel else 0
        labels = torch.full((real + pad,), IGNORE_INDEX, dtype=torch.long)
        labels[: real - 1] = ids[1:]
        ends = (cu[1:] - 1).long()
        labels[ends] = IGNORE_INDEX
        lens = packed.seqlens
        if self._layout.cp > 1:
            dev = self._to_device
            return self._cp_micro_batch(
                None if sub is None else self._batch_to_device(sub),
                self._packed_to_device(packed),
                dev(ids),
                dev(pos),
                dev(labels[:real]),
                dev(cu),
                real,
                dev(torch.as_tensor(idx, dtype=torch.long)),
            )
        if pad:
            ids = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)])
            pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)])
            cu = torch.cat([cu, torch.tensor([real + pad], dtype=torch.int32)])
            lens = [*lens, pad]
        max_len = max(lens)
        dev = self._to_device
        # the attention kernel's length checks take these host lengths instead of reading cu_seqlens
        cu_dev = attach_seqlens(dev(cu), lens)
        cu_given = cu_dev
        if self._host_cu_seqlens:
            # megatron's unfused THD RoPE reads cu_seqlens on the host in every layer: give it the
            # host tensor, and underlay's CoreAttention the device copy (TE's spec takes device ones)
            cu_given = cu.clone()
            setattr(cu_given, DEVICE_CU_ATTR, cu_dev)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_given,
            cu_seqlens_kv=cu_given,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
        )
        return _MicroBatch(
            None if sub is None else self._batch_to_device(sub),
            self._packed_to_device(packed),
            dev(ids)[None],
            dev(pos)[None],
            dev(labels),
            params,
            real,
            dev(torch.as_tensor(idx, dtype=torch.long)),
        )

    def _packed_to_device(self, packed: Any) -> Any:
        """The host ``PackedBatch`` with its tensors queued to the device (``ops.pad`` scatters there)."""
        dev = self._to_device
        return dataclasses.replace(
            packed,
            input_ids=dev(packed.input_ids),
            cu_seqlens=dev(packed.cu_seqlens),
            indices=dev(packed.indices),
            position_ids=dev(packed.position_ids),
        )

    def _cp_micro_batch(
        self,
        sub: TokenBatch | None,
        packed: Any,
        ids: torch.Tensor,
        pos: torch.Tensor,
        labels: torch.Tensor,
        cu: torch.Tensor,
        real: int,
        rows: torch.Tensor,
    ) -> _MicroBatch:
        """This CP rank's share of a packed micro-batch (``context_parallel.split_packed``): the
        load-balanced chunks of every sequence, global real and padded ``cu_seqlens`` for megatron's
        RoPE and the attention core; the local count a multiple of tp under sequence parallelism."""
        from megatron.core import parallel_state as ps
        from megatron.core.packed_seq_params import PackedSeqParams

        from underlay.engines.mcore.context_parallel import split_packed

        multiple = self._layout.tp if self._tf_config.sequence_parallel else 1
        group = ps.get_context_parallel_group()
        ids, pos, labels, split = split_packed(ids, pos, labels, cu, group=group, multiple=multiple)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=split.cu_real,
            cu_seqlens_kv=split.cu_real,
            cu_seqlens_q_padded=split.cu_padded,
            cu_seqlens_kv_padded=split.cu_padded,
            max_seqlen_q=split.max_seqlen,
            max_seqlen_kv=split.max_seqlen,
        )
        return _MicroBatch(sub, packed, ids[None], pos[None], labels, params, real, rows, split)

    def _head_outputs(
        self, model: Any, output: torch.Tensor, mb: _MicroBatch, temperature: float, with_entropy: bool
    ) -> TokenOutputs:
        """Token-aligned ``[b, S]`` outputs of one micro-batch from the last stage's output ``[1, T',
        H]`` (the final hidden states): log-probs (and entropy) through the vocab-parallel log-prob
        kernel. For a value model ``output`` is the value head's ``[1, T', 1]`` and the result holds
        ``values`` only: ``values[t]`` scores token ``t`` itself (no shift, as Hugging Face's token
        classification), fp32, 0 at padding. Under context parallelism ``T'`` are this CP rank's
        tokens (``mb.cp``'s split); the outputs are gathered over CP (collective over the CP group)
        and cover the whole micro-batch on every CP rank; the backward keeps this rank's tokens'
        share."""
        from underlay.ops import pad

        real = mb.real
        if self._value:
            flat = output.reshape(-1)
            # under context parallelism ``output`` holds this CP rank's load-balanced chunks: gather
            # them over CP into the packed order, as the log-probs below (padding is dropped there)
            values = (mb.cp.gather(flat) if mb.cp is not None else flat[:real]).to(torch.float32)
            return TokenOutputs(None, None, pad(values, mb.packed) if mb.sub is not None else values)
        inner = _unwrap(model)
        weight = (
            inner.shared_embedding_or_output_weight()
            if inner.share_embeddings_and_output_weights
            else inner.output_layer.weight
        )
        h = output.reshape(-1, output.shape[-1])
        group = self._pg["tp"] if self._layout.tp > 1 else None
        if self._arch.vocab_rows != self._arch.vocab:  # padded rows get no probability
            from megatron.core import parallel_state as ps

            from underlay.engines.mcore.vocab import mask_padded_rows

            rank = ps.get_tensor_model_parallel_rank()
            h, weight = mask_padded_rows(h, weight, vocab=self._arch.vocab, rank=rank)
        out = self._logprob_kernel(
            h, weight, mb.labels, temperature=temperature, with_entropy=with_entropy, vocab_group=group
        )
        split = mb.cp

        def align(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            if split is not None:  # every CP rank gets the whole micro-batch, in packed order
                x = split.gather(x)
            shifted = torch.cat([x.new_zeros(1), x[: real - 1]])
            return pad(shifted.to(torch.float32), mb.packed) if mb.sub is not None else shifted

        return TokenOutputs(align(out.log_probs), align(out.entropy), None)

    def _run_schedule(self, mbs: list[_MicroBatch], loss_func: Any, forward_only: bool) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Any, model: Any) -> Any:
            mb = next(data_iterator)
            out = model(
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,
                attention_mask=None,
                packed_seq_params=mb.params,
            )
            return out, partial(loss_func, model, mb)

        fb = get_forward_backward_func()
        iters: Any = [iter(mbs) for _ in self._chunks]
        fb(
            forward_step_func=forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self._chunks if len(self._chunks) > 1 else self._chunks[0],
            num_microbatches=len(mbs),
            # megatron divides this by cp (the local length); only a hint with variable_seq_lengths
            seq_length=max(int(mb.input_ids.shape[1]) for mb in mbs) * self._layout.cp,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def forward_backward(self, batch: TokenBatch, loss_fn: LossFn) -> StepResult:
        """Accumulate gradients of the sum of ``loss_fn``'s contributions over ``batch`` (this dp
        rank's share; loss contract v3, ``interfaces.LossFn``).

        Micro-batches come from ``ops.plan_micro_batches`` (same count on every dp rank, a multiple of
        pp with virtual pipelines); megatron's schedule runs them; on the last stage each micro-batch's
        per-token outputs (``TokenOutputs``: log-probs and entropy, or ``values`` for a value model)
        go to ``loss_fn`` with its ``LossContext`` (``engines._loss``; every CP rank gets the whole
        micro-batch and the same context). Gradients sum over micro-batches and dp x cp: megatron's
        per-token-loss mode sums in its DDP; the reduction (``finalize_grads``) runs once per optimizer
        step, so several calls accumulate like one call over their concatenated micro-batches. Metrics reduce as declared over dp on the last
        stage and are broadcast over the pipeline so every rank returns the same ``StepResult``.
        ``InvalidInput`` on a malformed batch or ``loss_fn`` before any compute.

        Host synchronisation: validation, planning and packing read host tensors (none for a host
        batch; one copy for a device batch); the global counts are one all-reduce before the first
        micro-batch, the metrics one at the end, each read once."""
        from megatron.core import parallel_state as ps

        check_loss_fn(loss_fn)
        host = self._check_batch(batch)
        self._ensure_onloaded("forward_backward")
        if self._grads == "reduced":
            raise InvalidInput(
                "forward_backward: the accumulated gradients were already reduced over the ranks "
                "(finalize_grads); call optimizer_step or zero_grad before the next forward_backward"
            )
        dp_group = self._pg["dp"] if self._layout.dp > 1 else None
        counts = count_loss(host.loss_mask, dp_group, self._layout.dp, self._torch_device)
        plan = self._plan(host)
        mbs = self._micro_batches(host, plan)
        contexts = {
            id(mb): counts.context(i, len(plan), idx, None if mb.sub is None else mb.sub.loss_mask)
            for i, (mb, idx) in enumerate(zip(mbs, plan))
        }
        reducer = MetricReducer(self._torch_device)
        temperature = self._config.temperature
        with_entropy = self._config.with_entropy

        def loss_func(model: Any, mb: _MicroBatch, output: torch.Tensor) -> Any:
            no_tokens = torch.zeros((), dtype=torch.int, device=output.device)
            if mb.sub is None:
                return output.sum() * 0.0, no_tokens, {}
            outputs = self._head_outputs(model, output, mb, temperature, with_entropy)
            loss, metrics = checked_loss(loss_fn(outputs, mb.sub, contexts[id(mb)]))
            reducer.add(loss, metrics)
            return loss, no_tokens, {}

        for c in self._chunks:
            c.train()
        self._grads = "local"
        self._run_schedule(mbs, loss_func, forward_only=False)
        metrics = self._share_metrics(reducer, dp_group, ps.is_pipeline_last_stage(ignore_virtual=True))
        if report_nonfinite("forward_backward", metrics, reducer.local(), self._torch_device):
            self._skip_next = True
        return StepResult(metrics, len(plan), counts.global_tokens, counts.global_sequences)

    def _share_metrics(self, reducer: MetricReducer, dp_group: Any, last: bool) -> dict[str, float]:
        """Reduce the metrics over dp on the last stage and broadcast them from there over pp."""
        from megatron.core import parallel_state as ps

        box: list[Any] = [reducer.reduce(dp_group, self._layout.dp) if last else None]
        if self._layout.pp > 1:
            src = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast_object_list(box, src=src, group=self._pg["pp"])
        return dict(box[0])

    @torch.no_grad()
    def infer(
        self, batch: TokenBatch, *, temperature: float | None = None, with_entropy: bool = False
    ) -> TokenOutputs:
        """Per-token log-probs (and entropy when ``with_entropy``), or ``values`` for a value model,
        ``[B, S]`` fp32 on the device, rows in the order of ``batch``, 0 at padding (log-probs and
        entropy also at position 0), on every rank (broadcast from the last pipeline stage)."""
        from megatron.core import parallel_state as ps

        host = self._check_batch(batch)
        self._ensure_onloaded("infer")
        temp = self._config.temperature if temperature is None else temperature
        if not temp > 0:
            raise InvalidInput(f"infer: temperature={temp} must be > 0")
        with_entropy = with_entropy and not self._value
        plan = self._plan(host)
        mbs = self._micro_batches(host, plan)
        shape = tuple(host.input_ids.shape)
        main = torch.zeros(shape, dtype=torch.float32, device=self._torch_device)
        ent = torch.zeros(shape, dtype=torch.float32, device=self._torch_device) if with_entropy else None

        def loss_func(model: Any, mb: _MicroBatch, output: torch.Tensor) -> Any:
            zero = torch.zeros((), device=output.device)
            if mb.sub is not None:
                out = self._head_outputs(model, output, mb, temp, with_entropy)
                got = out.values if self._value else out.log_probs
                assert got is not None
                main[mb.rows] = got
                if ent is not None and out.entropy is not None:
                    ent[mb.rows] = out.entropy
            return zero, torch.zeros((), dtype=torch.int, device=output.device), {}

        for c in self._chunks:
            c.eval()
        self._run_schedule(mbs, loss_func, forward_only=True)
        if self._layout.pp > 1:
            src = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(main, src=src, group=self._pg["pp"])
            if ent is not None:
                dist.broadcast(ent, src=src, group=self._pg["pp"])
        if self._value:
            return TokenOutputs(None, None, main)
        return TokenOutputs(main, ent, None)

    def finalize_grads(self) -> None:
        """Reduce the gradients accumulated since the last ``zero_grad`` once: megatron's
        ``finalize_model_grads`` (data-parallel all-reduce or reduce-scatter, TP all-reduce of the
        replicated norm weights, tied-embedding sync over the pipeline). ``optimizer_step`` calls it;
        call it yourself only to read ``main_grad``; a ``forward_backward`` after it and before
        ``optimizer_step``/``zero_grad`` raises ``InvalidInput`` (its gradients would be reduced
        twice). Idempotent. Collective."""
        if self._grads == "local":
            self._finalize_model_grads(self._chunks, num_tokens=None)
        if self._grads != "clean":
            self._grads = "reduced"

    def zero_grad(self) -> None:
        """Drop accumulated gradients (megatron's grad buffers are zeroed)."""
        for c in self._chunks:
            c.zero_grad_buffer()  # type: ignore[operator]
        self._optimizer.zero_grad()
        self._grads = "clean"
        self._skip_next = False

    def _sync_master_params(self) -> None:
        """Copy the model parameters into the optimizer's fp32 master copies when something wrote the
        parameters outside the optimizer (``load_tensors``, ``copy_full_parameter``): with bf16/fp16
        parameters megatron's optimizer steps its masters and copies them back, so a load it missed
        would be undone by the next step. No-op for fp32 parameters (no masters) and when clean."""
        if self._masters_stale:
            with torch.no_grad():
                self._optimizer.reload_model_params()
            self._masters_stale = False

    def optimizer_step(self) -> OptimizerStepResult:
        """Global grad norm over all shards (TP, PP, DP, EP); a non-finite norm skips the update
        (parameters and optimizer state unchanged); otherwise clip to ``optim.grad_clip`` and step.
        Gradients are zeroed in both cases; ``global_step`` grows.

        The norm is computed on the device and read on the host once per step (one all-reduce per
        sub-optimizer, one device->host read, needed to decide the skip); clipping reuses it instead of
        computing it a second time (megatron's ``clip_grad_norm`` would)."""
        self._ensure_onloaded("optimizer_step")
        opt = self._optimizer
        lr = float(_torch_optimizers(opt)[0].param_groups[0]["lr"])
        self._sync_master_params()
        self.finalize_grads()
        opt.prepare_grads()
        norm = _grad_norm(opt, self._torch_device)
        skipped = not math.isfinite(norm) or self._skip_next
        self._skip_next = False
        if not skipped:
            clip = self._config.optim.grad_clip
            if clip is not None and clip > 0:
                _clip_by_norm(opt, clip, norm)
            opt.step_with_ready_grads()
        self.zero_grad()
        self._global_step += 1
        return OptimizerStepResult(grad_norm=norm, skipped=skipped, lr=lr)

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule one step; returns the new learning rate."""
        for s in self._schedulers:
            s.step()
        return float(_torch_optimizers(self._optimizer)[0].param_groups[0]["lr"])

    # ------------------------------------------------------------------------------ offloading

    def _param_tensors(self) -> list[torch.Tensor]:
        return [p for c in self._chunks for p in c.parameters()]

    def _grad_tensors(self) -> list[torch.Tensor]:
        out = []
        for c in self._chunks:
            for buf in list(getattr(c, "buffers", [])) + list(getattr(c, "expert_parallel_buffers", [])):
                out.append(buf.grad_data)
        return out

    def _optim_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for inner in _torch_optimizers(self._optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    out.append(p)
                    for v in inner.state.get(p, {}).values():
                        if torch.is_tensor(v) and v.dim() > 0:
                            out.append(v)
        return out

    def offload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Copy the chosen state to host memory and shrink the device storage to nothing (megatron's
        views into its buffers stay valid: storage is swapped, not the tensors). Idempotent per kind."""
        for kind, on, get in (
            ("params", params, self._param_tensors),
            ("grads", grads, self._grad_tensors),
            ("optimizer", optimizer, self._optim_tensors),
        ):
            if on and kind not in self._offloaded:
                self._offloaded[kind] = _swap_out(get(), self._device.is_accelerator)
        self._device.synchronize()
        self._device.empty_cache()

    def onload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Bring offloaded state back; values are bit-identical to before ``offload``."""
        for kind, on in (("params", params), ("grads", grads), ("optimizer", optimizer)):
            if on and kind in self._offloaded:
                _swap_in(self._offloaded.pop(kind))
        self._device.synchronize()

    # ----------------------------------------------------------------------------------- weights

    def _global_rules(self) -> list[tuple[int, int, int, Rule]]:
        """Every rule of the model with the (pp rank, virtual chunk, ep rank) that owns it, in a fixed
        order that every rank computes identically."""
        a = self._arch
        pp, vpp = self._layout.pp, self._layout.vpp
        ep = self._layout.ep
        per_chunk = a.num_layers // (pp * vpp)
        local_e = a.num_experts // ep if a.is_moe else 0
        out: list[tuple[int, int, int, Rule]] = []
        for v in range(vpp):
            for stage in range(pp):
                first_stage = stage == 0 and v == 0
                last_stage = stage == pp - 1 and v == vpp - 1
                first_layer = (v * pp + stage) * per_chunk
                for e in range(ep):
                    rules = stage_rules(
                        a,
                        first_layer=first_layer,
                        num_layers=per_chunk,
                        pre_process=first_stage,
                        post_process=last_stage,
                        expert_offset=e * local_e,
                        local_experts=local_e,
                    )
                    for r in rules:
                        if e == 0 or r.expert:
                            if last_stage and not first_stage and r.name == "output_layer.weight" and a.tied:
                                continue  # the copy of the embedding: exported once, from the first stage
                            out.append((stage, v, e, r))
        return out

    def _build_weight_map(self) -> None:
        """The ``WeightMap`` over global engine names (``decoder.layers.<global layer>``, experts by global
        index), plus where each parameter lives: (pp rank, virtual chunk, ep rank, chunk-local rule)."""
        from underlay.engines.mcore.weightmap import engine_rule

        shapes = hf_shapes(self._arch)
        rules = []
        self._where: dict[str, tuple[int, int, int, Rule]] = {}
        for stage, v, e, rule in self._global_rules():
            wr = engine_rule(rule, self._arch)
            full = wr.from_hf({n: torch.empty(shapes[n], device="meta") for n in wr.hf_names})
            rules.append(dataclasses.replace(wr, engine_shape=tuple(full.shape)))
            self._where[wr.engine_name] = (stage, v, e, rule)
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if self._arch.tied else {}
        # a value model loads the backbone of a causal-LM checkpoint: its lm_head is not "unexpected"
        ignored = ("*rotary_emb.inv_freq", "lm_head.*") if self._value else ("*rotary_emb.inv_freq",)
        self._weight_map = WeightMap(tuple(rules), tied, ignored)

    @property
    def weight_map(self) -> WeightMap:
        """Megatron ``GPTModel`` parameters (global layer/expert indices) <-> HF tensors: fused q/k/v per
        query group, fused ``[gate; up]``, vocab-split embedding/output layer."""
        return self._weight_map

    def supports_recompute(self, policy: RecomputePolicy) -> ProbeResult:
        """``"none"``, ``"full"`` and ``"selective"`` (``MCoreOptions.supports_recompute``)."""
        return MCoreOptions.supports_recompute(policy)

    def _is_mine(self, stage: int, e: int, rule: Rule) -> bool:
        from megatron.core import parallel_state as ps

        my_ep = ps.get_expert_model_parallel_rank() if self._arch.is_moe else 0
        return stage == ps.get_pipeline_model_parallel_rank() and (not rule.expert or e == my_ep)

    @staticmethod
    def _tp_group(rule: Rule) -> Any:
        from megatron.core import parallel_state as ps

        return ps.get_expert_tensor_parallel_group() if rule.expert else ps.get_tensor_model_parallel_group()

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter of ``weight_map`` in rule order, gathered over TP/ETP by its owners and
        broadcast from the lowest owning rank (pipeline stage, expert rank): full (``tp == 1`` layout)
        fp32 tensors on the device, on every rank. Collective."""
        self._ensure_onloaded("weights")
        params = [_named_tensors(c) for c in self._chunks]
        for wr in self._weight_map.rules:
            stage, v, e, rule = self._where[wr.engine_name]
            full: torch.Tensor | None = None
            if self._is_mine(stage, e, rule):
                local = params[v][rule.name].detach().float()
                group = self._tp_group(rule)
                size = dist.get_world_size(group) if wr.tp_dim is not None else 1
                if size > 1:
                    pieces = [torch.empty_like(local) for _ in range(size)]
                    dist.all_gather(pieces, local.contiguous(), group=group)
                    full = wr.tp_unshard(pieces)
                else:
                    full = local
            if dist.get_world_size() > 1:
                if full is None:
                    assert wr.engine_shape is not None
                    full = torch.empty(wr.engine_shape, dtype=torch.float32, device=self._torch_device)
                full = full.contiguous()
                dist.broadcast(full, src=self._owner_rank(stage, e, rule.expert))
            assert full is not None
            yield wr.engine_name, full

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 HF tensors one at a time (``weight_map.to_hf(named_full_parameters())``). Collective."""
        return self._weight_map.to_hf(self.named_full_parameters())

    def copy_full_parameter(self, engine_name: str, full: torch.Tensor) -> int:
        """Write this rank's TP shard of ``full`` into ``engine_name`` when this rank holds it (its
        pipeline stage and expert rank); no communication. Returns bytes written here (0 elsewhere).
        ``InvalidInput`` for an unknown name, ``CheckpointError`` for a shape mismatch, before writing."""
        from megatron.core import parallel_state as ps

        wr = self._weight_map.rule(engine_name)
        if wr.engine_shape is not None and tuple(full.shape) != wr.engine_shape:
            raise CheckpointError(
                f"copy_full_parameter {engine_name}: shape {tuple(full.shape)} != {wr.engine_shape}"
            )
        stage, v, e, rule = self._where[engine_name]
        targets: list[tuple[int, str]] = []
        if self._is_mine(stage, e, rule):
            targets.append((v, rule.name))
        last = self._layout.pp - 1
        if (
            self._arch.tied
            and last > 0
            and engine_name == "embedding.word_embeddings.weight"
            and ps.get_pipeline_model_parallel_rank() == last
        ):
            # the last stage's output layer is megatron's copy of the tied embedding
            targets.append((len(self._chunks) - 1, "output_layer.weight"))
        if rule.expert:
            rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        else:
            rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        written = 0
        for chunk, local_name in targets:
            piece = wr.tp_shard(full, rank, size)
            param = _named_tensors(self._chunks[chunk])[local_name]
            with torch.no_grad():
                param.copy_(piece.to(param.device, param.dtype))
            self._masters_stale = True
            written += param.numel() * param.element_size()
        return written

    def named_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The mcore engine has no LoRA adapters: always empty."""
        return iter(())

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """The mcore engine has no LoRA adapters: ``InvalidInput``, as for any engine without them."""
        raise InvalidInput(
            "disable_adapter: the engine has no LoRA adapters (the mcore engine runs without LoRA)"
        )
        yield  # pragma: no cover - a generator for contextmanager

    def _owner_rank(self, stage: int, e: int, expert: bool) -> int:
        """The global rank that broadcasts a tensor owned by pipeline ``stage`` (and expert rank ``e``):
        the lowest rank with that pp rank (and ep rank)."""
        from megatron.core import parallel_state as ps

        if not hasattr(self, "_rank_table"):
            mine = torch.tensor(
                [
                    ps.get_pipeline_model_parallel_rank(),
                    ps.get_expert_model_parallel_rank() if self._arch.is_moe else 0,
                ],
                dtype=torch.int64,
            )
            table = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(table, mine.to(self._torch_device) if False else mine)
            self._rank_table = [tuple(int(x) for x in t.tolist()) for t in table]
        for r, (p, ee) in enumerate(self._rank_table):
            if p == stage and (not expert or ee == e):
                return r
        raise CheckpointError(f"no rank owns pipeline stage {stage} / expert rank {e}")

    def iter_weights(
        self, bucket_bytes: int = 1 << 29, *, ranks: Collection[int] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of ``(hf_name, full tensor)`` in ``param_dtype`` on the device, about ``bucket_bytes``
        each, on the ranks in ``ranks`` (default: all); other ranks take part and get empty buckets
        (the bucket count is the same everywhere: bucket boundaries depend on shapes only). Collective.
        ``InvalidInput`` for ``bucket_bytes < 1`` or a rank outside ``[0, world_size)``, before any
        collective."""
        receive = check_bucket_args(bucket_bytes, ranks, self._layout.world_size)
        yield from bucket_full_tensors(self.named_full_tensors(), bucket_bytes, self._param_dtype, receive)

    # ------------------------------------------------------------------------------ checkpoints

    def model_signature(self) -> Mapping[str, Any]:
        """Architecture, kind and every HF tensor's full shape (layout independent)."""
        cfg = self._hf_config
        return {
            "engine": "mcore",
            "architecture": type(cfg).__name__,
            "model_type": getattr(cfg, "model_type", None),
            "kind": self._config.model.kind,
            "params": {n: list(s) for n, s in hf_shapes(self._arch).items()},
            # padded vocabulary rows (a multiple of tp) live in the checkpoint's tensors
            **({"vocab_rows": self._arch.vocab_rows} if self._arch.vocab_rows != self._arch.vocab else {}),
        }

    def _sharded_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for i, c in enumerate(self._chunks):
            key = f"model{i}" if len(self._chunks) > 1 else "model"
            state[key] = _unwrap(c).sharded_state_dict(prefix="")
        return state

    def save_checkpoint(self, directory: Path) -> None:
        """Model parameters and optimizer state through ``megatron.core.dist_checkpointing`` (torch_dist,
        one ``model/`` directory): the optimizer's sharded state dict in megatron's ``fully_reshardable``
        format (distributed optimizer) or per-parameter sharded tensors (plain optimizer), so both load
        at another TP/PP/DP layout; plus the LR schedule, ``global_step``, the layout and the model
        signature. Collective."""
        from megatron.core import dist_checkpointing

        self._ensure_onloaded("save_checkpoint")
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(f"save_checkpoint: {directory} is not an existing directory")
        (directory / "model").mkdir(exist_ok=True)
        dist.barrier()
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        # the writer forks worker processes per rank when thread_count > 1; those deadlocked in the
        # CPU (gloo) runs, so the host-device case writes from the rank's own process
        threads = 2 if self._device.is_accelerator else 1
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=threads)
        self._sync_master_params()
        self._init_optimizer_state()
        state = self._model_state_for_ckpt()
        state["optimizer"] = self._optimizer_sharded_state(state, is_loading=False)
        dist_checkpointing.save(state, str(directory / "model"), sharded_strategy=strategy)
        extra = {
            "global_step": self._global_step,
            "schedulers": [s.state_dict() for s in self._schedulers],
            "layout": self._layout_key(),
            "distributed_optimizer": bool(self._opts.distributed_optimizer),
        }
        torch.save(extra, directory / f"rank{current_rank()}_{_STATE_FILE}")
        if current_rank() == 0:
            (directory / _SIGNATURE_FILE).write_text(json.dumps(self.model_signature(), sort_keys=True))
        dist.barrier()

    def _init_optimizer_state(self) -> None:
        """Give every parameter of the inner torch Adam optimizers its state (``step`` 0, zero moments)
        when it has none yet, as torch's lazy first step would: megatron's sharded optimizer state dict
        reads the state of every parameter (it asserts on an optimizer that never stepped). Changes no
        parameter and no result: a zero-step Adam state is what the first step creates."""
        for opt in _torch_optimizers(self._optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    if opt.state.get(p):
                        continue
                    opt.state[p] = {
                        "step": torch.zeros((), dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }

    def _optimizer_sharded_state(self, model_state: dict[str, Any], *, is_loading: bool) -> Any:
        """Megatron's sharded optimizer state over ``model_state`` (the model's sharded state dict that
        is saved or loaded with it): ``fully_reshardable`` for the distributed optimizer (its other
        formats cannot change TP or failed to load in-place without TE/apex)."""
        model_sd: dict[str, Any] = {}
        for key, value in model_state.items():
            if key.startswith("model"):
                model_sd.update(value)
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        return self._optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)

    def _model_state_for_ckpt(self) -> dict[str, Any]:
        return self._sharded_state()

    def _refuse_layout(self, directory: Path, extra: Mapping[str, Any]) -> None:
        """``CheckpointError`` for a saved layout that this engine cannot resume exactly, before any
        state changes. Every TP/PP/VPP/DP/CP change resumes exactly (megatron's ``fully_reshardable``
        optimizer format and sharded model tensors). Another ``distributed_optimizer`` setting is
        refused (megatron's formats differ). A MoE model saved at another expert-parallel
        size is refused: megatron keeps the experts in an optimizer of their own only when ep > 1 (its
        ``chained_0``/``chained_1`` state), so the optimizer state does not map across."""
        saved = list(extra.get("layout", []))
        mine = bool(self._opts.distributed_optimizer)
        if extra.get("distributed_optimizer", mine) != mine:
            raise CheckpointError(
                f"load_checkpoint({directory}): saved with distributed_optimizer="
                f"{not mine}, this engine has {mine}: megatron's two optimizers store their state in "
                "formats that do not load into each other; resume with the saving run's setting, or start "
                "from the weights (export_hf, then load_hf) with a fresh optimizer"
            )
        if self._arch.is_moe and len(saved) == 7 and (saved[5] > 1) != (self._layout.ep > 1):
            raise CheckpointError(
                f"load_checkpoint({directory}): saved with expert parallelism ep={saved[5]}, this engine "
                f"has ep={self._layout.ep}: megatron's optimizer keeps experts apart only when ep > 1, "
                "so their optimizer state cannot be resumed across; resume with "
                f"{'ep > 1' if saved[5] > 1 else 'ep=1'}, or start from the weights (export_hf, then "
                "load_hf) with a fresh optimizer"
            )

    def _layout_key(self) -> list[int]:
        lay = self._layout
        return [lay.world_size, lay.tp, lay.pp, self._layout.vpp, lay.cp, lay.ep, self._layout.etp]

    def check_signature(self, directory: Path) -> None:
        """Raise ``CheckpointError`` unless ``directory`` holds an mcore checkpoint of this model."""
        from underlay.engines.mcore._hf import signature_diff

        sig_path = Path(directory) / _SIGNATURE_FILE
        if not sig_path.is_file() or not (Path(directory) / "model").is_dir():
            raise CheckpointError(
                f"{directory} is not a complete mcore engine checkpoint (missing {_SIGNATURE_FILE} or model/); "
                "pass a directory written by save_checkpoint"
            )
        saved = json.loads(sig_path.read_text())
        diff = signature_diff(saved, json.loads(json.dumps(self.model_signature())))
        if diff:
            raise CheckpointError(
                f"checkpoint {directory} belongs to another model: {diff}; load it into an engine built from the same model config"
            )

    def load_checkpoint(self, directory: Path) -> None:
        """Restore the model, the optimizer state (Adam moments and step), the LR schedule and
        ``global_step`` at any TP/PP/DP layout: the next step equals the one the saving run would have
        taken. ``CheckpointError`` before any state changes for another model. Collective."""
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        self.check_signature(directory)
        self._ensure_onloaded("load_checkpoint")
        extra = self._read_engine_state(directory)
        live = LiveState(
            [*self._param_tensors(), *self._optim_tensors()],
            _torch_optimizers(self._optimizer),
            self._schedulers,
        )
        # every phase writes live tensors in place (megatron loads into the parameters' own storage):
        # a failure anywhere puts everything back and raises CheckpointError
        with load_transaction(f"load_checkpoint({directory})", live):
            self._init_optimizer_state()
            state = self._model_state_for_ckpt()
            state["optimizer"] = self._optimizer_sharded_state(state, is_loading=True)
            loaded = dist_checkpointing.load(state, str(directory / "model"))
            for i, c in enumerate(self._chunks):
                key = f"model{i}" if len(self._chunks) > 1 else "model"
                _unwrap(c).load_state_dict(loaded[key], strict=False)
            # with fp32 parameters megatron's "main" params are the model params themselves (leaves
            # that require grad): its in-place copies of the loaded state must not be recorded by autograd
            with torch.no_grad(), _step_kept_aside(self._optimizer):
                self._optimizer.load_state_dict(loaded["optimizer"])
            # megatron's distributed optimizer (without apex/TE) restores torch Adam's "step" as ONE
            # tensor shared by every parameter's state; torch's foreach Adam increments each in place,
            # so a shared tensor would advance once per parameter per step: give each its own copy
            for o in _torch_optimizers(self._optimizer):
                for st in o.state.values():
                    if "step" in st:
                        st["step"] = st["step"].clone()
            for s, st in zip(self._schedulers, extra["schedulers"]):
                s.load_state_dict(st)
        self._global_step = int(extra["global_step"])
        self._masters_stale = False
        self.zero_grad()

    def _read_engine_state(self, directory: Path) -> dict[str, Any]:
        """This rank's ``engine_state.pt`` (rank 0's when the saving world was smaller), checked:
        ``CheckpointError`` for an unreadable file, a malformed content, or a layout this engine
        cannot resume exactly (``_refuse_layout``). Changes nothing."""
        path = directory / f"rank{current_rank()}_{_STATE_FILE}"
        if not path.is_file():
            path = directory / f"rank0_{_STATE_FILE}"
        try:
            extra = torch.load(path, weights_only=False)
            step = extra["global_step"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"global_step={step!r} is not an int >= 0")
            if len(extra["schedulers"]) != len(self._schedulers):
                raise ValueError(
                    f"{len(extra['schedulers'])} LR schedules saved, this engine has {len(self._schedulers)}"
                )
        except Exception as exc:
            raise CheckpointError(f"{path}: unreadable engine state ({type(exc).__name__}: {exc})") from exc
        self._refuse_layout(directory, extra)
        return dict(extra)


# ------------------------------------------------------------------------------------------ helpers


def _compat_shims() -> None:
    """megatron-core 0.16.1 without Transformer Engine: ``moe_utils`` refers to ``te_general_gemm``
    that its failed TE import never bound (``NameError`` in the MoE router; fixed in 0.19). Binding the
    missing name to ``None`` selects its plain ``torch.mm`` path. Touches nothing when the name exists."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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


@contextlib.contextmanager
def _step_kept_aside(opt: Any) -> Iterator[None]:
    """While loading a ``fully_reshardable`` state into megatron's distributed optimizer without
    TE/apex: its per-parameter setter copies every key of torch Adam's state from the loaded tensors,
    but the loaded per-parameter tensors have no ``step`` (it travels in the param groups and was
    already restored), so it raises ``KeyError: 'step'``. Each call sets the parameter's ``step``
    aside and puts it back afterwards; the setter is restored on exit."""
    patched = []
    for o in getattr(opt, "chained_optimizers", [opt]):
        setter = getattr(o, "_set_main_param_and_optimizer_states", None)
        index = getattr(o, "model_param_group_index_map", None)
        if setter is None or index is None:
            continue

        def kept(model_param: Any, tensors: Any, o: Any = o, setter: Any = setter) -> None:
            group, order = o.model_param_group_index_map[model_param]
            state = o.optimizer.state[o.optimizer.param_groups[group]["params"][order]]
            step = state.pop("step", None) if "step" not in tensors else None
            try:
                setter(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        o._set_main_param_and_optimizer_states = kept
        patched.append(o)
    try:
        yield
    finally:
        for o in patched:
            del o._set_main_param_and_optimizer_states


def _named_tensors(chunk: Any) -> dict[str, torch.Tensor]:
    """Parameters and buffers of an (unwrapped) chunk by name: the weight map also covers buffers
    that checkpoints hold (glm4_moe's routing bias is the router's ``expert_bias`` buffer)."""
    inner = _unwrap(chunk)
    return {**dict(inner.named_buffers()), **dict(inner.named_parameters())}


def _grad_norm(opt: Any, device: torch.device) -> float:
    """The global L2 norm of the main gradients of megatron optimizer ``opt`` (a ``ChainedOptimizer``
    or one optimizer), as megatron's ``get_grad_norm`` defines it: each sub-optimizer's gradients for
    the norm (shared and TP-duplicated parameters counted once), their squared norms summed over that
    sub-optimizer's grad-stats group, and the square root of the total.

    Computed on the device with ``torch._foreach_norm`` and read once: megatron's fallback without
    apex (``local_multi_tensor_l2_norm``) builds a host tensor from one device scalar per parameter,
    a device synchronisation per parameter (about 200 a step on a 28-layer model). Every rank runs the
    same sequence of all-reduces (stub sub-optimizers of ranks without parameters contribute zero)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for o in getattr(opt, "chained_optimizers", [opt]):
        getter = getattr(o, "get_grads_for_grad_norm", None) or o.get_main_grads_for_grad_norm
        grads = [] if getattr(o, "is_stub_optimizer", False) else list(getter())
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            norms = torch._foreach_norm([g.float() for g in grads], 2.0)
            sq = torch.stack(norms).pow(2).sum()
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=o.get_grad_stats_parallel_group())
        total = total + sq
    return float(total.sqrt())


def _clip_by_norm(opt: Any, clip: float, norm: float) -> None:
    """Scale every (sub-)optimizer's main gradients by ``min(1, clip / (norm + 1e-6))`` with megatron's
    ``clip_grad_by_total_norm_fp32``, as its ``ChainedOptimizer.step`` does with one global norm."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for o in getattr(opt, "chained_optimizers", [opt]):
        if getattr(o, "is_stub_optimizer", False):
            continue
        params = o.get_parameters()
        if params:
            decoupled = bool(getattr(o.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))
            clip_grad_by_total_norm_fp32(params, clip, norm, decoupled)


def _swap_out(tensors: list[torch.Tensor], pin: bool) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    saved = []
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
        host.untyped_storage().copy_(storage)
        saved.append((t, host, storage.nbytes()))
        storage.resize_(0)
    return saved


def _swap_in(saved: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    for t, host, nbytes in saved:
        storage = t.untyped_storage()
        storage.resize_(nbytes)
        storage.copy_(host.untyped_storage())


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
