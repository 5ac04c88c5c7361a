"""Whether torch.compile's inductor can generate code on a device: the probe both engines' compile
defaults use (fsdp2's ``compile``, mcore's ``fused_elementwise``)."""

from __future__ import annotations

import importlib.util

__all__ = ["inductor_ok"]


def inductor_ok(device_type: str) -> bool | None:
    """``True``/``False`` on ``"cuda"``: whether triton imports (inductor's cuda code generator);
    ``None`` on other devices (not probed: the engines keep their eager default there). Never raises."""
    if device_type != "cuda":
        return None
    return importlib.util.find_spec("triton") is not None
