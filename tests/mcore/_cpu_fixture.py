"""Test-only: run megatron-core on the CPU by mapping its direct CUDA calls to the CPU.

megatron-core calls ``torch.cuda`` in many places (current device, RNG state and seeding, streams and
events, ``device="cuda"`` allocations, ``.cuda()``, ``Tensor.type()`` checks in its optimizers, the MoE
dispatcher's device-to-host copy of its split sizes) and gives gloo the uneven all-gather and
reduce-scatter that NCCL has (MoE under expert tensor parallelism). This
module replaces those process-wide: it changes global torch behaviour, so it lives in ``tests/`` and is
installed only inside test processes (``install()``, idempotent). It also sets
``UNDERLAY_MCORE_CPU_FIXTURE=1``, the switch that lets ``MCoreEngine`` accept a CPU device; nothing
in ``src/`` installs it. Numerics are real (fp32 on the CPU); only device placement is rewritten.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install"]

_INSTALLED = False


def _cpu_device(value: Any) -> Any:
    """``cuda``/``cuda:N``/an int index -> ``cpu``; anything else unchanged."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device=`` arguments, ``.to(cuda)``, ``.cuda()``, ``pin_memory=True`` and
    ``Tensor.type()`` (reported as the cuda type, which megatron's optimizers check)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "to" and len(args) > 1:
            args = (args[0], _cpu_device(args[1]), *args[2:])
        if name == "type" and args and isinstance(args[0], torch.Tensor) and len(args) == 1 and not kwargs:
            result = func(*args)
            return result.replace("torch.", "torch.cuda.", 1) if "cuda" not in result else result
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        return func(*args, **kwargs)


class _Stream:
    """A stand-in for ``torch.cuda.Stream``: everything runs on the one CPU stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Event:
    """A stand-in for ``torch.cuda.Event``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


@contextlib.contextmanager
def _stream_ctx(stream: Any = None) -> Iterator[None]:
    yield


def install() -> None:
    """Patch ``torch.cuda`` and enter the device-rewriting mode for the rest of the process."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    os.environ["UNDERLAY_MCORE_CPU_FIXTURE"] = "1"
    cuda = torch.cuda
    # a device object, not an index: autograd backward functions run outside the torch-function mode
    cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
    cuda.device_count = lambda: 1  # type: ignore[assignment]
    cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    cuda.empty_cache = lambda: None  # type: ignore[assignment]
    cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
    cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[assignment]
    cuda.Stream = _Stream  # type: ignore[assignment,misc]
    cuda.Event = _Event  # type: ignore[assignment,misc]
    cuda.stream = _stream_ctx  # type: ignore[assignment]
    cuda.current_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
    cuda.default_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
    cuda.memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]
    cuda.max_memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]
    cuda.nvtx.range_push = lambda *a, **k: None  # type: ignore[assignment]
    cuda.nvtx.range_pop = lambda *a, **k: None  # type: ignore[assignment]
    # megatron's RNG tracker restores states through this private helper
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(  # type: ignore[assignment]
        new_state
    )
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    _host_split_sizes()
    _uneven_gloo_collectives()
    mode = _CudaToCpu()
    mode.__enter__()


def _host_split_sizes() -> None:
    """MoE's alltoall dispatcher moves its split sizes to the host as numpy arrays through
    ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA tensors: on the
    CPU the sizes stay tensors and ``ProcessGroup.all_to_all_single`` rejects them ("incompatible
    function arguments"), so expert parallelism failed in its first all-to-all. Here a host tensor asked
    for as numpy becomes numpy too, which is what the GPU path hands to the collective."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            host = tensor.clone()  # a copy, as the device-to-host transfer makes
            return host.numpy() if as_numpy else host
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = to_host
    dispatcher.maybe_move_tensor_to_cpu = to_host  # imported by name there


def _uneven_gloo_collectives() -> None:
    """MoE's alltoall dispatcher under expert tensor parallelism gathers (forward) and reduce-scatters
    (backward) the routed tokens over the TP group with per-rank sizes that differ
    (``torch.distributed.all_gather`` / ``reduce_scatter`` with lists of unequal tensors). NCCL takes
    uneven lists; gloo's all_gather rejects them ("invalid tensor size"). On a gloo group with unequal
    sizes these are done exactly with the collectives gloo has: the gather as one broadcast per rank,
    the reduce-scatter as an all-reduce of the concatenation, of which each rank keeps its piece.
    Equal sizes and other backends take torch's own functions."""
    import torch.distributed as dist

    all_gather = dist.all_gather
    reduce_scatter = dist.reduce_scatter

    def uneven(tensors: list[torch.Tensor], group: Any) -> bool:
        return len({tuple(t.shape) for t in tensors}) > 1 and dist.get_backend(group) == "gloo"

    def gather(
        tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        if async_op or not uneven(tensor_list, group):
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        me = dist.get_rank(group)
        for r, out in enumerate(tensor_list):
            if r == me:
                out.copy_(tensor)
            dist.broadcast(out, src=dist.get_global_rank(group, r), group=group)
        return None

    def scatter(
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        if async_op or not uneven(input_list, group):
            return reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        full = torch.cat([t.reshape(-1) for t in input_list])
        dist.all_reduce(full, op=op, group=group)
        me = dist.get_rank(group)
        start = sum(t.numel() for t in input_list[:me])
        output.copy_(full[start : start + input_list[me].numel()].view_as(output))
        return None

    dist.all_gather = gather  # type: ignore[assignment]
    dist.reduce_scatter = scatter  # type: ignore[assignment]
