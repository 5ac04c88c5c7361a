"""Whether Triton runs its CPU interpreter, as Triton itself decides it."""

from __future__ import annotations

import triton

from underlay.utils import env

__all__ = ["triton_interprets"]


def triton_interprets() -> bool:
    """Triton's own reading of ``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``, Triton >= 3.4:
    ``1``/``true``/``on``/``yes``/``y`` in any case); older Triton compared the raw value with ``"1"``.
    Asking Triton keeps underlay's view (CPU tensors accepted, one tile configuration) the same as the
    one Triton applies when it defines the kernels."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return env.get("TRITON_INTERPRET") == "1"
