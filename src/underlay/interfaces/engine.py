"""``ParallelEngine`` and ``WeightLoader``: what an RL trainer calls to train and move weights."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from underlay.interfaces.config import EngineConfig
from underlay.interfaces.device import Device
from underlay.interfaces.types import (
    LossContext,
    Metric,
    OptimizerStepResult,
    ParallelLayout,
    ProbeResult,
    RecomputePolicy,
    StepResult,
    TokenBatch,
    TokenOutputs,
)
from underlay.interfaces.weightmap import WeightMap

__all__ = ["LoadReport", "LossFn", "ParallelEngine", "WeightLoader"]


class LossFn(Protocol):
    """A loss over one micro-batch (loss contract v3).

    ``loss_fn(outputs, batch, ctx) -> (contribution, metrics)``:

    - ``outputs``: the model's per-token outputs ``[b, S]`` aligned with ``batch.input_ids``;
      ``batch``: the micro-batch (rows of this rank's shard, ``extras`` sliced with them);
      ``ctx``: :class:`LossContext`, the global loss-token and sequence counts, this micro-batch's
      counts and place, and the data-parallel size.
    - ``contribution``: a floating scalar tensor attached to the graph, this micro-batch's
      contribution to the global objective. The engine backpropagates it unchanged and gradients
      **sum** over micro-batches and data-parallel ranks (the engine compensates any averaging of its
      gradient reduction), so the global objective is the sum of all contributions whatever the
      micro-batching and ranks. ``ops.aggregate_loss(values, batch.loss_mask, mode, ctx)`` gives
      verl's aggregation modes (token-mean, seq-mean-token-mean, ...) exactly over the global batch.
    - ``metrics``: name -> :class:`Metric` (``reduce`` ``"sum"``, ``"mean"``, ``"max"`` or
      ``"min"`` over every micro-batch of every rank) or a plain number / one-element tensor (a
      ``"sum"``, i.e. a contribution like the loss). The name ``"loss"`` is the engine's (the sum of
      the contributions).

    A function of two parameters (the contract before v3) is refused with ``InvalidInput``.
    """

    def __call__(
        self, outputs: TokenOutputs, batch: TokenBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, Mapping[str, Metric | torch.Tensor | float]]: ...


@dataclass(frozen=True)
class LoadReport:
    """What ``WeightLoader.load_hf`` did: tensors loaded, names missing from the files, names in the
    files the model does not have, and bytes read on this rank."""

    loaded: int
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    bytes_read: int


@runtime_checkable
class ParallelEngine(Protocol):
    """A sharded model with its optimizer and LR schedule.

    All methods are collective over the engine's world: every rank calls them in the same order.
    The engine is built by ``underlay.get_engine(config)``; its parameters are materialised (random
    init from ``config.model.seed``, or loaded from ``config.model.path``) before it is returned.

    Where outputs live (the same for every engine, whatever its pipeline/context/tensor split):

    - ``forward_backward``: every rank passes its data-parallel shard (ranks of one ``groups.mp``
      group pass the same rows) and every rank of the engine returns identical ``StepResult`` metrics,
      each reduced over the whole global batch as the ``loss_fn`` declared it (``LossFn``).
    - ``infer``: every rank returns the per-token outputs of the rows it passed, ``[B, S]`` in its
      order. Ranks that do not compute the last pipeline stage (or hold a context slice) receive them
      by a broadcast inside ``groups.mp``.
    - ``iter_weights``: full tensors with HF names, on the ranks named by ``ranks`` (default: every
      rank); the others take part in the collectives and receive empty buckets.
    """

    @property
    def name(self) -> str:
        """Registry name: ``"fsdp2"``, ``"mcore"``."""

    @property
    def config(self) -> EngineConfig:
        """The configuration it was built from."""

    @property
    def device(self) -> Device:
        """The device it runs on."""

    @property
    def layout(self) -> ParallelLayout:
        """Sizes and process groups of every parallel dimension."""

    @property
    def model(self) -> torch.nn.Module:
        """The sharded module (for mcore, a ``ModuleList`` of pipeline chunks)."""

    @property
    def hf_config(self) -> Any:
        """The ``transformers.PretrainedConfig`` of the model (what ``export_hf`` writes)."""

    @property
    def param_dtype(self) -> torch.dtype:
        """The compute dtype of the parameters (``config.param_dtype``); ``iter_weights`` yields it."""

    @property
    def weight_map(self) -> WeightMap:
        """The conversion between this engine's parameters (``named_full_parameters`` names) and the
        Hugging Face tensors of the model; drives loading, export and ``iter_weights``."""

    def supports_recompute(self, policy: RecomputePolicy) -> ProbeResult:
        """Whether this engine runs the recompute ``policy``, or the reason it does not (an engine
        built with an unsupported ``config.recompute`` raised ``ConfigError`` with that reason)."""

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter that ``weight_map`` has a rule for, gathered to its full (``tp == 1``
        layout) fp32 value, one at a time, by engine name, in ``weight_map.rules`` order. LoRA
        adapters are merged into their base weights and not yielded. Collective: every rank iterates
        and receives every tensor (on the compute device). A tensor may share storage with the live
        parameter: clone it to keep it across optimizer steps."""

    def copy_full_parameter(self, engine_name: str, full: torch.Tensor) -> int:
        """Write this rank's shard of the full (``tp == 1`` layout) tensor ``full`` into parameter
        ``engine_name``, converting dtype and device; no communication (every rank passes the same
        ``full``). Returns the bytes written on this rank. ``CheckpointError`` on a shape mismatch,
        ``InvalidInput`` for an unknown name, both before writing."""

    def named_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full LoRA adapter tensors in peft's saved naming, one at a time; empty without adapters.
        Collective."""

    def disable_adapter(self) -> AbstractContextManager[None]:
        """A context in which the LoRA adapters are bypassed: ``infer`` gives the base model's outputs
        (reference log-probs from the same engine); ``forward_backward`` inside it raises
        ``InvalidInput``. ``InvalidInput`` on entering it when the engine has no adapters."""

    def forward_backward(self, batch: TokenBatch, loss_fn: LossFn) -> StepResult:
        """Run ``batch`` (this rank's data-parallel shard) in packed micro-batches of at most
        ``config.micro_batch_max_tokens`` tokens, calling ``loss_fn(outputs, micro_batch, ctx)`` on each
        (``LossFn``) and accumulating the gradients of the sum of its contributions over micro-batches
        and data-parallel ranks. Does not step the optimizer. Every rank returns the same metrics.
        Raises ``InvalidInput`` on a malformed batch or a ``loss_fn`` without the v3 signature before
        any compute or state change."""

    def infer(
        self, batch: TokenBatch, *, temperature: float | None = None, with_entropy: bool = False
    ) -> TokenOutputs:
        """No-grad forward in micro-batches: per-token log-probs (causal LM) or values (value model),
        ``[B, S]`` fp32 on the engine's device, in the order of ``batch``, on every rank (each rank
        gets the outputs of the rows it passed)."""

    def zero_grad(self) -> None:
        """Drop accumulated gradients."""

    def optimizer_step(self) -> OptimizerStepResult:
        """Clip gradients to ``config.optim.grad_clip`` by the global norm across all shards and step
        the optimizer; a non-finite norm skips the update (parameters and optimizer state unchanged)
        and is reported. Zeroes gradients afterwards."""

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one step; returns the new learning rate."""

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (skipped steps included), restored by ``load_checkpoint``."""

    def offload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move the chosen state to host memory and release the device memory it held."""

    def onload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Bring offloaded state back to the device; values are bit-identical to before ``offload``."""

    def iter_weights(
        self, bucket_bytes: int = 1 << 29, *, ranks: Collection[int] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) tensors with Hugging Face names (``weight_map``), in buckets of about
        ``bucket_bytes`` (a tensor larger than that gets a bucket of its own), for rollout weight sync;
        tensors in ``param_dtype`` on the device; LoRA models yield merged weights.

        Collective: every rank iterates, and every rank sees the same number of buckets. ``ranks``
        (global ranks of the engine's world; ``None``: all) are the receivers: on a receiver each bucket
        holds ``(hf_name, tensor)`` pairs; on any other rank each bucket is an empty list (it took part
        in the gathers and holds no tensor after each one). The concatenation of a receiver's buckets
        equals ``WeightLoader.iter_hf_tensors`` in name, order and value (cast to ``param_dtype``).
        ``InvalidInput`` before any collective for ``bucket_bytes < 1`` or a rank outside
        ``[0, world_size)``."""

    def save_checkpoint(self, directory: Path) -> None:
        """Write model, optimizer and LR-scheduler state (sharded, resumable at another world size) into
        ``directory``, which exists and is empty. Atomicity and rotation belong to the caller
        (``underlay.checkpoint.CheckpointManager``)."""

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what ``save_checkpoint`` wrote. Raises ``CheckpointError`` before changing any state
        when the checkpoint belongs to another model or shape."""

    def model_signature(self) -> Mapping[str, Any]:
        """JSON-able description (architecture, parameter names and full shapes) that checkpoints
        record and compare against on load."""


@runtime_checkable
class WeightLoader(Protocol):
    """Moves weights between Hugging Face safetensors and an engine's parameter layout."""

    @property
    def name(self) -> str:
        """Registry name; matches the engine it serves (``"fsdp2"``, ``"mcore"``)."""

    def load_hf(self, engine: ParallelEngine, path: str | Path, *, strict: bool = True) -> LoadReport:
        """Stream ``*.safetensors`` from the local directory ``path`` into the engine's sharded
        parameters, driven by ``engine.weight_map``: one engine parameter at a time (memory bounded by
        the HF tensors one engine parameter is built from, per rank). Collective. With
        ``strict``, missing or unexpected names raise ``CheckpointError`` naming them, before any
        parameter changes; shape mismatches always raise."""

    def iter_hf_tensors(self, engine: ParallelEngine) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 tensors one at a time with Hugging Face names, in ``engine.weight_map`` order
        (``weight_map.to_hf(engine.named_full_parameters())``). Collective: every rank iterates and
        receives every tensor."""

    def export_hf(
        self,
        engine: ParallelEngine,
        out_dir: str | Path,
        *,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = 5 << 30,
    ) -> Path | None:
        """Write ``config.json``, ``*.safetensors`` (+ index) and tokenizer files when the source had them,
        from rank 0 with memory bounded by one shard; loadable by ``transformers.from_pretrained``.
        Collective; returns the directory on rank 0 and ``None`` elsewhere. An ``out_dir`` that is an
        existing file, lies under one, or holds files an export does not write is refused on every
        rank before anything there changes (nothing of the user's is moved aside or deleted)."""

    def export_adapters(self, engine: ParallelEngine, out_dir: str | Path) -> Path | None:
        """Write the LoRA adapters alone in peft's format (``adapter_model.safetensors`` +
        ``adapter_config.json``, loadable by ``PeftModel.from_pretrained`` on the base model) from rank 0.
        Raises ``InvalidInput`` when the engine has no adapters. Collective; the directory on rank 0,
        ``None`` elsewhere. (``export_hf`` writes merged weights.)"""
