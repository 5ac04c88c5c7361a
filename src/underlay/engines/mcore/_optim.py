"""Gradients, the optimizer step and offloading of the mcore engine."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from underlay.engines.mcore._adapters import MCoreAdapters
from underlay.engines.mcore._chunks import torch_optimizers as _torch_optimizers
from underlay.interfaces import (
    OptimizerStepResult,
)


class MCoreOptim(MCoreAdapters):
    """Gradient reduction, the (skipping, clipping) optimizer step, the LR schedule and offloading."""

    def finalize_grads(self) -> None:
        """Reduce the gradients accumulated since the last ``zero_grad`` once: megatron's
        ``finalize_model_grads`` (data-parallel all-reduce or reduce-scatter, TP all-reduce of the
        replicated norm weights, tied-embedding sync over the pipeline). ``optimizer_step`` calls it;
        call it yourself only to read ``main_grad``; a ``forward_backward`` after it and before
        ``optimizer_step``/``zero_grad`` raises ``InvalidInput`` (its gradients would be reduced
        twice). Idempotent. Collective."""
        if self._grads == "local":
            self._finalize_model_grads(self._chunks, num_tokens=None)
        if self._grads != "clean":
            self._grads = "reduced"

    def zero_grad(self) -> None:
        """Drop accumulated gradients (megatron's grad buffers are zeroed). With
        ``overlap_grad_reduce`` after a ``forward_backward`` it first waits for the reductions that
        call started (megatron allows one outstanding per bucket; none is started here)."""
        if self._opts.overlap_grad_reduce and self._grads == "local":
            for c in self._chunks:
                for group in [*c.bucket_groups, *c.expert_parallel_bucket_groups]:  # type: ignore[misc]
                    handle = getattr(group, "grad_reduce_handle", None)
                    if handle is not None:
                        handle.wait()
                        group.grad_reduce_handle = None
        for c in self._chunks:
            c.zero_grad_buffer()  # type: ignore[operator]
        self._optimizer.zero_grad()
        self._grads = "clean"
        self._skip_next = False

    def _drop_grads(self) -> None:
        """``zero_grad`` after a failed ``forward_backward``: also drops any ``param.grad`` that
        megatron's DDP hook had not yet moved into its buffer (``main_grad``)."""
        self.zero_grad()
        for c in self._chunks:
            for p in c.parameters():
                p.grad = None

    def _sync_master_params(self) -> None:
        """Copy the model parameters into the optimizer's fp32 master copies when something wrote the
        parameters outside the optimizer (``copy_full_parameter``: ``load_hf``, weight sync): with bf16/fp16
        parameters megatron's optimizer steps its masters and copies them back, so a load it missed
        would be undone by the next step. No-op for fp32 parameters (no masters) and when clean."""
        if self._masters_stale:
            with torch.no_grad():
                self._optimizer.reload_model_params()
            self._masters_stale = False

    def optimizer_step(self) -> OptimizerStepResult:
        """Global grad norm over all shards (TP, PP, DP, EP); a non-finite norm skips the update
        (parameters and optimizer state unchanged); otherwise clip to ``optim.grad_clip`` and step.
        Gradients are zeroed in both cases; ``global_step`` grows.

        The norm is computed on the device and read on the host once per step (one all-reduce per
        sub-optimizer, one device->host read, needed to decide the skip); clipping reuses it instead of
        computing it a second time (megatron's ``clip_grad_norm`` would)."""
        self._ensure_onloaded("optimizer_step")
        opt = self._optimizer
        lr = float(_torch_optimizers(opt)[0].param_groups[0]["lr"])
        self._sync_master_params()
        self.finalize_grads()
        opt.prepare_grads()
        norm = _grad_norm(opt, self._torch_device)
        skipped = not math.isfinite(norm) or self._skip_next
        self._skip_next = False
        if not skipped:
            clip = self._config.optim.grad_clip
            if clip is not None and clip > 0:
                _clip_by_norm(opt, clip, norm)
            opt.step_with_ready_grads()
            # megatron gathers the updated shards in the next forward's pre-hooks
            self._gather_pending = self._opts.overlap_param_gather
        self.zero_grad()
        self._global_step += 1
        return OptimizerStepResult(grad_norm=norm, skipped=skipped, lr=lr)

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule one step; returns the new learning rate."""
        for s in self._schedulers:
            s.step()
        return float(_torch_optimizers(self._optimizer)[0].param_groups[0]["lr"])

    # ------------------------------------------------------------------------------ offloading

    def _param_tensors(self) -> list[torch.Tensor]:
        return [p for c in self._chunks for p in c.parameters()]

    def _grad_tensors(self) -> list[torch.Tensor]:
        out = []
        for c in self._chunks:
            for buf in list(getattr(c, "buffers", [])) + list(getattr(c, "expert_parallel_buffers", [])):
                out.append(buf.grad_data)
        return out

    def _optim_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for inner in _torch_optimizers(self._optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    out.append(p)
                    for v in inner.state.get(p, {}).values():
                        if torch.is_tensor(v) and v.dim() > 0:
                            out.append(v)
        return out

    def offload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Copy the chosen state to host memory and shrink the device storage to nothing (megatron's
        views into its buffers stay valid: storage is swapped, not the tensors). Idempotent per kind."""
        self._finish_param_gather()
        for kind, on, get in (
            ("params", params, self._param_tensors),
            ("grads", grads, self._grad_tensors),
            ("optimizer", optimizer, self._optim_tensors),
        ):
            if on and kind not in self._offloaded:
                self._offloaded[kind] = _swap_out(get(), self._device.is_accelerator)
        self._device.synchronize()
        self._device.empty_cache()

    def onload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Bring offloaded state back; values are bit-identical to before ``offload``."""
        for kind, on in (("params", params), ("grads", grads), ("optimizer", optimizer)):
            if on and kind in self._offloaded:
                _swap_in(self._offloaded.pop(kind))
        self._device.synchronize()


def _grad_norm(opt: Any, device: torch.device) -> float:
    """The global L2 norm of the main gradients of megatron optimizer ``opt`` (a ``ChainedOptimizer``
    or one optimizer), as megatron's ``get_grad_norm`` defines it: each sub-optimizer's gradients for
    the norm (shared and TP-duplicated parameters counted once), their squared norms summed over that
    sub-optimizer's grad-stats group, and the square root of the total.

    Computed on the device with ``torch._foreach_norm`` and read once: megatron's fallback without
    apex (``local_multi_tensor_l2_norm``) builds a host tensor from one device scalar per parameter,
    a device synchronisation per parameter (about 200 a step on a 28-layer model). Every rank runs the
    same sequence of all-reduces (stub sub-optimizers of ranks without parameters contribute zero)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for o in getattr(opt, "chained_optimizers", [opt]):
        getter = getattr(o, "get_grads_for_grad_norm", None) or o.get_main_grads_for_grad_norm
        grads = [] if getattr(o, "is_stub_optimizer", False) else list(getter())
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            norms = torch._foreach_norm([g.float() for g in grads], 2.0)
            sq = torch.stack(norms).pow(2).sum()
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=o.get_grad_stats_parallel_group())
        total = total + sq
    return float(total.sqrt())


def _clip_by_norm(opt: Any, clip: float, norm: float) -> None:
    """Scale every (sub-)optimizer's main gradients by ``min(1, clip / (norm + 1e-6))`` with megatron's
    ``clip_grad_by_total_norm_fp32``, as its ``ChainedOptimizer.step`` does with one global norm."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for o in getattr(opt, "chained_optimizers", [opt]):
        if getattr(o, "is_stub_optimizer", False):
            continue
        params = o.get_parameters()
        if params:
            decoupled = bool(getattr(o.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))
            clip_grad_by_total_norm_fp32(params, clip, norm, decoupled)


def _swap_out(tensors: list[torch.Tensor], pin: bool) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    saved = []
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
        host.untyped_storage().copy_(storage)
        saved.append((t, host, storage.nbytes()))
        storage.resize_(0)
    return saved


def _swap_in(saved: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    for t, host, nbytes in saved:
        storage = t.untyped_storage()
        storage.resize_(nbytes)
        storage.copy_(host.untyped_storage())
