"""``FSDP2Options``: the typed ``EngineConfig.options`` of the fsdp2 engine, and its recompute support.

No heavy imports: the registry loads this module to list the options in ``underlay info``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from underlay.interfaces import ConfigError, ProbeResult, RecomputePolicy
from underlay.interfaces.options import option

__all__ = ["COMPILE_SCOPES", "FSDP2Options", "supports_recompute"]

COMPILE_SCOPES = ("norm_mlp", "layer_parts", "layer")
"""What ``compile`` compiles: the norms and dense MLPs (``"norm_mlp"``), or those and the attention
modules (``"layer_parts"``: projections, rotary and the attention call, which graph-breaks where the
kernel needs host values), or the whole ``forward`` of each decoder layer (``"layer"``: residual adds
included; the FSDP hooks around it stay eager)."""


@dataclass(frozen=True)
class FSDP2Options:
    """Engine-specific settings of ``fsdp2`` (``EngineConfig.options``, a mapping or this class)."""

    reshard_after_forward: bool = option(
        True,
        "free each decoder layer's gathered parameters after its forward (False: keep them unsharded "
        "from forward to backward and across micro-batches; more memory, fewer all-gathers)",
    )
    fused_adamw: bool = option(False, "use the fused AdamW kernel (accelerators only; ignored on cpu)")
    compile: bool | Literal["norm_mlp", "layer_parts", "layer"] = option(
        False,
        "torch.compile parts of each decoder layer: True = 'layer_parts' (norms, dense MLPs, attention "
        "modules), 'norm_mlp', or 'layer' (each layer's whole forward); backend from "
        "UNDERLAY_COMPILE_BACKEND (default inductor)",
    )
    compile_memory_budget: float | None = option(
        None,
        "fraction in (0, 1] of the activations compiled graphs save for backward (the partitioner "
        "recomputes the cheapest of the rest); None = torch's choice; applies to this engine's compiled "
        "calls only",
    )

    activation_offload: bool = option(
        False,
        "move the activations each decoder layer saves for backward to (pinned) host memory during "
        "forward and prefetch them back ahead of its backward (side streams, double-buffered); with "
        "recompute='full' only the layer inputs are saved and offloaded; gradients are unchanged",
    )
    activation_offload_min_bytes: int = option(
        1 << 20,
        "saved tensors smaller than this many bytes stay on the device under activation_offload",
    )

    def __post_init__(self) -> None:
        if self.compile not in (False, True, *COMPILE_SCOPES):
            raise ConfigError(
                f"EngineConfig.options compile={self.compile!r}: use False, True or one of {COMPILE_SCOPES}"
            )
        budget = self.compile_memory_budget
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1
        ):
            raise ConfigError(
                f"EngineConfig.options compile_memory_budget={budget!r}: use a number in (0, 1] (the fraction "
                "of the activations a compiled layer saves for backward; the rest is recomputed)"
            )

        min_bytes = self.activation_offload_min_bytes
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ConfigError(
                f"EngineConfig.options activation_offload_min_bytes={min_bytes!r}: use an int >= 0 (bytes)"
            )

    @staticmethod
    def supports_recompute(policy: RecomputePolicy) -> ProbeResult:
        """Whether fsdp2 runs the recompute ``policy``: ``"none"`` and ``"full"`` yes; ``"selective"``
        no (measured slower than full recomputation on the H200 and removed; use ``"full"``, or
        ``compile="layer"`` with ``compile_memory_budget`` to let the compiler choose what to save)."""
        return supports_recompute(policy)


def supports_recompute(policy: RecomputePolicy) -> ProbeResult:
    """See ``FSDP2Options.supports_recompute``."""
    if policy in ("none", "full"):
        return ProbeResult.ok()
    if policy == "selective":
        return ProbeResult.fail(
            "fsdp2 has no selective recomputation: it measured slower than full recomputation on the H200 "
            "and was removed",
            "use recompute='full', or options compile='layer' with compile_memory_budget",
        )
    return ProbeResult.fail(f"unknown recompute policy {policy!r}", "use 'none', 'full' or 'selective'")
