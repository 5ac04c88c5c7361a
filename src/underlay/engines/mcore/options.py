"""``MCoreOptions``: the typed ``EngineConfig.options`` of the mcore engine, and its recompute support.

No heavy imports: the registry loads this module to list the options in ``underlay info``. The
parallel sizes (``vpp``, ``etp``) live in ``ParallelConfig``; the recompute policy in
``EngineConfig.recompute``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from underlay.interfaces import ConfigError, ProbeResult, RecomputePolicy
from underlay.interfaces.options import option

__all__ = ["MCoreOptions"]


@dataclass(frozen=True)
class MCoreOptions:
    """Engine-specific settings of ``mcore`` (``EngineConfig.options``, a mapping or this class)."""

    sequence_parallel: bool = option(
        False, "megatron sequence parallelism: activations split along the sequence inside TP (needs tp > 1)"
    )
    distributed_optimizer: bool = option(
        True, "shard optimizer state over the data-parallel ranks (megatron's distributed optimizer)"
    )
    batch_p2p_comm: bool | None = option(
        None,
        "batched pipeline send/recv; None = on except with gloo, where batched transfers gave wrong "
        "interleaved results",
    )

    fused_elementwise: bool | None = option(
        None,
        "torch.compile-fused RMSNorm, RoPE rotation and SwiGLU (megatron's bias_activation_fusion); "
        "None = on for cuda when triton imports (the local spec's eager elementwise chains are a sixth "
        "of the step there), off elsewhere",
    )

    overlap_grad_reduce: bool = option(
        False,
        "megatron DDP's bucketed gradient reduce-scatter/all-reduce started during the backward "
        "(results equal to overlap off)",
    )
    overlap_param_gather: bool = option(
        False,
        "the distributed optimizer's parameter all-gather overlapped with the next forward (needs "
        "distributed_optimizer and overlap_grad_reduce; results equal to overlap off)",
    )
    transformer: Mapping[str, Any] | None = option(
        None,
        "further megatron TransformerConfig fields by name (e.g. recompute_method, recompute_num_layers, "
        "num_layers_in_first_pipeline_stage); fields underlay sets (sizes, dtypes, architecture) are "
        "refused by name",
    )
    optimizer: Mapping[str, Any] | None = option(
        None, "further megatron OptimizerConfig fields by name; those OptimConfig sets are refused by name"
    )
    ddp: Mapping[str, Any] | None = option(
        None,
        "further megatron DistributedDataParallelConfig fields by name (e.g. bucket_size); those underlay "
        "sets are refused by name",
    )

    def __post_init__(self) -> None:
        from underlay.engines.mcore.passthrough import check_owned

        for kind in ("transformer", "optimizer", "ddp"):
            value = getattr(self, kind)
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"mcore: options {kind}={value!r}: give a mapping of megatron config field names to values"
                )
            check_owned(kind, value)
            object.__setattr__(self, kind, dict(value))
        if self.overlap_param_gather and not (self.overlap_grad_reduce and self.distributed_optimizer):
            raise ConfigError(
                "mcore: overlap_param_gather=True needs distributed_optimizer=True and overlap_grad_reduce=True "
                "(megatron overlaps the gather of the optimizer's parameter shards); set both"
            )

    @staticmethod
    def supports_recompute(policy: RecomputePolicy) -> ProbeResult:
        """``"none"``, ``"full"`` (every decoder layer, megatron's uniform full recompute) and
        ``"selective"`` (megatron's core-attention recompute) are all supported; ``"auto"`` is
        ``"none"`` (mcore has no memory policy of its own)."""
        if policy in ("auto", "none", "full", "selective"):
            return ProbeResult.ok()
        return ProbeResult.fail(f"unknown recompute policy {policy!r}", "use 'none', 'full' or 'selective'")
