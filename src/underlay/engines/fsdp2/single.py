"""The fsdp2 engine's world-size-1 path (``FSDP2Options.single_device``): mixed precision without
``fully_shard``.

At one rank FSDP2 shards nothing, yet every step still pays its copy-in/copy-out: each forward casts
the fp32 parameters into a fresh compute-dtype buffer (``chunk_cat``, one copy per parameter), each
backward casts the gradients to the reduce dtype and "reduce-scatters" them over one rank before adding
them to the sharded gradients (measured: 88 ms of an 834 ms Llama-3.2-1B step on an H200,
``benchmarks/results/torchtitan.md``). ``ComputeCopy`` keeps what FSDP2 promises and drops the copies:

- the module's registered parameters stay the fp32 master weights (so the optimizer, gradient
  clipping, checkpoints, export, offload and ``load_hf`` see exactly what they see under FSDP2, as
  plain tensors instead of DTensors);
- a persistent compute-dtype copy of every parameter (``param_dtype``, e.g. bf16) is swapped into the
  modules for the span of a forward (``compute_view``) and swapped out after it; backward needs only
  the autograd graph, which holds the compute copies;
- each compute copy's gradient (compute dtype, one per micro-batch) is added by a post-accumulate-grad
  hook into the fp32 ``.grad`` of its master and then dropped: gradients accumulate in fp32 across
  micro-batches and ``forward_backward`` calls, as FSDP2 accumulates its fp32 sharded gradients;
- the compute copy is refreshed from the masters (``torch._foreach_copy_``) at the first forward after
  a master changed: once per optimizer step, and after ``load_checkpoint``, ``load_hf``, ``onload``.
  A change is detected by every master's version counter (any in-place write bumps it) and storage
  pointer (``module.to`` replaces the storage).

Numerics equal FSDP2's at one rank with ``reduce_dtype="float32"``: the same fp32 -> compute-dtype
cast, the same compute-dtype gradient cast to fp32 and added to the fp32 gradient
(``tests/distributed/test_fsdp2_single.py`` compares the two paths). Float inputs of the root module
and of every decoder layer are cast to the compute dtype inside ``compute_view``, as FSDP2's
``cast_forward_inputs`` does at those modules. When ``param_dtype`` is the masters' dtype the masters
themselves compute (no copy, no hook).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from underlay.interfaces import ConfigError

__all__ = ["ComputeCopy", "check_single_device", "to_empty_keeping_ties"]


def to_empty_keeping_ties(model: torch.nn.Module, device: torch.device | str) -> None:
    """``model.to_empty(device=device)`` with tied parameters kept tied: moving off the meta device
    gives every registration its own new ``Parameter`` (so a tied head and embedding would train
    apart); each parameter registered under several names gets the first registration's object back.
    (``fully_shard`` keeps ties itself; this is for the unsharded path.)"""
    groups: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                groups.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for slots in groups.values():
        owner, first = slots[0]
        kept = owner._parameters[first]
        for module, name in slots[1:]:
            module._parameters[name] = kept


def check_single_device(
    single: bool, given: bool | None, world: int, cpu_offload: bool, reshard: bool
) -> None:
    """``ConfigError`` when ``single_device`` (resolved value ``single``, the user's ``given``) cannot
    run: at a world size other than 1, with ``cpu_offload`` (the host-resident parameters are FSDP2's
    ``CPUOffloadPolicy``), or with ``reshard_after_forward=True`` (the path keeps its compute copy)."""
    if not single:
        return
    if world != 1:
        raise ConfigError(
            f"EngineConfig.options single_device=True needs world size 1, got {world}: leave it None (auto) "
            "or False to shard with fully_shard"
        )
    if cpu_offload:
        raise ConfigError(
            "EngineConfig.options single_device=True with EngineConfig.cpu_offload=True: the host-resident "
            "parameters need FSDP2; set single_device=False (or None) or cpu_offload=False"
        )
    if reshard and given:
        raise ConfigError(
            "EngineConfig.options single_device=True with reshard_after_forward=True: the world-size-1 path "
            "keeps its compute copy for the whole step; drop one of the two (single_device=False reshards)"
        )


class ComputeCopy:
    """The compute-dtype view of a (non-sharded) module whose parameters are fp32 masters.

    ``model``: the materialised module (its parameters are the masters, on their final device);
    ``compute_dtype``: the dtype forwards run in; ``cast_modules``: the modules whose floating-point
    forward inputs are cast to ``compute_dtype`` inside ``compute_view`` (the root and the decoder
    layers, where FSDP2 would cast them). Tied parameters (one ``Parameter`` registered under several
    names) get one compute copy. Not thread-safe; one per engine.
    """

    def __init__(
        self, model: torch.nn.Module, compute_dtype: torch.dtype, cast_modules: Sequence[torch.nn.Module]
    ) -> None:
        self._model = model
        self._dtype = compute_dtype
        # every registration of a parameter: (owner module, attribute name, master)
        self._slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
        unique: dict[int, torch.nn.Parameter] = {}
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is None:
                    continue
                self._slots.append((module, name, param))
                unique.setdefault(id(param), param)
        self._masters = list(unique.values())
        self._copies: dict[int, torch.nn.Parameter] | None = None
        self._seen: list[tuple[int, int]] = []
        self._active = False
        self._hooks = [m.register_forward_pre_hook(self._cast_inputs, with_kwargs=True) for m in cast_modules]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forwards run in."""
        return self._dtype

    def _needs_copy(self, master: torch.nn.Parameter) -> bool:
        return master.is_floating_point() and master.dtype != self._dtype

    def _marks(self) -> list[tuple[int, int]]:
        return [(m._version, m.data_ptr()) for m in self._masters]

    def _build(self) -> dict[int, torch.nn.Parameter]:
        """A compute copy per master that needs one (the master itself otherwise), with the gradient
        hook on the trainable ones."""
        copies: dict[int, torch.nn.Parameter] = {}
        for master in self._masters:
            if not self._needs_copy(master):
                copies[id(master)] = master
                continue
            copy = torch.nn.Parameter(master.detach().to(self._dtype), requires_grad=master.requires_grad)
            if master.requires_grad:
                copy.register_post_accumulate_grad_hook(_accumulate_into(master))  # type: ignore[no-untyped-call]
            copies[id(master)] = copy
        return copies

    def _refresh(self) -> dict[int, torch.nn.Parameter]:
        """The compute copies, (re)built or refreshed when any master changed since the last time."""
        marks = self._marks()
        if self._copies is None:
            self._copies = self._build()
        elif marks != self._seen:
            pairs = [(self._copies[id(m)], m) for m in self._masters if self._copies[id(m)] is not m]
            if pairs:
                with torch.no_grad():
                    torch._foreach_copy_([c for c, _ in pairs], [m for _, m in pairs])
        self._seen = marks
        return self._copies

    def invalidate(self) -> None:
        """Refresh the compute copies at the next ``compute_view`` whatever the version counters say
        (the engine calls it after every optimizer update)."""
        self._seen = []

    def release(self) -> None:
        """Free the compute copies (``offload``); the next ``compute_view`` rebuilds them from the
        masters."""
        self._copies = None
        self._seen = []

    def swap_in(self) -> None:
        """Register the compute copies in the modules (refreshed from the masters first when any
        changed) and cast float forward inputs of the cast modules to the compute dtype, until
        ``swap_out``. A backward run while they are in (recomputation needs them) accumulates into the
        masters' fp32 ``.grad``. ``RuntimeError`` when already swapped in."""
        if self._active:
            raise RuntimeError("ComputeCopy.swap_in: the compute copies are already in; call swap_out first")
        copies = self._refresh()
        for module, name, master in self._slots:
            module._parameters[name] = copies[id(master)]
        self._active = True

    def swap_out(self) -> None:
        """Register the masters again (idempotent)."""
        self._active = False
        for module, name, master in self._slots:
            module._parameters[name] = master

    @contextlib.contextmanager
    def compute_view(self) -> Iterator[None]:
        """``swap_in`` for the block, ``swap_out`` on exit (errors included)."""
        self.swap_in()
        try:
            yield
        finally:
            self.swap_out()

    def _cast_inputs(
        self, _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self._active:
            return None
        dtype = self._dtype

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)
            return x

        return tree_map(cast, args), tree_map(cast, kwargs)

    def remove(self) -> None:
        """Remove the input-cast hooks and free the copies (the module is left with its masters)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.release()


def _accumulate_into(master: torch.nn.Parameter) -> Any:
    """The post-accumulate-grad hook of ``master``'s compute copy: add its gradient (cast to the
    master's dtype) into ``master.grad`` and drop it from the copy."""

    def hook(copy: torch.Tensor) -> None:
        grad = copy.grad
        if grad is None:
            return
        with torch.no_grad():
            if master.grad is None:
                master.grad = grad.to(master.dtype)
            else:
                master.grad.add_(grad)
        copy.grad = None

    return hook
