"""The speed options (``compile``, ``fused_adamw``, ``compile_memory_budget``) an fsdp2 engine uses per
device family when the user gives none. A leaf module: ``options`` (``FSDP2Options.auto_defaults``) and
``defaults`` (the memory policy) both read it, so neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["AUTO_COMPILE_BUDGET", "DeviceDefaults", "Scope", "device_defaults"]

AUTO_COMPILE_BUDGET = 0.85
"""The activation memory budget of compiled layers when the user gives none: measured as fast as 1.0
and 20% less memory on the Qwen2-1.5B benchmark (runs J, K, O)."""

Scope = Literal["norm_mlp", "layer_parts", "layer"]


@dataclass(frozen=True)
class DeviceDefaults:
    """The speed options for one device family, each with a one-line reason (logged at build and
    printed by ``underlay info``). ``compile``: ``False`` or a compile scope."""

    compile: bool | Scope
    fused_adamw: bool
    compile_memory_budget: float | None
    reasons: dict[str, str] = field(default_factory=dict)


def device_defaults(
    device_type: str, *, inductor_ok: bool | None = None, fused_adamw_ok: bool | None = None
) -> DeviceDefaults:
    """The ``compile``, ``fused_adamw`` and ``compile_memory_budget`` an fsdp2 engine uses on
    ``device_type`` (``"cuda"``, ``"npu"``, ``"cpu"``, or a plugin's) when the user gives none.

    ``inductor_ok``: whether torch.compile's inductor can generate code here (on cuda: triton imports);
    ``fused_adamw_ok``: whether torch has a fused AdamW kernel for the device. ``None`` means unknown
    (``underlay info`` without probing): the device's usual answer is assumed and the reason says so.
    Never raises."""
    reasons: dict[str, str] = {}
    if device_type == "cuda":
        if inductor_ok is False:
            compile_: bool | Scope = False
            reasons["compile"] = "cuda without a usable inductor (triton does not import): eager"
        else:
            compile_ = "layer"
            reasons["compile"] = (
                "cuda: whole decoder layers compiled (measured fastest on the H200, 51.8% vs 40% MFU eager)"
                + ("" if inductor_ok else "; needs triton")
            )
        fused = fused_adamw_ok is not False
        reasons["fused_adamw"] = (
            "cuda: fused AdamW kernel (fastest measured)" if fused else "torch has no fused AdamW here"
        )
    elif device_type == "cpu":
        compile_ = False
        reasons["compile"] = "cpu: eager (compile time dwarfs the gain for cpu test runs)"
        fused = False
        reasons["fused_adamw"] = "cpu: foreach AdamW (unchanged cpu numerics; no measured gain)"
    else:
        compile_ = False
        reasons["compile"] = f"{device_type}: eager (torch.compile on this device is not measured here)"
        fused = bool(fused_adamw_ok)
        if fused_adamw_ok is None:
            reasons["fused_adamw"] = (
                f"{device_type}: decided at build: True when torch lists a fused AdamW kernel for it"
            )
        else:
            reasons["fused_adamw"] = (
                f"{device_type}: torch has a fused AdamW kernel for it"
                if fused
                else f"{device_type}: foreach AdamW (torch has no fused kernel for it)"
            )
    budget = AUTO_COMPILE_BUDGET if compile_ else None
    reasons["compile_memory_budget"] = (
        "as fast as 1.0 and 20% less activation memory (H200 runs J, K)" if budget else "not compiling"
    )
    return DeviceDefaults(compile_, fused, budget, reasons)
