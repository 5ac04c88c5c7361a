"""Small accessors of megatron objects that several parts of the mcore engine use (a leaf module:
``engine`` and ``weights`` both import it, neither imports the other for it)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["torch_optimizers", "unwrap"]


def unwrap(module: Any) -> Any:
    """The model inside megatron's wrappers (DDP, ``Float16Module``): follows ``.module`` to the end."""
    while hasattr(module, "module"):
        module = module.module
    return module


def torch_optimizers(opt: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (one per sub-optimizer of a
    ``ChainedOptimizer``)."""
    if hasattr(opt, "chained_optimizers"):
        return [o.optimizer for o in opt.chained_optimizers]
    return [opt.optimizer]
