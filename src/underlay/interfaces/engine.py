"""``ParallelEngine`` and ``WeightLoader``: what an RL trainer calls to train and move weights."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from underlay.interfaces.config import EngineConfig
from underlay.interfaces.device import Device
from underlay.interfaces.types import (
    OptimizerStepResult,
    ParallelLayout,
    StepResult,
    TokenBatch,
    TokenOutputs,
)

__all__ = ["LoadReport", "LossFn", "ParallelEngine", "WeightLoader"]


class LossFn(Protocol):
    """A loss over one micro-batch.

    Receives the model's per-token outputs (``[b, S]``, aligned with ``batch.input_ids``) and the
    micro-batch. Returns ``(loss_sum, metrics)``: ``loss_sum`` is a scalar tensor, the **sum** over the
    micro-batch's loss tokens (``batch.loss_mask``) of the per-token loss; ``metrics`` are sums of the
    same kind. The engine divides both by the global number of loss tokens of the whole batch (over all
    micro-batches and data-parallel ranks), so the gradient is that of the token-mean loss however the
    batch is split.
    """

    def __call__(
        self, outputs: TokenOutputs, batch: TokenBatch
    ) -> tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]: ...


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

    def forward_backward(self, batch: TokenBatch, loss_fn: LossFn) -> StepResult:
        """Run ``batch`` (this rank's share) in packed micro-batches of at most
        ``config.micro_batch_max_tokens`` tokens, accumulate gradients of the global token-mean loss.
        Does not step the optimizer. Raises ``InvalidInput`` on a malformed batch before any compute."""

    def infer(
        self, batch: TokenBatch, *, temperature: float | None = None, with_entropy: bool = False
    ) -> TokenOutputs:
        """No-grad forward in micro-batches: per-token log-probs (causal LM) or values (value model),
        ``[B, S]`` fp32 on the engine's device, in the order of ``batch``."""

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

    def iter_weights(self, bucket_bytes: int = 1 << 29) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) parameters with Hugging Face names, in buckets of about ``bucket_bytes``,
        for rollout weight sync. Collective: every rank iterates; every rank receives the full tensors
        (in ``param_dtype``, on the device). LoRA models yield merged weights."""

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
        parameters, one tensor at a time (memory bounded by one tensor per rank). Collective. With
        ``strict``, missing or unexpected names raise ``CheckpointError`` naming them, before any
        parameter changes; shape mismatches always raise."""

    def iter_hf_tensors(self, engine: ParallelEngine) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors one at a time with Hugging Face names. Collective: every rank iterates."""

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
        Collective; returns the directory on rank 0 and ``None`` elsewhere."""

    def export_adapters(self, engine: ParallelEngine, out_dir: str | Path) -> Path | None:
        """Write the LoRA adapters alone in peft's format (``adapter_model.safetensors`` +
        ``adapter_config.json``, loadable by ``PeftModel.from_pretrained`` on the base model) from rank 0.
        Raises ``InvalidInput`` when the engine has no adapters. Collective; the directory on rank 0,
        ``None`` elsewhere. (``export_hf`` writes merged weights.)"""
