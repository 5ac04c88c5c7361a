"""torch.compile settings both engines share (fsdp2's ``compile``, mcore's ``fused_elementwise``):
whether inductor can generate code on a device, and the backend they compile with."""

from __future__ import annotations

import importlib.util

from underlay.interfaces import ConfigError

__all__ = ["compile_backend", "inductor_ok"]


def inductor_ok(device_type: str) -> bool | None:
    """``True``/``False`` on ``"cuda"``: whether triton imports (inductor's cuda code generator);
    ``None`` on other devices (not probed: the engines keep their eager default there). Never raises."""
    if device_type != "cuda":
        return None
    return importlib.util.find_spec("triton") is not None


def compile_backend() -> str:
    """``UNDERLAY_COMPILE_BACKEND`` (default ``inductor``): the backend of every graph an engine compiles,
    checked against torch's registered backends when the engine is built, not at the first compiled
    forward. ``ConfigError`` naming the value and the known backends otherwise."""
    import torch._dynamo

    from underlay.utils import env

    name = env.get("UNDERLAY_COMPILE_BACKEND")
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ConfigError(
            f"UNDERLAY_COMPILE_BACKEND={name!r} is not a torch.compile backend; use one of {known}"
        )
    return name
