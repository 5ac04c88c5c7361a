"""FSDP2's per-parameter-group state, as ``grad_sync="per_step"`` and the recovery of a failed
``forward_backward`` need it: the ``FSDPParamGroup``/``FSDPParam`` objects of a sharded model and the
zero accumulations of parameters whose first gradient comes in the syncing micro-batch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


def _fsdp_param_groups(model: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's parameter groups (``FSDPParamGroup``: one reduce-scatter each) of every ``FSDPModule``
    in ``model``."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch before the list of groups per module
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        yield from groups


def _fsdp_params(model: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's per-parameter state objects (``FSDPParam``) of every ``FSDPModule`` in ``model``."""
    for group in _fsdp_param_groups(model):
        yield from group.fsdp_params


@dataclass
class _ZeroFilled:
    """An accumulator ``_fill_late_accumulators`` created, and whether a gradient reached it."""

    fsdp_param: Any
    handle: Any
    used: bool = False


def _fill_late_accumulators(model: torch.nn.Module) -> list[_ZeroFilled]:
    """Before the syncing (last) micro-batch of ``grad_sync="per_step"``: FSDP2 reduce-scatters one
    parameter group in one dtype, so a parameter whose first gradient of the step comes in that
    micro-batch (compute dtype) next to group members holding a reduce-dtype accumulation (a vision
    tower's merger on the first image micro-batch, a module skipped until then) would fail the reduce.
    Such parameters get a zero accumulation in the reduce dtype, and a hook that records whether
    autograd gives them a gradient; ``_unfill`` drops the sharded gradient of those that got none, so
    they stay without a gradient as with per-micro-batch sync."""
    filled: list[_ZeroFilled] = []
    for group in _fsdp_param_groups(model):
        params = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        held = [fp.unsharded_accumulated_grad for fp in params if fp.unsharded_accumulated_grad is not None]
        if not held or len(held) == len(params):
            continue
        for fp in params:
            if fp.unsharded_accumulated_grad is not None:
                continue
            fp.unsharded_accumulated_grad = torch.zeros_like(fp.unsharded_param, dtype=held[0].dtype)
            entry = _ZeroFilled(fp, None)

            def mark(_param: torch.Tensor, entry: _ZeroFilled = entry) -> None:
                entry.used = True

            entry.handle = fp.unsharded_param.register_post_accumulate_grad_hook(mark)
            filled.append(entry)
    return filled


def _unfill(filled: list[_ZeroFilled], completed: bool) -> None:
    """Remove ``_fill_late_accumulators``'s hooks; after a completed step, drop the (zero) sharded
    gradient of each filled parameter that no micro-batch gave a gradient."""
    for entry in filled:
        entry.handle.remove()
        if completed and not entry.used:
            entry.fsdp_param.sharded_param.grad = None
