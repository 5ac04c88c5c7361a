"""underlay: the hardware and parallelism foundation for RL post-training of LLMs.

``import underlay`` does no work: it imports no accelerator extension, kernel library, transformers or
ray, touches no device and sets no global state. Backends are imported when first selected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from underlay._version import __version__

__all__ = [
    "LossContext",
    "Metric",
    "__version__",
    "get_attention",
    "get_device",
    "get_engine",
    "get_logprob_kernel",
    "get_profiler",
    "get_quantizer",
    "get_weight_loader",
    "init_distributed",
]

_LAZY = {
    "LossContext": "underlay.interfaces",
    "Metric": "underlay.interfaces",
    "get_attention": "underlay.registry",
    "get_device": "underlay.registry",
    "get_engine": "underlay.registry",
    "get_logprob_kernel": "underlay.registry",
    "get_profiler": "underlay.registry",
    "get_quantizer": "underlay.registry",
    "get_weight_loader": "underlay.registry",
    "init_distributed": "underlay.parallel.distributed",
}

if TYPE_CHECKING:
    from underlay.interfaces import LossContext, Metric
    from underlay.parallel.distributed import init_distributed
    from underlay.registry import (
        get_attention,
        get_device,
        get_engine,
        get_logprob_kernel,
        get_profiler,
        get_quantizer,
        get_weight_loader,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'underlay' has no attribute {name!r}")
