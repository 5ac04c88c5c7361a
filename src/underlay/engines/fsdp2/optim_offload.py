"""AdamW whose state lives in host memory and is streamed through the device in chunks.

``HostOffloadAdamW`` keeps ``exp_avg`` and ``exp_avg_sq`` of every parameter in (pinned, on
accelerators) host memory. ``step`` walks the parameters in chunks of about ``chunk_bytes`` of state:
chunk ``i + 1`` is copied host-to-device on one side stream while the AdamW kernel updates chunk ``i``
on the compute stream, and the updated state of chunk ``i`` goes back device-to-host on a second side
stream; so the device holds about three chunks of state at a time, never all of it. The update is the
same ``torch.optim.adamw.adamw`` call with the same ``fused``/``foreach`` choice as the engine's normal
optimizer, on the same tensors, so the parameters are bit-identical to a run without offload (the
kernels are elementwise per parameter: chunking does not change any value).

The parameters and gradients stay where they are (the device; for FSDP2 the local shards of the
DTensors). A state entry of a DTensor parameter is a DTensor with the same mesh and placements whose
local tensor is on the host, so ``torch.distributed.checkpoint`` saves and reshards it like any
optimizer state; ``load_state_dict`` copies into the host tensors (the state never moves to the device).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_functional

from underlay.engines.fsdp2.defaults import OFFLOAD_CHUNK_BYTES
from underlay.interfaces import CheckpointError, ConfigError

__all__ = ["HostOffloadAdamW"]

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class HostOffloadAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, no amsgrad) with its state in host memory; see the module doc.

    ``params``: the trainable parameters (fp32, on the device or DTensors whose local shards are);
    ``fused``: use the fused kernel (accelerators) else the foreach one; ``chunk_bytes``: state bytes
    (``exp_avg`` + ``exp_avg_sq``) per streamed chunk, >= 1; ``pin_memory``: pin the host state (True
    on accelerators: needed for asynchronous copies). The state is allocated (zeros) at construction,
    so ``state_dict`` is complete before the first step. ``ConfigError`` for a bad ``chunk_bytes`` or
    a non-floating parameter."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        fused: bool,
        chunk_bytes: int = OFFLOAD_CHUNK_BYTES,
        pin_memory: bool = False,
    ) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ConfigError(
                f"HostOffloadAdamW chunk_bytes={chunk_bytes!r}: use an int >= 1 (bytes of state)"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(list(params), defaults)
        self._fused = fused
        self._chunk_bytes = chunk_bytes
        self._pin = pin_memory
        self._streams: tuple[Any, Any] | None = None
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_floating_point():
                    raise ConfigError(f"HostOffloadAdamW: parameter of dtype {p.dtype}; AdamW needs floats")
                self.state[p] = self._new_state(p)

    def _host_like(self, p: torch.Tensor) -> torch.Tensor:
        local = _local(p)
        pin = self._pin and local.device.type != "cpu"
        host = torch.zeros(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
        if isinstance(p, DTensor):
            # the constructor, not ``DTensor.from_local``: that one moves the local tensor to the mesh's
            # device type, which would put the whole state back on the accelerator (FSDP2's own CPU
            # offload builds its host-resident shards the same way)
            return DTensor(host, p._spec, requires_grad=False)  # type: ignore[no-untyped-call]
        return host

    def _new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        local = _local(p)
        # torch's AdamW keeps ``step`` on the device for the fused kernel, on the host otherwise
        step_device = local.device if self._fused else torch.device("cpu")
        return {
            "step": torch.zeros((), dtype=torch.float32, device=step_device),
            "exp_avg": self._host_like(p),
            "exp_avg_sq": self._host_like(p),
        }

    @property
    def chunk_bytes(self) -> int:
        """State bytes per streamed chunk."""
        return self._chunk_bytes

    def _chunks(self, items: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        out: list[list[torch.Tensor]] = []
        cur: list[torch.Tensor] = []
        size = 0
        for p in items:
            nbytes = 2 * _local(p).numel() * _local(p).element_size()
            if cur and size + nbytes > self._chunk_bytes:
                out.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += nbytes
        if cur:
            out.append(cur)
        return out

    def _side_streams(self, device: torch.device) -> tuple[Any, Any] | None:
        if device.type == "cpu":
            return None
        if self._streams is None:
            mod = getattr(torch, device.type)
            self._streams = (mod.Stream(device), mod.Stream(device))
        return self._streams

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One AdamW update of every parameter with a gradient (``closure`` is not supported: pass
        ``None``). Returns when the updated state is back in host memory."""
        if closure is not None:
            raise ConfigError("HostOffloadAdamW.step does not take a closure")
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if not with_grad:
                continue
            self._step_group(group, with_grad)

    def _step_group(self, group: Mapping[str, Any], params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        device = _local(params[0]).device
        streams = self._side_streams(device)
        chunks = self._chunks(params)

        def load(chunk: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
            out = []
            for p in chunk:
                st = self.state[p]
                out.append({k: _local(st[k]).to(device, non_blocking=True) for k in _STATE_KEYS})
            return out

        def update(chunk: list[torch.Tensor], dev_state: list[dict[str, torch.Tensor]]) -> None:
            adamw_functional(
                [_local(p) for p in chunk],
                [_local(p.grad) for p in chunk if p.grad is not None],
                [s["exp_avg"] for s in dev_state],
                [s["exp_avg_sq"] for s in dev_state],
                [],
                [self.state[p]["step"] for p in chunk],
                foreach=None if self._fused else True,
                fused=True if self._fused else None,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )

        def store(chunk: list[torch.Tensor], dev_state: list[dict[str, torch.Tensor]]) -> None:
            for p, s in zip(chunk, dev_state):
                st = self.state[p]
                for k in _STATE_KEYS:
                    _local(st[k]).copy_(s[k], non_blocking=True)

        if streams is None:  # cpu: the "device" is the host; same code, no streams
            for chunk in chunks:
                dev_state = load(chunk)
                update(chunk, dev_state)
                store(chunk, dev_state)
            return
        mod = getattr(torch, device.type)
        h2d, d2h = streams
        compute = mod.current_stream(device)
        h2d.wait_stream(compute)  # gradients and parameters are ready
        with mod.stream(h2d):
            nxt = load(chunks[0])
        for i, chunk in enumerate(chunks):
            cur = nxt
            compute.wait_stream(h2d)  # chunk i is on the device
            if i + 1 < len(chunks):
                with mod.stream(h2d):  # overlaps the update of chunk i
                    nxt = load(chunks[i + 1])
            update(chunk, cur)
            d2h.wait_stream(compute)
            with mod.stream(d2h):
                store(chunk, cur)
            for s in cur:  # the allocator reuses these blocks only after both streams used them
                for t in s.values():
                    t.record_stream(compute)
                    t.record_stream(d2h)
            del cur
        d2h.synchronize()  # the host state is complete before anyone reads it

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy a ``state_dict`` of this optimizer (as ``state_dict()`` or ``torch.distributed
        .checkpoint`` produce it) into the host state and the parameter groups' hyperparameters; the
        state stays on the host. ``CheckpointError`` when the groups or state shapes do not match,
        before anything is written."""
        groups = state_dict.get("param_groups")
        state = state_dict.get("state")
        if (
            not isinstance(groups, list)
            or not isinstance(state, Mapping)
            or len(groups) != len(self.param_groups)
        ):
            raise CheckpointError(
                "HostOffloadAdamW.load_state_dict: the state dict's param_groups do not match"
            )
        pairs: list[tuple[torch.Tensor, Mapping[str, Any]]] = []
        for saved, mine in zip(groups, self.param_groups):
            ids = saved.get("params", [])
            if len(ids) != len(mine["params"]):
                raise CheckpointError(
                    f"HostOffloadAdamW.load_state_dict: a group of {len(ids)} parameters for one of "
                    f"{len(mine['params'])}"
                )
            for pid, p in zip(ids, mine["params"]):
                entry = state.get(pid)
                if entry is None:
                    continue
                for k in _STATE_KEYS:
                    if k not in entry or tuple(entry[k].shape) != tuple(self.state[p][k].shape):
                        raise CheckpointError(
                            f"HostOffloadAdamW.load_state_dict: state {k!r} missing or misshaped"
                        )
                pairs.append((p, entry))
        for p, entry in pairs:
            st = self.state[p]
            for k in _STATE_KEYS:
                _local(st[k]).copy_(_local(entry[k]))
            st["step"].copy_(torch.as_tensor(entry["step"], dtype=torch.float32))
        for saved, mine in zip(groups, self.param_groups):
            for key, value in saved.items():
                if key != "params":
                    mine[key] = value
