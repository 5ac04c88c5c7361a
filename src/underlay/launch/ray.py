"""Ranks as Ray actors: worker groups, collective calls, batch dispatch, colocated roles, failures.

A ``WorkerGroup`` places ``world_size`` ranks as Ray actors in one placement group (one bundle per rank:
one accelerator of the device's Ray resource plus ``cpus_per_rank`` CPUs, ``PACK`` strategy so ranks fill
a node before the next one), sets each rank's rendezvous (``MASTER_ADDR`` / ``MASTER_PORT`` found free on
rank 0's node, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, the device's visible-devices variable) and runs
``underlay.init_distributed`` there. Ranks are numbered node by node (rank 0's node first, then the others
in the order their first bundle appears), so the ranks of one node are consecutive, as torchrun numbers
them. The controller (the driver process) then calls functions or engine methods on every rank.

Ray is found from the running driver (``ray.init`` already called) or started by ``ensure_ray``, which
honours ``RAY_ADDRESS`` (an existing cluster) and otherwise starts a local one. ``import underlay`` does
not import this module or Ray.

Failures: every collective wait polls all ranks together; the first rank whose call raised or whose
process died (killed, crashed, its node lost) makes the controller kill every actor of the group and
remove its placement group, then raise ``RankFailure`` naming the rank, its host and the cause. Ranks
blocked in a collective with the dead rank die with the group instead of waiting for the collective
timeout. A new group can be started in the same driver afterwards.

Pools and detached groups: a ``ResourcePool`` is one placement group that several worker groups use,
split into disjoint bundle ranges (rollout on its own range, a critic on another) or shared by groups
that each take a fraction (``share``) of every bundle (actor and reference on the same devices, taking
turns through ``ResourcePool.colocated``). A group started with ``detached=True`` outlives its driver
(named actors, a detached placement group); ``WorkerGroup.attach(name)`` gives a new driver its handle,
``detached_groups()`` lists them and ``remove_detached(name)`` ends one.

Data: ``TokenBatch`` shares and per-token outputs travel through Ray's object store as numpy arrays
(``ray.put`` once per data-parallel share; every rank of a model-parallel group gets the same object
ref), so a rank reads them from shared memory without a pickle copy; the rank copies a share once, onto
its device (or into private host memory on the cpu), before an engine sees it.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from underlay.interfaces import (
    ConfigError,
    Device,
    EngineConfig,
    InvalidInput,
    LossFn,
    OptimizerStepResult,
    ParallelConfig,
    ParallelEngine,
    ParallelLayout,
    StepResult,
    TokenBatch,
    TokenOutputs,
    UnderlayError,
    VisionInputs,
)
from underlay.utils import env as _env

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as _exc:  # pragma: no cover - exercised only without ray installed
    raise ImportError(
        f"underlay.launch.ray needs Ray ({_exc}); install it with: pip install 'underlay[ray]'"
    ) from _exc

__all__ = [
    "NAMESPACE",
    "EngineGroup",
    "PlacementTimeout",
    "PoolSlice",
    "RankFailure",
    "RankInfo",
    "RankResources",
    "ResourcePool",
    "WorkerGroup",
    "detached_groups",
    "dispatch_batch",
    "dp_coordinates",
    "ensure_ray",
    "gather_outputs",
    "remove_detached",
    "split_batch",
]

NAMESPACE = "underlay"
"""The Ray namespace of detached worker groups' named actors (any driver finds them there)."""


# ------------------------------------------------------------------------------------------ errors


class RankFailure(UnderlayError, RuntimeError):
    """A rank of a ``WorkerGroup`` failed: its call raised, or its process died (killed, crashed, node
    lost), or it did not answer within the call's timeout. ``rank``, ``host`` (node IP and hostname) and
    ``cause`` (one line: exception type and message, or how the process died) name it; ``detail`` holds
    Ray's full report (the remote traceback when there is one). The group is already shut down."""

    def __init__(self, rank: int, world_size: int, host: str, what: str, cause: str, detail: str) -> None:
        self.rank, self.world_size, self.host, self.cause, self.detail = rank, world_size, host, cause, detail
        super().__init__(
            f"rank {rank} of {world_size} on {host} failed during {what}: {cause}; the worker group was "
            "shut down (all its actors killed, its placement group removed)"
        )


class PlacementTimeout(UnderlayError, RuntimeError):
    """The cluster has the resources a group needs, but they stayed taken (by other groups or tasks)
    for the whole ``ready_timeout_s``; nothing of the group is left behind."""


# ------------------------------------------------------------------------------------ resources


@dataclass(frozen=True)
class RankResources:
    """What one rank reserves in Ray, and how it finds its accelerator.

    ``accelerator``: the Ray resource of one device (``"GPU"``, ``"NPU"``, or any custom resource), or
    ``None`` for cpu ranks. ``visible_devices_env``: the variable that restricts a process to devices
    (``CUDA_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``), or ``None``. ``cpus_per_rank``: CPUs
    reserved per rank (host work: data, tokenisation, the optimizer with cpu offload).

    A rank computes on the host with ``threads`` intra-op threads (``torch.set_num_threads``), set when
    it starts: the whole CPUs it reserved, at least 1. The thread count decides how CPU kernels split
    reductions, so tying it to the reservation (rather than to ``OMP_NUM_THREADS`` inherited from the
    driver) keeps a rank's numbers the same whatever environment started Ray.
    """

    accelerator: str | None = None
    visible_devices_env: str | None = None
    cpus_per_rank: float = 1.0

    def __post_init__(self) -> None:
        if self.accelerator is not None and (not self.accelerator or self.accelerator == "CPU"):
            raise ConfigError(
                f"RankResources.accelerator={self.accelerator!r}: give a device resource such as 'GPU' "
                "or 'NPU', or None for cpu ranks (CPUs are cpus_per_rank)"
            )
        if not self.cpus_per_rank >= 0 or (self.accelerator is None and self.cpus_per_rank <= 0):
            raise ConfigError(
                f"RankResources.cpus_per_rank={self.cpus_per_rank}: must be >= 0, and > 0 for cpu ranks"
            )

    @classmethod
    def from_device(cls, device: Device, cpus_per_rank: float = 1.0) -> RankResources:
        """The device backend's ``ray_resource`` and ``visible_devices_env`` (cpu: ``None`` for both)."""
        return cls(device.ray_resource, device.visible_devices_env, cpus_per_rank)

    @property
    def threads(self) -> int:
        """Intra-op threads of a rank: ``int(cpus_per_rank)``, at least 1."""
        return self.threads_at(1.0)

    def threads_at(self, share: float) -> int:
        """Intra-op threads of a rank holding ``share`` of its bundle: ``int(cpus_per_rank * share)``,
        at least 1."""
        return max(1, int(self.cpus_per_rank * share))

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of one rank."""
        out: dict[str, float] = {}
        if self.cpus_per_rank > 0:
            out["CPU"] = float(self.cpus_per_rank)
        if self.accelerator is not None:
            out[self.accelerator] = 1.0
        return out

    def actor_options(self, share: float = 1.0) -> dict[str, Any]:
        """``ActorClass.options(...)`` keywords reserving ``share`` (0 < share <= 1) of one bundle (GPU
        through ``num_gpus``, which Ray requires; other accelerators through ``resources``). Actors of
        several groups that each hold a share of the same bundle see the same accelerator ids."""
        opts: dict[str, Any] = {"num_cpus": self.cpus_per_rank * share}
        if self.accelerator == "GPU":
            opts["num_gpus"] = share
        elif self.accelerator is not None:
            opts["resources"] = {self.accelerator: share}
        return opts


@dataclass(frozen=True)
class RankInfo:
    """Where a rank runs: global ``rank`` of ``world_size``, ``local_rank`` on its node, ``node_id``,
    ``node_ip``, ``hostname``, ``pid``, the placement-group ``bundle`` index it holds, the accelerator ids
    Ray gave it (``accelerator_ids``, strings, empty for cpu or id-less custom resources), and the value of
    the visible-devices variable it was started with (``visible_devices``, ``None`` when not set)."""

    rank: int
    world_size: int
    local_rank: int
    node_id: str
    node_ip: str
    hostname: str
    pid: int
    bundle: int
    accelerator_ids: tuple[str, ...]
    visible_devices: str | None


def ensure_ray(**init_kwargs: Any) -> bool:
    """Make sure this driver is connected to Ray: nothing when ``ray.is_initialized()``, else
    ``ray.init(**init_kwargs)``, which joins ``RAY_ADDRESS`` when set and otherwise starts a local Ray
    (pass ``num_cpus=``, ``num_gpus=``, ``resources=`` for it). Returns whether this call started it
    (the caller then owns ``ray.shutdown()``)."""
    if ray.is_initialized():
        return False
    init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("log_to_driver", True)
    if _env.get_optional("RAY_ADDRESS"):  # an existing cluster: its resources are what they are
        for key in ("num_cpus", "num_gpus", "resources", "object_store_memory"):
            init_kwargs.pop(key, None)
    ray.init(**init_kwargs)
    return True


# -------------------------------------------------------------------------------- data parallel


def _ulysses(layout: ParallelLayout) -> int:
    # ``ulysses`` is the sequence-parallel (Ulysses) size; older layouts call it ``sp``
    size: Any = getattr(layout, "ulysses", None) or getattr(layout, "sp", 1)
    return int(size)


def dp_coordinates(rank: int, layout: ParallelLayout) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of global ``rank``: which data-parallel share it consumes.

    Computed from the layout's sizes alone, in the rank order the engines build their meshes with,
    fastest-varying first: ``tp``, ``ulysses``, ``cp``, then data parallel (``dp_replicate * dp_shard /
    ulysses`` shares), then ``pp``. So ``dp_rank = (rank // (tp * ulysses * cp)) % dp_size``. This is
    fsdp2's data mesh ``("dp", "ulysses")`` (Ulysses ranks consecutive; tp = cp = pp = 1 there) and
    Megatron-Core's default ``tp-cp-ep-dp-pp`` order (``ep`` overlaps the data ranks and does not
    change the share; ulysses = 1 there). Ranks of one model-parallel group (same dp rank, same pp
    stage) get the same share; every pipeline stage gets every share.

    Raises ``InvalidInput`` when ``rank`` is outside ``[0, layout.world_size)``.
    """
    if not 0 <= rank < layout.world_size:
        raise InvalidInput(f"dp_coordinates: rank {rank} is outside [0, world_size={layout.world_size})")
    inner = layout.tp * _ulysses(layout) * layout.cp
    return (rank // inner) % layout.dp, layout.dp


def split_batch(batch: TokenBatch, parts: int) -> list[TokenBatch]:
    """``batch`` cut into ``parts`` contiguous row ranges in order; the first ``B % parts`` shares hold one
    row more than the rest (uneven batches are allowed). Concatenating the shares gives ``batch`` back.
    Raises ``InvalidInput`` when ``parts < 1`` or the batch has fewer rows than ``parts`` (a rank with no
    rows cannot take part in a step)."""
    n = batch.batch_size
    if parts < 1:
        raise InvalidInput(f"split_batch: parts={parts} must be >= 1")
    if n < parts:
        raise InvalidInput(
            f"split_batch: a batch of {n} rows cannot be split over {parts} data-parallel ranks; give at "
            f"least {parts} rows"
        )
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(batch.select(list(range(start, start + size))))
        start += size
    return out


def dispatch_batch(batch: TokenBatch, layout: ParallelLayout) -> list[TokenBatch]:
    """One share per global rank (index = rank): ``split_batch(batch, layout.dp)[dp_rank(rank)]``, the
    same object for every rank of one model-parallel group. Raises ``InvalidInput`` as ``split_batch``."""
    shares = split_batch(batch, layout.dp)
    return [shares[dp_coordinates(r, layout)[0]] for r in range(layout.world_size)]


def _first_rank_of_each_share(layout: ParallelLayout) -> list[int]:
    first: dict[int, int] = {}
    for r in range(layout.world_size):
        first.setdefault(dp_coordinates(r, layout)[0], r)
    return [first[d] for d in range(layout.dp)]


def gather_outputs(per_rank: Sequence[TokenOutputs], layout: ParallelLayout) -> TokenOutputs:
    """Per-token outputs of every rank (index = rank, each ``[b_r, S]`` for its share) back into one
    ``[B, S]`` result in the order of the batch ``dispatch_batch`` split: the outputs of the first rank
    of each data-parallel share, concatenated by share. (Every rank of a model-parallel group returns
    its share's outputs, per the engine contract, so one per share suffices.) Raises ``InvalidInput``
    when the number of outputs is not the world size or the shares disagree on which fields are set."""
    if len(per_rank) != layout.world_size:
        raise InvalidInput(f"gather_outputs: {len(per_rank)} outputs for a world of {layout.world_size}")
    picked = [per_rank[r] for r in _first_rank_of_each_share(layout)]

    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(o, name) for o in picked]
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise InvalidInput(f"gather_outputs: some shares have {name} and some do not")
        return torch.cat(parts, dim=0)

    return TokenOutputs(log_probs=cat("log_probs"), entropy=cat("entropy"), values=cat("values"))


# ----------------------------------------------------------------------------- tensor transport

# dtypes numpy has no type for travel as a same-width integer view and are viewed back on arrival
_NP_VIEW = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


@dataclass(frozen=True)
class _Wire:
    """A cpu tensor as a numpy array (read zero-copy from Ray's shared memory) and its torch dtype."""

    array: np.ndarray[Any, Any]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> _Wire:
        t = t.detach().to("cpu").contiguous()
        view = _NP_VIEW.get(t.dtype)
        return cls((t.view(view) if view is not None else t).numpy(), t.dtype)

    def tensor(self, device: torch.device | None = None) -> torch.Tensor:
        """A private, writable copy on ``device`` (cpu when ``None``): an array read from Ray's object
        store is a read-only view of shared memory, so exactly one copy is made here."""
        with warnings.catch_warnings():  # torch warns that the array is read-only; it is only read
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(self.array)
        if self.dtype in _NP_VIEW:
            src = src.view(self.dtype)
        target = device or torch.device("cpu")
        return src.clone() if target.type == "cpu" else src.to(target)


@dataclass(frozen=True)
class _WireVision:
    """``VisionInputs`` on the wire (images or videos of a batch)."""

    pixel_values: _Wire
    grid_thw: _Wire
    rows: _Wire
    second_per_grid: _Wire | None

    @classmethod
    def of(cls, m: VisionInputs | None) -> _WireVision | None:
        if m is None:
            return None
        sec = None if m.second_per_grid is None else _Wire.of(m.second_per_grid)
        return cls(_Wire.of(m.pixel_values), _Wire.of(m.grid_thw), _Wire.of(m.rows), sec)

    def inputs(self, device: torch.device | None) -> VisionInputs:
        sec = None if self.second_per_grid is None else self.second_per_grid.tensor(device)
        return VisionInputs(
            self.pixel_values.tensor(device), self.grid_thw.tensor(device), self.rows.tensor(device), sec
        )


@dataclass(frozen=True)
class _WireBatch:
    input_ids: _Wire
    attention_mask: _Wire
    loss_mask: _Wire
    extras: tuple[tuple[str, _Wire], ...]
    images: _WireVision | None = None
    videos: _WireVision | None = None

    @classmethod
    def of(cls, b: TokenBatch) -> _WireBatch:
        return cls(
            _Wire.of(b.input_ids),
            _Wire.of(b.attention_mask),
            _Wire.of(b.loss_mask),
            tuple((k, _Wire.of(v)) for k, v in b.extras.items()),
            _WireVision.of(b.images),
            _WireVision.of(b.videos),
        )

    def batch(self, device: torch.device | None = None) -> TokenBatch:
        return TokenBatch(
            self.input_ids.tensor(device),
            self.attention_mask.tensor(device),
            self.loss_mask.tensor(device),
            {k: v.tensor(device) for k, v in self.extras},
            None if self.images is None else self.images.inputs(device),
            None if self.videos is None else self.videos.inputs(device),
        )


@dataclass(frozen=True)
class _WireOutputs:
    log_probs: _Wire | None
    entropy: _Wire | None
    values: _Wire | None

    @classmethod
    def of(cls, o: TokenOutputs) -> _WireOutputs:
        def w(t: torch.Tensor | None) -> _Wire | None:
            return None if t is None else _Wire.of(t)

        return cls(w(o.log_probs), w(o.entropy), w(o.values))

    def outputs(self) -> TokenOutputs:
        def t(w: _Wire | None) -> torch.Tensor | None:
            return None if w is None else w.tensor()

        return TokenOutputs(t(self.log_probs), t(self.entropy), t(self.values))


# --------------------------------------------------------------------------------- the rank actor


def _layout_sizes(layout: ParallelLayout) -> dict[str, Any]:
    return {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout) if f.name != "groups"}


class _RankWorker:
    """One rank (a Ray actor). Holds the engines of every role placed on it and a log of which roles
    were resident on the device when each engine call ran (for tests and debugging)."""

    def __init__(self) -> None:
        self.engines: dict[str, ParallelEngine] = {}
        self.resident: dict[str, bool] = {}
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []
        self.device: Device | None = None
        self.failed_at: float | None = None
        self.meta: dict[str, Any] = {}

    @contextmanager
    def _recording(self) -> Iterator[None]:
        # wall-clock time of the first raise, so the controller can tell the rank that failed first from
        # the ranks whose collectives broke because of it
        try:
            yield
        except BaseException:
            if self.failed_at is None:
                self.failed_at = time.time()
            raise

    def first_failure_time(self) -> float | None:
        return self.failed_at

    def describe(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        ids = ctx.get_accelerator_ids()
        return {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "accelerator_ids": {k: [str(i) for i in v] for k, v in ids.items()},
        }

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def setup(self, env: dict[str, str], device_name: str | None, timeout_s: float, threads: int) -> None:
        os.environ.update(env)
        torch.set_num_threads(threads)
        from underlay.parallel.distributed import init_distributed
        from underlay.registry import get_device

        with self._recording():
            self.device = get_device(device_name)
            init_distributed(self.device, timeout_s=timeout_s)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self._recording():
            return fn(*_resolve(args), **kwargs)

    def build_engine(self, role: str, config: EngineConfig, engine_name: str | None) -> dict[str, Any]:
        from underlay.registry import get_engine

        if role in self.engines:
            raise InvalidInput(f"role {role!r} already has an engine on this rank")
        with self._recording():
            engine = get_engine(config, engine_name)
        self.engines[role] = engine
        self.resident[role] = True
        return _layout_sizes(engine.layout)

    def engine_call(self, role: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self._recording():
            return self._engine_call(role, method, args, kwargs)

    def _engine_call(self, role: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        engine = self.engines.get(role)
        if engine is None:
            raise InvalidInput(f"no engine for role {role!r} on this rank; built: {sorted(self.engines)}")
        resident = tuple(sorted(r for r, on in self.resident.items() if on))
        self.calls.append((role, method, resident))
        if method in ("offload", "onload"):
            getattr(engine, method)(*args, **kwargs)
            self.resident[role] = method == "onload"
            return None
        device = engine.device.torch_device()
        args = tuple(a.batch(device) if isinstance(a, _WireBatch) else a for a in _resolve(args))
        result = getattr(engine, method)(*args, **kwargs)
        # per-token outputs go back as numpy arrays (zero-copy through the object store)
        return _WireOutputs.of(result) if isinstance(result, TokenOutputs) else result

    def call_log(self) -> list[tuple[str, str, tuple[str, ...]]]:
        return list(self.calls)

    def set_meta(self, meta: dict[str, Any]) -> None:
        self.meta = dict(meta)

    def get_meta(self) -> dict[str, Any]:
        return {**self.meta, "resident": dict(self.resident)}

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.engines.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


def _resolve(args: tuple[Any, ...]) -> tuple[Any, ...]:
    # object refs nested one level inside a list/tuple argument are not resolved by Ray; resolve them
    return tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)


_REMOTE: dict[str, Any] = {}


def _remote_worker() -> Any:
    if "worker" not in _REMOTE:
        _REMOTE["worker"] = ray.remote(max_restarts=0, max_task_retries=0)(_RankWorker)
    return _REMOTE["worker"]


# ----------------------------------------------------------------------------------- the group


def _check_parallel(parallel: ParallelConfig, world_size: int, what: str) -> ParallelLayout:
    # pass every ParallelConfig size that ParallelLayout.infer takes, by name, so that new or renamed
    # dimensions are checked without this code naming them
    accepted = set(inspect.signature(ParallelLayout.infer).parameters) - {"cls", "world_size"}
    sizes = {f.name: getattr(parallel, f.name) for f in dataclasses.fields(parallel) if f.name in accepted}
    try:
        return ParallelLayout.infer(world_size, **sizes)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from exc


# ----------------------------------------------------------------------------------- pools


@dataclass(frozen=True)
class PoolSlice:
    """Bundles ``[start, stop)`` of a ``ResourcePool``: where a ``WorkerGroup`` places its ranks."""

    pool: ResourcePool
    start: int
    stop: int

    @property
    def size(self) -> int:
        """Number of bundles."""
        return self.stop - self.start


class ResourcePool:
    """``size`` bundles of ``resources`` (one rank's worth each) in ONE placement group, which several
    ``WorkerGroup``s use: split into disjoint ranges (``split``, ``slice``) or shared, each group
    holding a ``share`` of every bundle of its range (``WorkerGroup(..., pool=..., share=0.5)``).

    ``resources`` default: ``RankResources.from_device`` of ``device``. ``strategy`` is Ray's placement
    strategy (``PACK``, ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``). Raises ``InvalidInput`` for
    ``size < 1`` or an unknown strategy, ``ConfigError`` when the cluster has too few resources, and
    ``PlacementTimeout`` when they stay taken for ``ready_timeout_s``, all before the pool exists.
    Groups placed on a pool are shut down with it (``shutdown``).
    """

    STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

    def __init__(
        self,
        size: int,
        *,
        resources: RankResources | None = None,
        device: str | None = None,
        name: str = "underlay-pool",
        strategy: str = "PACK",
        ready_timeout_s: float = 180.0,
    ) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidInput(f"ResourcePool: size={size!r} must be an int >= 1")
        if strategy not in self.STRATEGIES:
            raise InvalidInput(f"ResourcePool: strategy={strategy!r}; use one of {self.STRATEGIES}")
        if resources is None:
            from underlay.registry import get_device

            resources = RankResources.from_device(get_device(device))
        ensure_ray()
        self.size, self.resources, self.name = size, resources, name
        _check_cluster(resources, size, f"ResourcePool {name!r}")
        self._used = [0.0] * size  # share of each bundle held by live groups
        self._groups: list[tuple[WorkerGroup, range, float]] = []
        self.pg = placement_group([resources.bundle()] * size, strategy=strategy, name=f"{name}-pg")
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout_s)
        except GetTimeoutError as exc:
            with suppress(RayError):
                remove_placement_group(self.pg)
            raise PlacementTimeout(
                f"ResourcePool {name!r}: {size} bundles of {resources.bundle()} could not be reserved within "
                f"{ready_timeout_s:g} s (available now: {_available()}); shut other groups down or wait longer"
            ) from exc

    @property
    def whole(self) -> PoolSlice:
        """Every bundle."""
        return PoolSlice(self, 0, self.size)

    def slice(self, start: int, stop: int) -> PoolSlice:
        """Bundles ``[start, stop)``; ``InvalidInput`` unless ``0 <= start < stop <= size``."""
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= self.size):
            raise InvalidInput(
                f"ResourcePool {self.name!r}: slice({start!r}, {stop!r}) outside [0, {self.size})"
            )
        return PoolSlice(self, start, stop)

    def split(self, sizes: Sequence[int]) -> list[PoolSlice]:
        """Consecutive disjoint slices of the given sizes, from bundle 0; ``InvalidInput`` when a size is
        below 1 or they add up to more than the pool."""
        if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes) or sum(sizes) > self.size:
            raise InvalidInput(
                f"ResourcePool {self.name!r}: split({list(sizes)!r}) needs sizes >= 1 adding up to at most {self.size}"
            )
        out, start = [], 0
        for n in sizes:
            out.append(PoolSlice(self, start, start + n))
            start += n
        return out

    def shares_used(self) -> list[float]:
        """The share of each bundle held by the live groups on it."""
        return list(self._used)

    def _reserve(self, group: WorkerGroup, bundles: range, share: float) -> None:
        if self.pg is None:
            raise InvalidInput(f"ResourcePool {self.name!r} is shut down; make a new one")
        over = [b for b in bundles if self._used[b] + share > 1.0 + 1e-9]
        if over:
            raise ConfigError(
                f"WorkerGroup {group.name!r}: share {share:g} of bundles {list(bundles)} of pool {self.name!r} "
                f"does not fit: bundle {over[0]} has {1.0 - self._used[over[0]]:g} left; lower the share or "
                "use another range"
            )
        for b in bundles:
            self._used[b] += share
        self._groups.append((group, bundles, share))

    def _release(self, group: WorkerGroup) -> None:
        for g, bundles, share in list(self._groups):
            if g is group:
                for b in bundles:
                    self._used[b] = max(0.0, self._used[b] - share)
                self._groups.remove((g, bundles, share))

    @contextmanager
    def colocated(self, engine: EngineGroup, *, timeout_s: float | None = None) -> Iterator[EngineGroup]:
        """Give the devices of ``engine``'s bundles to it: offload every other role resident on any of
        those bundles (in this or another group of the pool), onload ``engine``'s role if it is off,
        and yield it. Roles stay where they are afterwards (a second turn of the same role is free)."""
        mine = next((set(b) for g, b, _ in self._groups if g is engine.group), None)
        if mine is None:
            raise InvalidInput(f"role {engine.role!r} is not on pool {self.name!r}")
        for group, bundles, _ in list(self._groups):
            if not mine & set(bundles):
                continue
            for role in sorted(group._layouts):
                if (group is not engine.group or role != engine.role) and group._resident.get(role, False):
                    group.engine(role).offload(timeout_s=timeout_s)
        if not engine.group._resident.get(engine.role, False):
            engine.onload(timeout_s=timeout_s)
        yield engine

    def shutdown(self) -> None:
        """Shut down every group on the pool, then remove its placement group. Idempotent."""
        for group, _, _ in list(self._groups):
            group.shutdown()
        self._groups.clear()
        if self.pg is not None:
            with suppress(RayError):
                remove_placement_group(self.pg)
            self.pg = None

    def __enter__(self) -> ResourcePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _check_cluster(res: RankResources, count: int, what: str) -> None:
    total: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    need = {k: v * count for k, v in res.bundle().items()}
    if res.accelerator is not None and res.accelerator not in total:
        known = sorted(k for k in total if not k.startswith("node:") and k not in ("memory",))
        raise ConfigError(
            f"{what}: the Ray cluster has no resource {res.accelerator!r} (it has {known}); "
            "start Ray with it (ray start --resources / ray.init(resources=...)) or choose another device"
        )
    short = {k: (v, total.get(k, 0.0)) for k, v in need.items() if total.get(k, 0.0) < v}
    if short:
        text = ", ".join(f"{k}: needs {n:g}, cluster has {h:g}" for k, (n, h) in short.items())
        raise ConfigError(
            f"{what}: {count} ranks need more than the cluster has ({text}); use fewer "
            "ranks, fewer cpus_per_rank, or a larger cluster"
        )


def _actor_name(group: str, rank: int) -> str:
    return f"{group}/rank{rank}"


def detached_groups() -> list[str]:
    """Names of the detached worker groups alive in the cluster (``WorkerGroup(..., detached=True)``)."""
    ensure_ray()
    names = ray.util.list_named_actors(all_namespaces=True)
    found = {
        n["name"].rsplit("/", 1)[0]
        for n in names
        if n.get("namespace") == NAMESPACE and n["name"].endswith("/rank0")
    }
    return sorted(found)


def remove_detached(name: str) -> None:
    """Kill the ranks of detached group ``name`` and remove its placement group; ``InvalidInput`` when
    no such group is alive."""
    WorkerGroup.attach(name).shutdown()


def _host_load() -> str:
    """`` (this host: load average L over N CPUs)`` for a timeout's message: a rank that answers late
    on an overloaded host is starved, not stuck. Empty where the platform has no load average."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    return f" (this host: load average {load:.1f} over {os.cpu_count() or 1} CPUs)"


# Ray's variable for the niceness of a worker process (read by the worker when it starts)
_RAY_NICENESS = "RAY_worker_niceness"


class WorkerGroup:
    """``world_size`` ranks as Ray actors with an initialised default process group.

    ``device``: the underlay device name the ranks use (``"cpu"``, ``"cuda"``, ``"npu"``; ``None``: what
    ``UNDERLAY_DEVICE``/auto selects on each rank). ``resources``: what a rank reserves; default
    ``RankResources.from_device`` of ``device`` as the driver resolves it (give it explicitly when the
    driver has no accelerator, e.g. a CPU-only head node). ``engines``: role -> ``EngineConfig`` built on
    every rank after the group starts (``engine_name`` selects the engine backend, default
    ``UNDERLAY_ENGINE``). ``env``: extra environment variables of every rank, set when its process
    starts. Ranks run at niceness 0, not Ray's 15 for its workers (``env={"RAY_worker_niceness": "15"}``
    keeps Ray's). ``ready_timeout_s`` bounds waiting for the placement group and for the ranks to start;
    ``collective_timeout_s`` is the process group's timeout. ``failure_grace_s``: after a rank raises,
    how long the controller waits for the other ranks before naming the one that failed first.

    ``pool``: place the ranks on bundles of a ``ResourcePool`` (a ``PoolSlice``, or the pool: its first
    ``world_size`` bundles) instead of a placement group of the group's own; ``share`` (0 < share <= 1)
    is the fraction of each of those bundles the group's ranks reserve, so that groups whose shares add
    up to at most 1 live on the same devices. ``detached=True`` makes the ranks named actors (namespace
    :data:`NAMESPACE`, names ``<name>/rank<r>``) that outlive this driver, in a detached placement group;
    ``WorkerGroup.attach(name)`` reaches them from another driver; only ``shutdown`` (or
    ``remove_detached``) ends them.

    Raises, before any actor starts: ``InvalidInput`` for ``world_size < 1``; ``ConfigError`` when an
    engine's parallel sizes do not divide ``world_size``, when the cluster has no resource of that name,
    or fewer of it (or of CPUs) than the group needs; ``PlacementTimeout`` when the cluster has them
    but they stay taken for ``ready_timeout_s``. ``RankFailure`` when a rank fails while starting.
    """

    def __init__(
        self,
        world_size: int,
        *,
        device: str | None = None,
        resources: RankResources | None = None,
        engines: Mapping[str, EngineConfig] | None = None,
        engine_name: str | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "underlay",
        ready_timeout_s: float = 180.0,
        collective_timeout_s: float = 1800.0,
        failure_grace_s: float = 5.0,
        pool: ResourcePool | PoolSlice | None = None,
        share: float = 1.0,
        detached: bool = False,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise InvalidInput(f"WorkerGroup: world_size={world_size!r} must be an int >= 1")
        for role, cfg in (engines or {}).items():
            _check_parallel(cfg.parallel, world_size, f"WorkerGroup engine {role!r}")
        if not (isinstance(share, (int, float)) and 0.0 < share <= 1.0):
            raise InvalidInput(f"WorkerGroup: share={share!r} must be in (0, 1]")
        if share != 1.0 and pool is None:
            raise ConfigError(
                f"WorkerGroup: share={share!r} without a pool; a share divides the bundles of a ResourcePool "
                "between groups: pass pool="
            )
        slice_ = pool.whole if isinstance(pool, ResourcePool) else pool
        if slice_ is not None:
            if detached:
                raise ConfigError(
                    "WorkerGroup: detached=True with a pool; a detached group owns its placement group "
                    "(it must outlive this driver, the pool does not)"
                )
            if world_size > slice_.size:
                raise ConfigError(
                    f"WorkerGroup: world_size={world_size} > the {slice_.size} bundles of pool "
                    f"{slice_.pool.name!r} [{slice_.start}, {slice_.stop})"
                )
            if resources is not None and resources != slice_.pool.resources:
                raise ConfigError(
                    f"WorkerGroup: resources={resources} differ from pool {slice_.pool.name!r}'s "
                    f"{slice_.pool.resources}; leave resources unset with a pool"
                )
            resources = slice_.pool.resources
        if resources is None:
            from underlay.registry import get_device

            resources = RankResources.from_device(get_device(device))
        ensure_ray()
        self.world_size, self.name, self.resources = world_size, name, resources
        self.failure_grace_s = failure_grace_s
        self.share, self.detached = float(share), detached
        self._slice = slice_
        self._device_name = device
        self._engine_name = engine_name
        self._actors: list[Any] = []
        self._pg: Any = None
        self._infos: list[RankInfo] = []
        self._layouts: dict[str, ParallelLayout] = {}
        self._resident: dict[str, bool] = {}  # role -> on the device (not offloaded), as the ranks report
        if detached and name in detached_groups():
            raise ConfigError(
                f"WorkerGroup: a detached group named {name!r} is alive; attach to it "
                "(WorkerGroup.attach) or remove it (remove_detached) first"
            )
        if slice_ is None:
            self._check_capacity()
        else:
            slice_.pool._reserve(self, range(slice_.start, slice_.start + world_size), self.share)
        try:
            self._start(dict(env or {}), ready_timeout_s, collective_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        for role, cfg in (engines or {}).items():
            self.build_engine(role, cfg)

    # ------------------------------------------------------------------------------- start-up

    def _check_capacity(self) -> None:
        _check_cluster(self.resources, self.world_size, "WorkerGroup")

    def _start(self, env: dict[str, str], ready_timeout_s: float, collective_timeout_s: float) -> None:
        res = self.resources
        if self._slice is not None:
            pg, first = self._slice.pool.pg, self._slice.start
        else:
            first = 0
            pg = self._pg = placement_group(
                [res.bundle()] * self.world_size,
                strategy="PACK",
                name=f"{self.name}-pg",
                lifetime="detached" if self.detached else None,
            )
            try:
                ray.get(pg.ready(), timeout=ready_timeout_s)
            except GetTimeoutError as exc:
                raise PlacementTimeout(
                    f"WorkerGroup: {self.world_size} bundles of {res.bundle()} could not be reserved within "
                    f"{ready_timeout_s:g} s (available now: {_available()}); other groups hold "
                    "them: shut those down or raise ready_timeout_s"
                ) from exc
        node_of_bundle = placement_group_table(pg)["bundles_to_node_id"]
        own = range(first, first + self.world_size)
        nodes: list[str] = []
        for b in own:
            if node_of_bundle[b] not in nodes:
                nodes.append(node_of_bundle[b])
        bundles = sorted(own, key=lambda b: (nodes.index(node_of_bundle[b]), b))
        remote = _remote_worker()
        # Ray starts its worker processes at niceness 15, below every ordinary process of the host: a
        # rank is the training process itself, and at 15 any busy neighbour (a data loader, another job)
        # takes its CPU at a ratio of about 30 to 1 (Linux's weights for nice 0 and 15), starving its
        # kernel launches and collectives. The variable is read when the worker process starts.
        runtime_env = {"env_vars": {_RAY_NICENESS: "0", **env}}
        for rank, b in enumerate(bundles):
            opts = res.actor_options(self.share)
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=b, placement_group_capture_child_tasks=True
            )
            opts["runtime_env"] = runtime_env
            if self.detached:
                opts.update(name=_actor_name(self.name, rank), namespace=NAMESPACE, lifetime="detached")
            self._actors.append(remote.options(**opts).remote())
        # provisional infos so that a failure while describing already names the rank
        self._infos = [
            RankInfo(r, self.world_size, -1, "?", "?", "?", -1, b, (), None) for r, b in enumerate(bundles)
        ]
        desc = self._wait([a.describe.remote() for a in self._actors], "start-up", ready_timeout_s)
        infos: list[RankInfo] = []
        local_seen: dict[str, int] = {}
        ids_by_node: dict[str, list[str]] = {}
        for d in desc:
            ids = d["accelerator_ids"].get(res.accelerator, []) if res.accelerator else []
            ids_by_node.setdefault(d["node_id"], []).extend(ids)
        for rank, (d, b) in enumerate(zip(desc, bundles)):
            node = d["node_id"]
            ids = tuple(d["accelerator_ids"].get(res.accelerator, [])) if res.accelerator else ()
            node_ids = sorted(set(ids_by_node[node]), key=_id_key)
            if ids and res.visible_devices_env:
                # every rank sees all of its node's devices of this group (peer access, IPC between
                # ranks); LOCAL_RANK indexes its own device among them
                local, visible = node_ids.index(ids[0]), ",".join(node_ids)
            else:
                local, visible = local_seen.get(node, 0), None
            local_seen[node] = local_seen.get(node, 0) + 1
            infos.append(
                RankInfo(
                    rank,
                    self.world_size,
                    local,
                    node,
                    d["node_ip"],
                    d["hostname"],
                    int(d["pid"]),
                    b,
                    ids,
                    visible,
                )
            )
        self._infos = infos
        port = self._wait([self._actors[0].free_port.remote()], "start-up", ready_timeout_s, ranks=[0])[0]
        master = infos[0].node_ip
        setups = []
        for info, actor in zip(infos, self._actors):
            rank_env = {
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                "RANK": str(info.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(info.local_rank),
                "LOCAL_WORLD_SIZE": str(sum(1 for i in infos if i.node_id == info.node_id)),
            }
            if info.visible_devices is not None and res.visible_devices_env:
                rank_env[res.visible_devices_env] = info.visible_devices
            setups.append(
                actor.setup.remote(
                    rank_env, self._device_name, collective_timeout_s, res.threads_at(self.share)
                )
            )
        self._wait(setups, "init_distributed", ready_timeout_s)
        self._publish()

    def _publish(self) -> None:
        """Record on rank 0 what ``attach`` needs to rebuild this handle (detached groups only)."""
        if not self.detached or not self._actors:
            return
        meta = {
            "world_size": self.world_size,
            "resources": dataclasses.asdict(self.resources),
            "share": self.share,
            "infos": [dataclasses.asdict(i) for i in self._infos],
            "layouts": {r: _layout_sizes(lay) for r, lay in self._layouts.items()},
            "device_name": self._device_name,
            "engine_name": self._engine_name,
            "failure_grace_s": self.failure_grace_s,
        }
        self._wait([self._actors[0].set_meta.remote(meta)], "publishing the group", ranks=[0])

    @classmethod
    def attach(cls, name: str, *, timeout_s: float = 60.0) -> WorkerGroup:
        """The handle of the detached group ``name`` started by any driver of this cluster: its ranks,
        roles and which roles are on the device, as the ranks know them. Shutting the handle down ends
        the group. ``InvalidInput`` when no detached group of that name is alive."""
        ensure_ray()
        try:
            rank0 = ray.get_actor(_actor_name(name, 0), namespace=NAMESPACE)
        except ValueError as exc:
            raise InvalidInput(
                f"no detached worker group {name!r} is alive (alive: {detached_groups()})"
            ) from exc
        meta: dict[str, Any] = dict(ray.get(rank0.get_meta.remote(), timeout=timeout_s))
        if not meta.get("world_size"):
            raise InvalidInput(f"detached worker group {name!r} has not finished starting; try again")
        self = cls.__new__(cls)
        self.world_size, self.name = int(meta["world_size"]), name
        self.resources = RankResources(**meta["resources"])
        self.failure_grace_s = float(meta["failure_grace_s"])
        self.share, self.detached, self._slice = float(meta["share"]), True, None
        self._device_name, self._engine_name = meta["device_name"], meta["engine_name"]
        self._actors = [rank0] + [
            ray.get_actor(_actor_name(name, r), namespace=NAMESPACE) for r in range(1, self.world_size)
        ]
        self._pg = None
        with suppress(Exception):
            from ray.util import get_placement_group

            self._pg = get_placement_group(f"{name}-pg")
        self._infos = [
            RankInfo(**{**i, "accelerator_ids": tuple(i["accelerator_ids"])}) for i in meta["infos"]
        ]
        self._layouts = {r: ParallelLayout(**sizes) for r, sizes in meta["layouts"].items()}
        self._resident = {r: bool(on) for r, on in meta["resident"].items()}
        return self

    # -------------------------------------------------------------------------------- waiting

    def _wait(
        self,
        refs: Sequence[Any],
        what: str,
        timeout_s: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        """Values of ``refs`` (one per rank in ``ranks``, default every rank in order).

        A failure shuts the group down and raises ``RankFailure`` naming the rank that failed first:
        a process death is reported at once (it is the cause: the others' collectives break because of
        it); an exception waits up to ``failure_grace_s`` for the other ranks to finish, fail or die, and
        then a death, else the exception raised earliest, is named (the others are listed as
        consequences). ``timeout_s`` passing with some ranks still pending is a failure of the lowest
        pending rank."""
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        rank_of = {ref: r for ref, r in zip(refs, ranks)}
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failures: dict[int, RayError] = {}
        grace_end: float | None = None
        while pending:
            limits = [t for t in (deadline, grace_end) if t is not None]
            left = max(0.0, min(limits) - time.monotonic()) if limits else None
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in ready:
                try:
                    ray.get(ref)
                except RayError as exc:
                    failures[rank_of[ref]] = exc
            if any(isinstance(e, RayActorError) for e in failures.values()):
                break
            if failures and grace_end is None:
                grace_end = time.monotonic() + self.failure_grace_s
            if not ready:
                if failures:  # the grace period is over
                    break
                r = min(rank_of[p] for p in pending)
                self._fail(r, what, f"no answer within {timeout_s:g} s{_host_load()}", "timeout", {})
        if failures:
            rank = self._root_cause(failures)
            others = {r: _cause(e) for r, e in failures.items() if r != rank}
            self._fail(rank, what, _cause(failures[rank]), str(failures[rank]), others)
        return list(ray.get(list(refs)))

    def _root_cause(self, failures: Mapping[int, RayError]) -> int:
        deaths = sorted(r for r, e in failures.items() if isinstance(e, RayActorError))
        if deaths:
            return deaths[0]
        times: dict[int, float] = {}
        for r in failures:
            try:
                t = ray.get(self._actors[r].first_failure_time.remote(), timeout=5.0)
            except RayError:
                continue
            if t is not None:
                times[r] = float(t)
        return min(failures, key=lambda r: (times.get(r, float("inf")), r))

    def _fail(self, rank: int, what: str, cause: str, detail: str, others: Mapping[int, str]) -> None:
        info = self._infos[rank] if rank < len(self._infos) else None
        host = "unknown host"
        if info is not None and info.node_ip != "?":
            host = f"{info.node_ip} ({info.hostname}, pid {info.pid})"
        # no graceful step: the other ranks may be blocked in a collective with the failed one, and an
        # actor runs one call at a time, so a shutdown call would only queue behind the blocked one
        self.shutdown(graceful_timeout_s=0)
        if others:
            cause += "; then " + "; ".join(f"rank {r}: {c}" for r, c in sorted(others.items()))
        raise RankFailure(rank, self.world_size, host, what, cause, detail)

    # ------------------------------------------------------------------------------- calling

    @property
    def ranks(self) -> list[RankInfo]:
        """Where each rank runs, in rank order."""
        return list(self._infos)

    @property
    def alive(self) -> bool:
        """Whether the group is started and not shut down."""
        return bool(self._actors)

    def _require_alive(self) -> None:
        if not self._actors:
            raise InvalidInput(f"WorkerGroup {self.name!r} is shut down; start a new one")

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every rank (collectively, so ``fn`` may use collectives);
        returns one ``ObjectRef`` per rank, in rank order. ``fn`` and the arguments must pickle
        (``fn`` defined at module level of an importable module); ``ObjectRef`` arguments, top level or
        one level inside ``args``, arrive as their values. Wait with ``get``."""
        return self.submit_per_rank(fn, [args] * self.world_size, **kwargs)

    def submit_per_rank(
        self, fn: Callable[..., Any], rank_args: Sequence[tuple[Any, ...]], **kwargs: Any
    ) -> list[Any]:
        """Like ``submit`` with rank ``r`` calling ``fn(*rank_args[r], **kwargs)``. Raises
        ``InvalidInput`` unless there is one argument tuple per rank."""
        self._require_alive()
        if len(rank_args) != self.world_size:
            raise InvalidInput(
                f"submit_per_rank: {len(rank_args)} argument tuples for {self.world_size} ranks"
            )
        return [a.run.remote(fn, tuple(args), kwargs) for a, args in zip(self._actors, rank_args)]

    def get(self, refs: Sequence[Any], *, timeout_s: float | None = None, what: str = "a call") -> list[Any]:
        """The values of one ref per rank (as ``submit`` returns), waiting for all of them; raises
        ``RankFailure`` (after shutting the group down) at the first rank that failed, or when
        ``timeout_s`` passes first."""
        return self._wait(refs, what, timeout_s)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """``get(submit(fn, *args, **kwargs))``: the per-rank results as a list in rank order."""
        return self.get(
            self.submit(fn, *args, **kwargs), timeout_s=timeout_s, what=getattr(fn, "__name__", "a call")
        )

    # ------------------------------------------------------------------------------- engines

    def build_engine(self, role: str, config: EngineConfig, *, timeout_s: float | None = None) -> EngineGroup:
        """Build ``underlay.get_engine(config)`` on every rank under the name ``role`` (collective; the
        same config a torchrun script would pass). Several roles may live on one group (colocated); use
        ``colocated`` to take turns on the device. Raises ``ConfigError`` (before any rank is touched)
        when the parallel sizes do not divide the world size, ``InvalidInput`` when ``role`` exists."""
        self._require_alive()
        _check_parallel(config.parallel, self.world_size, f"engine {role!r}")
        if role in self._layouts:
            raise InvalidInput(f"WorkerGroup {self.name!r} already has role {role!r}; pick another name")
        refs = [a.build_engine.remote(role, config, self._engine_name) for a in self._actors]
        sizes = self._wait(refs, f"building engine {role!r}", timeout_s)
        self._layouts[role] = ParallelLayout(**sizes[0])
        self._resident[role] = True
        self._publish()
        return EngineGroup(self, role)

    def engine(self, role: str) -> EngineGroup:
        """The handle of a built role. Raises ``InvalidInput`` for an unknown role."""
        if role not in self._layouts:
            raise InvalidInput(
                f"WorkerGroup {self.name!r} has no role {role!r}; built: {sorted(self._layouts)}"
            )
        return EngineGroup(self, role)

    def layout(self, role: str) -> ParallelLayout:
        """The sizes of the role's engine (process groups are not carried to the controller)."""
        self.engine(role)
        return self._layouts[role]

    def submit_engine(
        self,
        role: str,
        method: str,
        rank_args: Sequence[tuple[Any, ...]] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Start ``engine.<method>(*rank_args[r], **kwargs)`` of ``role`` on every rank (same empty args
        when ``rank_args`` is ``None``); one ref per rank."""
        self.engine(role)
        self._require_alive()
        args = rank_args if rank_args is not None else [()] * self.world_size
        if len(args) != self.world_size:
            raise InvalidInput(f"submit_engine: {len(args)} argument tuples for {self.world_size} ranks")
        return [a.engine_call.remote(role, method, tuple(x), kwargs) for a, x in zip(self._actors, args)]

    @contextmanager
    def colocated(self, role: str, *, timeout_s: float | None = None) -> Iterator[EngineGroup]:
        """Give the device to ``role``: offload every other role of this group that is on the device,
        onload ``role`` if it is off, yield its handle. Roles stay where they are after the block, so consecutive turns of
        one role cost no transfer."""
        handle = self.engine(role)
        for other in sorted(self._layouts):
            if other != role and self._resident.get(other, False):
                handle.group.engine(other).offload(timeout_s=timeout_s)
        if not self._resident.get(role, False):
            handle.onload(timeout_s=timeout_s)
        yield handle

    def call_log(self, rank: int = 0) -> list[tuple[str, str, tuple[str, ...]]]:
        """Rank ``rank``'s engine calls so far: ``(role, method, roles resident when it ran)``."""
        self._require_alive()
        return list(self._wait([self._actors[rank].call_log.remote()], "call_log", ranks=[rank])[0])

    # ------------------------------------------------------------------------------- shutdown

    def shutdown(self, *, graceful_timeout_s: float = 10.0) -> None:
        """Destroy the ranks' process groups where they still answer (within ``graceful_timeout_s``), kill
        every actor and remove the placement group. Idempotent; never raises for dead actors."""
        actors, self._actors = self._actors, []
        if actors and graceful_timeout_s > 0:
            refs = [a.shutdown.remote() for a in actors]
            with suppress(RayError):
                ray.wait(refs, num_returns=len(refs), timeout=graceful_timeout_s)
        for a in actors:
            with suppress(RayError):
                ray.kill(a, no_restart=True)
        if self._pg is not None:
            with suppress(RayError):
                remove_placement_group(self._pg)
            self._pg = None
        if self._slice is not None:
            self._slice.pool._release(self)
        self._layouts.clear()
        self._resident.clear()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(graceful_timeout_s=0 if exc[0] is not None else 10.0)


def _available() -> dict[str, float]:
    free: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]
    return {k: v for k, v in free.items() if not k.startswith("node:")}


def _id_key(i: str) -> tuple[int, str]:
    return (int(i), i) if i.isdigit() else (1 << 30, i)


def _cause(exc: BaseException) -> str:
    """One line: the remote exception's type and message, or how the actor's process died."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return f"{type(cause).__name__}: {cause}".splitlines()[0]
        return f"{exc.function_name} raised: " + str(exc).strip().splitlines()[-1]
    if isinstance(exc, RayActorError):
        text = str(exc)
        for marker in ("killed", "SIGKILL", "node", "exited", "died"):
            for line in text.splitlines():
                if marker in line:
                    return "the actor process died: " + line.strip()
        return "the actor process died: " + text.strip().splitlines()[0]
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


# --------------------------------------------------------------------------------- engine handle


class EngineGroup:
    """A role's engine on every rank of a ``WorkerGroup``, called as one engine from the controller.

    Batches go in whole (``[B, S]``); each is split over the engine's data-parallel shares
    (``dispatch_batch``), each share ``ray.put`` once and passed by reference to the ranks that consume
    it. Per-token outputs come back gathered in the batch's order (``gather_outputs``). Every method is
    collective over the group and raises ``RankFailure`` as ``WorkerGroup.get`` does.
    """

    def __init__(self, group: WorkerGroup, role: str) -> None:
        self.group, self.role = group, role

    @property
    def layout(self) -> ParallelLayout:
        """The engine's sizes."""
        return self.group.layout(self.role)

    def _shares(self, batch: TokenBatch) -> list[tuple[Any, ...]]:
        layout = self.layout
        shares = split_batch(batch, layout.dp)
        refs = [ray.put(_WireBatch.of(s)) for s in shares]
        return [(refs[dp_coordinates(r, layout)[0]],) for r in range(layout.world_size)]

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """``engine.<method>(*args, **kwargs)`` on every rank; the per-rank results in rank order."""
        refs = self.group.submit_engine(self.role, method, [args] * self.group.world_size, **kwargs)
        out = self.group.get(refs, timeout_s=timeout_s, what=f"{self.role}.{method}")
        if method in ("offload", "onload"):
            self.group._resident[self.role] = method == "onload"
        return out

    def forward_backward(
        self, batch: TokenBatch, loss_fn: LossFn, *, timeout_s: float | None = None
    ) -> StepResult:
        """Accumulate gradients of ``batch`` (split over the data-parallel ranks); rank 0's
        ``StepResult`` (every rank reports the same metrics). ``loss_fn`` must pickle."""
        rank_args = [(s[0], loss_fn) for s in self._shares(batch)]
        refs = self.group.submit_engine(self.role, "forward_backward", rank_args)
        return self.group.get(refs, timeout_s=timeout_s, what=f"{self.role}.forward_backward")[0]  # type: ignore[no-any-return]

    def infer(self, batch: TokenBatch, *, timeout_s: float | None = None, **kwargs: Any) -> TokenOutputs:
        """Per-token outputs ``[B, S]`` (fp32, on the controller's cpu) in the order of ``batch``."""
        refs = self.group.submit_engine(self.role, "infer", self._shares(batch), **kwargs)
        wires = self.group.get(refs, timeout_s=timeout_s, what=f"{self.role}.infer")
        return gather_outputs([w.outputs() for w in wires], self.layout)

    def optimizer_step(self, *, timeout_s: float | None = None) -> OptimizerStepResult:
        """Step every rank's optimizer; rank 0's result (the global grad norm is the same everywhere)."""
        return self.call("optimizer_step", timeout_s=timeout_s)[0]  # type: ignore[no-any-return]

    def zero_grad(self) -> None:
        """Drop accumulated gradients on every rank."""
        self.call("zero_grad")

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule; the new learning rate."""
        return float(self.call("lr_scheduler_step")[0])

    def offload(self, *, timeout_s: float | None = None, **kwargs: bool) -> None:
        """``engine.offload(**kwargs)`` on every rank; the role counts as off the device afterwards."""
        self.call("offload", timeout_s=timeout_s, **kwargs)

    def onload(self, *, timeout_s: float | None = None, **kwargs: bool) -> None:
        """``engine.onload(**kwargs)`` on every rank; the role counts as on the device afterwards."""
        self.call("onload", timeout_s=timeout_s, **kwargs)

    def save_checkpoint(self, directory: str | Path) -> None:
        """``engine.save_checkpoint`` into ``directory`` (a path every rank can reach: shared storage on
        a multi-node cluster), which exists and is empty."""
        self.call("save_checkpoint", Path(directory))

    def load_checkpoint(self, directory: str | Path) -> None:
        """``engine.load_checkpoint`` from ``directory``."""
        self.call("load_checkpoint", Path(directory))
