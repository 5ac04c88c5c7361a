"""The fsdp2 engine's optimizer (AdamW, host-offloaded AdamW or another ``torch.optim`` optimizer by
name) and LR schedule, its gradients, the optimizer step, and ``offload``/``onload``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from underlay.engines.fsdp2._grad_sync import _fsdp_params
from underlay.engines.fsdp2._params import FSDP2Params
from underlay.engines.fsdp2.options import FSDP2Options
from underlay.interfaces import (
    ConfigError,
    Device,
    OptimizerStepResult,
)


class FSDP2Optim(FSDP2Params):
    """The optimizer and LR schedule, gradients (FSDP2's sync and reshard switches, dropping them)
    and moving state to and from host memory."""

    def _build_optimizer(self, model: torch.nn.Module, options: FSDP2Options, device: Device) -> None:
        """The optimizer over the trainable sharded parameters and its LR schedule."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        fused = bool(options.fused_adamw) and device.is_accelerator
        optim = self._config.optim
        optimizer: torch.optim.Optimizer
        if optim.name.lower() != "adamw":
            optimizer = _named_optimizer(trainable, optim, bool(options.optimizer_offload))
        elif options.optimizer_offload:
            from underlay.engines.fsdp2.optim_offload import HostOffloadAdamW

            optimizer = HostOffloadAdamW(
                trainable,
                lr=optim.lr,
                betas=optim.betas,
                eps=optim.eps,
                weight_decay=optim.weight_decay,
                fused=fused,
                pin_memory=device.is_accelerator,
            )
        else:
            optimizer = torch.optim.AdamW(
                trainable,
                lr=optim.lr,
                betas=optim.betas,
                eps=optim.eps,
                weight_decay=optim.weight_decay,
                **({"fused": True} if fused else {"foreach": True}),
            )
        from underlay.ops import build_lr_scheduler

        self._optimizer = optimizer
        self._scheduler = build_lr_scheduler(optimizer, optim)

    def _set_reshard_after_backward(self, value: bool) -> None:
        setter = getattr(self._model, "set_reshard_after_backward", None)
        if callable(setter):
            setter(value)

    def _set_requires_gradient_sync(self, value: bool) -> None:
        """Whether the next backward reduce-scatters gradients, for the root and every layer."""
        setter = getattr(self._model, "set_requires_gradient_sync", None)
        if callable(setter):
            setter(value)

    def _drop_unreduced_grads(self) -> None:
        """After a failed ``forward_backward``: reset FSDP's per-iteration state (in-flight collectives
        waited on, parameters resharded, the backward bookkeeping of an interrupted backward cleared)
        and drop the unsharded gradients FSDP holds between backward passes: the reduce-dtype
        accumulation of ``grad_sync="per_step"`` and a layer's gradient whose reduction never ran
        (``reset_iter_state`` keeps both, and the next backward would add to them). These live on
        FSDP2's internal ``FSDPParam`` objects (torch 2.13: ``unsharded_accumulated_grad`` and
        ``_unsharded_param``); ``tests/distributed/test_fsdp2_grad_sync.py`` checks that the step after
        a failure equals a clean one."""
        reset = getattr(self._model, "reset_iter_state", None)
        if callable(reset):
            reset()
        for fsdp_param in _fsdp_params(self._model):
            if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None

    def zero_grad(self) -> None:
        """Drop accumulated gradients (set to ``None``); nothing to drop for ``role="reference"``."""
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=True)
        self._grads_pending = False
        self._skip_next = False

    def optimizer_step(self) -> OptimizerStepResult:
        """Clip to ``optim.grad_clip`` by the global L2 norm over all shards, then step AdamW; a
        non-finite norm, or a non-finite loss/metric in a ``forward_backward`` since the last step or
        ``zero_grad``, skips the update on every rank. Gradients are zeroed in both cases;
        ``global_step`` grows. ``UnsupportedOperation`` for ``role="reference"``."""
        optimizer = self._trainable("optimizer_step")
        self._ensure_onloaded("optimizer_step")
        params = [p for p in self._model.parameters() if p.requires_grad and p.grad is not None]
        lr = float(optimizer.param_groups[0]["lr"])
        clip = self._config.optim.grad_clip
        if params:
            if clip is not None and clip > 0:
                norm_t = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            else:
                norm_t = torch.nn.utils.get_total_norm(
                    [p.grad for p in params if p.grad is not None], foreach=True
                )
            if isinstance(norm_t, DTensor):
                norm_t = norm_t.full_tensor()
            norm = float(norm_t.item())
        else:
            norm = 0.0
        # a non-finite loss or metric since the last step (reported by forward_backward) skips too
        skipped = not math.isfinite(norm) or self._skip_next
        if not skipped:
            optimizer.step()
            if self._single is not None:
                self._single.invalidate()
        self.zero_grad()
        self._global_step += 1
        return OptimizerStepResult(grad_norm=norm, skipped=skipped, lr=lr)

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule one step; returns the new learning rate. ``UnsupportedOperation`` for
        ``role="reference"``."""
        optimizer = self._trainable("lr_scheduler_step")
        self._scheduler.step()
        return float(optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------------------ offloading

    def offload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move parameters, gradients and/or optimizer state to host memory and release the device
        memory (``device.empty_cache``). Idempotent per kind. With ``cpu_offload`` the sharded
        parameters already live on the host and stay there. A reference engine has only parameters
        (``grads``/``optimizer`` move nothing)."""
        host = torch.device("cpu")
        pin = self._device.is_accelerator
        if self._act_offload is not None:
            self._act_offload.release()  # held activations and the free pinned buffers
        if grads and "grads" not in self._offloaded:
            saved = {}
            for i, p in enumerate(self._model.parameters()):
                if p.grad is not None:
                    saved[i] = _to_host(p.grad, pin)
                    p.grad = None
            self._offloaded["grads"] = saved
        if optimizer and "optimizer" not in self._offloaded and self._optimizer is not None:
            state: dict[int, dict[str, Any]] = {}
            # optimizer_offload: the AdamW state already lives in host memory; nothing to move
            host_state = bool(self._options.optimizer_offload)
            for i, group_param in enumerate([] if host_state else _optim_params(self._optimizer)):
                entry = self._optimizer.state.get(group_param)
                if entry:
                    state[i] = {k: _to_host(v, pin) for k, v in entry.items()}
                    self._optimizer.state[group_param] = {}
            self._offloaded["optimizer"] = state
        if params and "params" not in self._offloaded:
            if self._single is not None:
                self._single.release()  # rebuilt from the masters at the next forward
            if not self._config.cpu_offload and self._device.is_accelerator:
                self._model.to(host)
            self._offloaded["params"] = True
        self._device.synchronize()
        self._device.empty_cache()

    def onload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Bring offloaded state back to where it lived before ``offload``; values are bit-identical."""
        moved = params and self._offloaded.pop("params", None) is not None
        if moved and not self._config.cpu_offload and self._device.is_accelerator:
            self._model.to(self._torch_device)
        if grads and "grads" in self._offloaded:
            saved = self._offloaded.pop("grads")
            for i, p in enumerate(self._model.parameters()):
                if i in saved:
                    p.grad = _to_device(saved[i])
        if optimizer and "optimizer" in self._offloaded and self._optimizer is not None:
            state = self._offloaded.pop("optimizer")
            for i, group_param in enumerate(_optim_params(self._optimizer)):
                if i in state:
                    self._optimizer.state[group_param] = {k: _to_device(v) for k, v in state[i].items()}
        self._device.synchronize()


def _optim_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


@dataclass(frozen=True)
class _Saved:
    """A host copy of a tensor (or a DTensor's local shard) and what is needed to rebuild it."""

    host: torch.Tensor
    device: torch.device
    dtensor: tuple[Any, ...] | None


def _to_host(t: Any, pin: bool) -> Any:
    """``_Saved`` host copy of a tensor or DTensor; other values are returned unchanged."""
    if not torch.is_tensor(t):
        return t
    meta = None
    local = t
    if isinstance(t, DTensor):
        local = t.to_local()
        meta = (t.device_mesh, t.placements, t.shape, t.stride())
    host = torch.empty_like(local, device="cpu", pin_memory=pin and local.device.type != "cpu")
    host.copy_(local)
    return _Saved(host, local.device, meta)


def _to_device(saved: Any) -> Any:
    """Inverse of ``_to_host``: the same values on the device they came from."""
    if not isinstance(saved, _Saved):
        return saved
    local = saved.host.to(saved.device)
    if saved.dtensor is None:
        return local
    mesh, placements, shape, stride = saved.dtensor
    return DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)


def _named_optimizer(params: list[torch.nn.Parameter], optim: Any, offload: bool) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer ``optim.name`` (not AdamW) over ``params``: ``lr``,
    ``weight_decay``, the ``betas``/``eps`` it takes, and ``optim.options`` (validated by
    ``OptimConfig``). Host-offloaded state exists for AdamW only: ``ConfigError`` with
    ``optimizer_offload``."""
    from underlay.interfaces.config import optimizer_class, standard_optimizer_args

    cls = optimizer_class(optim.name)
    if offload:
        raise ConfigError(
            f"optimizer_offload keeps AdamW's state in host memory; OptimConfig.name={optim.name!r} has no "
            "host-offloaded variant: use name='adamw' or turn optimizer_offload off (engine.offload() still "
            "moves any optimizer's state between steps)"
        )
    kw = {k: getattr(optim, k) for k in standard_optimizer_args(cls)}
    opt: torch.optim.Optimizer = cls(
        params, lr=optim.lr, weight_decay=optim.weight_decay, **kw, **optim.options
    )
    return opt
