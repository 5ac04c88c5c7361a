"""``MCoreOptions``: the typed ``EngineConfig.options`` of the mcore engine, and its recompute support.

No heavy imports: the registry loads this module to list the options in ``underlay info``. The
parallel sizes (``vpp``, ``etp``) live in ``ParallelConfig``; the recompute policy in
``EngineConfig.recompute``.
"""

from __future__ import annotations

from dataclasses import dataclass

from underlay.interfaces import ProbeResult, RecomputePolicy
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

    @staticmethod
    def supports_recompute(policy: RecomputePolicy) -> ProbeResult:
        """``"none"``, ``"full"`` (every decoder layer, megatron's uniform full recompute) and
        ``"selective"`` (megatron's core-attention recompute) are all supported; ``"auto"`` is
        ``"none"`` (mcore has no memory policy of its own)."""
        if policy in ("auto", "none", "full", "selective"):
            return ProbeResult.ok()
        return ProbeResult.fail(f"unknown recompute policy {policy!r}", "use 'none', 'full' or 'selective'")
