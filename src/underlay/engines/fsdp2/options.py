"""``FSDP2Options``: the typed ``EngineConfig.options`` of the fsdp2 engine, and its recompute support.

No heavy imports: the registry loads this module to list the options in ``underlay info``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from underlay.interfaces import ConfigError, ProbeResult, RecomputePolicy
from underlay.interfaces.options import option

__all__ = ["COMPILE_SCOPES", "GRAD_SYNC_MODES", "FSDP2Options", "supports_recompute"]

COMPILE_SCOPES = ("norm_mlp", "layer_parts", "layer")
"""What ``compile`` compiles: the norms and dense MLPs (``"norm_mlp"``), or those and the attention
modules (``"layer_parts"``: projections, rotary and the attention call, which graph-breaks where the
kernel needs host values), or the whole ``forward`` of each decoder layer (``"layer"``: residual adds
included; the FSDP hooks around it stay eager)."""

GRAD_SYNC_MODES = ("per_micro_batch", "per_step")
"""When the gradients of a ``forward_backward`` are reduced (reduce-scattered) into the sharded
gradients: after every micro-batch (``"per_micro_batch"``), or once, at its last micro-batch
(``"per_step"``: FSDP2's ``set_requires_gradient_sync(False)`` for the others; the unsharded gradients
are accumulated in the reduce dtype in between)."""


@dataclass(frozen=True)
class FSDP2Options:
    """Engine-specific settings of ``fsdp2`` (``EngineConfig.options``, a mapping or this class)."""

    reshard_after_forward: bool | None = option(
        None,
        "free each decoder layer's gathered parameters after its forward (False: keep them unsharded "
        "from forward to backward and across micro-batches; more memory, fewer all-gathers); None = auto: "
        "False when all ranks are on one node and the memory estimate fits, else True",
    )
    fused_adamw: bool | None = option(
        None,
        "use the fused AdamW kernel (accelerators only; ignored on cpu); None = auto: True on cuda, and "
        "on other accelerators where torch has the kernel",
    )
    compile: bool | Literal["norm_mlp", "layer_parts", "layer"] | None = option(
        None,
        "torch.compile parts of each decoder layer: True = 'layer_parts' (norms, dense MLPs, attention "
        "modules), 'norm_mlp', or 'layer' (each layer's whole forward); False = eager; None = auto: "
        "'layer' on cuda when inductor works (a failing compile falls back to eager, logged), eager on "
        "cpu/npu; backend from UNDERLAY_COMPILE_BACKEND (default inductor)",
    )
    compile_memory_budget: float | None = option(
        None,
        "fraction in (0, 1] of the activations compiled graphs save for backward (the partitioner "
        "recomputes the cheapest of the rest; 1.0 = torch's default); None = auto: 0.85 when compiling; "
        "applies to this engine's compiled calls only",
    )
    optimizer_offload: bool | None = option(
        None,
        "keep AdamW's state in pinned host memory and step it in chunks streamed through the device "
        "(copies overlap the fused step); None = auto: only when the memory estimate does not fit "
        "otherwise",
    )
    grad_sync: Literal["per_micro_batch", "per_step"] | None = option(
        None,
        "when gradients are reduced into the sharded gradients: 'per_micro_batch' (after every "
        "micro-batch's backward) or 'per_step' (once per forward_backward, at its last micro-batch: no "
        "reduce-scatter, copies and accumulation for the other micro-batches, but the unsharded "
        "gradients of the whole model, in the reduce dtype, stay on the device until then; a second "
        "forward_backward before the optimizer step syncs per micro-batch); None = auto: "
        "'per_micro_batch' (the memory estimate counts 'per_step' when it is asked for)",
    )
    single_device: bool | None = option(
        None,
        "world size 1 only: no fully_shard; the module keeps fp32 master weights and a persistent "
        "param_dtype compute copy refreshed once per optimizer step, gradients accumulate in fp32 through "
        "hooks (same numerics as FSDP2 at one rank, without its per-step copies and casts); None = auto: "
        "True at world size 1 without cpu_offload when the parameters may stay unsharded (the memory "
        "policy's reshard_after_forward=False), else False",
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
        if self.compile not in (None, False, True, *COMPILE_SCOPES):
            raise ConfigError(
                f"EngineConfig.options compile={self.compile!r}: use None (auto), False, True or one of "
                f"{COMPILE_SCOPES}"
            )
        if self.grad_sync not in (None, *GRAD_SYNC_MODES):
            raise ConfigError(
                f"EngineConfig.options grad_sync={self.grad_sync!r}: use None (auto), 'per_micro_batch' or "
                "'per_step'"
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
    def auto_defaults(device_type: str) -> dict[str, tuple[object, str]]:
        """What the auto (``None``) speed options become on ``device_type`` (``"cuda"``, ``"npu"``,
        ``"cpu"``), with the reason: ``{option: (value, reason)}`` (``underlay info`` prints it).
        ``reshard_after_forward``, ``optimizer_offload``, ``grad_sync`` and ``recompute="auto"`` depend
        on the model and the memory, so they are described, not valued."""
        from underlay.engines.fsdp2._device_defaults import device_defaults

        d = device_defaults(device_type)
        memory = "memory policy at build (model size, micro_batch_max_tokens, device memory)"
        return {
            "compile": (d.compile, d.reasons["compile"]),
            "fused_adamw": (d.fused_adamw, d.reasons["fused_adamw"]),
            "compile_memory_budget": (d.compile_memory_budget, d.reasons["compile_memory_budget"]),
            "reshard_after_forward": ("auto", "False on one node when the estimate fits; " + memory),
            "optimizer_offload": ("auto", "True only when nothing fits without it; " + memory),
            "grad_sync": (
                "auto",
                "'per_micro_batch'; 'per_step' is opt-in (its gain on one GPU is not measured yet); "
                + memory,
            ),
            "recompute": ("auto", "'none' when the estimate fits, else 'full'; " + memory),
            "single_device": (
                "auto",
                "True at world size 1 without cpu_offload when the parameters stay unsharded; " + memory,
            ),
        }

    @staticmethod
    def supports_recompute(policy: RecomputePolicy) -> ProbeResult:
        """Whether fsdp2 runs the recompute ``policy``: ``"auto"`` (the memory policy picks ``"none"``
        or ``"full"``), ``"none"`` and ``"full"`` yes; ``"selective"``
        no (measured slower than full recomputation on the H200 and removed; use ``"full"``, or
        ``compile="layer"`` with ``compile_memory_budget`` to let the compiler choose what to save)."""
        return supports_recompute(policy)


def supports_recompute(policy: RecomputePolicy) -> ProbeResult:
    """See ``FSDP2Options.supports_recompute``."""
    if policy in ("auto", "none", "full"):
        return ProbeResult.ok()
    if policy == "selective":
        return ProbeResult.fail(
            "fsdp2 has no selective recomputation: it measured slower than full recomputation on the H200 "
            "and was removed",
            "use recompute='full', or options compile='layer' with compile_memory_budget",
        )
    return ProbeResult.fail(f"unknown recompute policy {policy!r}", "use 'auto', 'none' or 'full'")
