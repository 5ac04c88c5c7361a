"""Parallel Hugging Face safetensors loading through the ``ParallelEngine`` protocol.

Every byte of the files is read once, by one rank, and reaches the other ranks through broadcasts:

1. **Headers** (``_gather_headers``): rank ``r`` validates the headers of every ``world``-th file
   (sorted by path) from ``r`` on; the entries are all-gathered and a bad file on any rank raises
   ``CheckpointError`` on every rank (``agree``) before any parameter changes.
2. **Plan** (``plan_load`` / ``schedule``): names, shapes and dtypes are checked against the weight
   map on every rank (the same result everywhere); the tensors to read, in file and offset order,
   are cut into ``world`` contiguous runs of about equal bytes (cuts fall between tensors), so each
   rank reads about ``1/world`` of the bytes, mostly whole files and sequentially. A single-file
   model is split the same way, by tensor (no rank 0 reading alone: one file is often the whole
   model). Each engine parameter is then assigned to the rank holding most of its bytes, and
   parameters are grouped into rounds: in each round every rank contributes its next parameters
   up to ``bucket_bytes / world`` bytes (at least one), so all ranks read in every round.
3. **Rounds** (``load_rounds``): a reader thread per rank reads its bytes of round ``k+2`` into
   one of three host buffers (plain ``read`` calls straight into the buffer, ``read_entries``) while
   the main thread broadcasts round ``k+1`` (each rank's buffer from that rank; gloo: host memory;
   nccl: the buffer goes to the device first; one rank on an accelerator: the buffer goes to the
   device in one copy) and, while those broadcasts are in flight, converts round ``k``: the HF
   tensors are views of the buffers, each parameter is built (``rule.from_hf``) and copied into the
   shards (``engine.copy_full_parameter``). Reading, the link and conversion thus overlap. One small
   all-reduce per round agrees that every rank's read succeeded, so a read failing after validation
   raises on every rank (the parameters of the earlier rounds are then already loaded).

Memory beyond the model, per rank: two rounds' buffers (each about ``bucket_bytes``, more when a
single parameter's tensors are larger), this rank's share of a third (about ``bucket_bytes / world``),
and one full parameter being converted.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from underlay.engines._buckets import check_byte_count
from underlay.interfaces import (
    CheckpointError,
    LoadReport,
    ParallelEngine,
    WeightMap,
    WeightRule,
)
from underlay.parallel.agree import agree, collective_device, describe
from underlay.parallel.rank import current_rank
from underlay.utils.safe_files import (
    SafetensorsEntry,
    merge_safetensors_headers,
    read_entries,
    read_safetensors_header,
    safetensors_files,
)

__all__ = [
    "DEFAULT_LOAD_BUCKET_BYTES",
    "LoadPlan",
    "Round",
    "gather_headers",
    "load_hf_files",
    "load_rounds",
    "plan_load",
    "schedule",
]

DEFAULT_LOAD_BUCKET_BYTES = 256 << 20
_ALIGN = 64  # tensors start at multiples of this in a round buffer (any dtype view is aligned)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return current_rank(), dist.get_world_size()
    return 0, 1


def gather_headers(path: Path) -> dict[str, SafetensorsEntry]:
    """Every tensor entry of the HF directory ``path``, each file's header validated by one rank (rank
    ``r`` takes every ``world``-th file from ``r`` on) and the entries all-gathered. Collective: a bad
    index or header on any rank raises ``CheckpointError`` on every rank, naming the failing rank,
    before anything is loaded."""
    rank, world = _world()
    error: CheckpointError | None = None
    mine: list[dict[str, SafetensorsEntry]] = []
    files: list[tuple[Path, frozenset[str] | None]] = []
    try:
        files = sorted(safetensors_files(path).items())
        mine = [read_safetensors_header(f, names) for f, names in files[rank::world]]
    except CheckpointError as exc:
        error = exc
    agree(error is None, str(error), what=f"load_hf({path})", error_type=CheckpointError, cause=error)
    if world == 1:
        return merge_safetensors_headers(path, mine)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    ordered: list[dict[str, SafetensorsEntry]] = [{} for _ in files]
    for r, part in enumerate(parts):
        for i, header in enumerate(part):
            ordered[r + i * world] = header
    return merge_safetensors_headers(path, ordered)


@dataclass(frozen=True)
class LoadPlan:
    """The validated outcome of ``plan_load``: ``where`` (every tensor of the files), ``source`` (HF name
    the model expects -> the name it is read under: itself, or a tied alias), ``missing`` (expected
    names the files lack) and ``unexpected`` (names in the files the model neither expects, ties nor
    ignores)."""

    where: Mapping[str, SafetensorsEntry]
    source: Mapping[str, str]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


def plan_load(wmap: WeightMap, where: Mapping[str, SafetensorsEntry], path: Path, strict: bool) -> LoadPlan:
    """Check the file entries ``where`` of ``path`` against ``wmap`` without changing any parameter.
    ``CheckpointError`` for a shape mismatch, int/bool data for a float parameter or, with ``strict``,
    required missing or unexpected names."""
    expected: dict[str, tuple[int, ...]] = {}
    for rule in wmap.rules:
        expected.update(rule.hf_shapes())
    aliases: dict[str, list[str]] = {}
    for alias, canonical in wmap.tied.items():
        aliases.setdefault(canonical, []).append(alias)
    source: dict[str, str] = {}
    for hf in expected:
        for candidate in (hf, *aliases.get(hf, ())):
            if candidate in where:
                source[hf] = candidate
                break
    missing = tuple(hf for hf in expected if hf not in source)
    required_missing = [hf for hf in missing if not (r := wmap.rule_for_hf(hf)) or not r.optional]
    unexpected = tuple(
        sorted(n for n in where if n not in expected and n not in wmap.tied and not wmap.is_ignored(n))
    )
    bad = [
        f"{hf}: file {where[src].shape} != model {expected[hf]}"
        for hf, src in source.items()
        if where[src].shape != expected[hf]
    ]
    bad += [
        f"{hf}: file dtype {where[src].dtype} for a floating-point parameter"
        for hf, src in source.items()
        if not where[src].dtype.is_floating_point
    ]
    if bad:
        raise CheckpointError(
            f"load_hf({path}): shape mismatch (or int/bool data for a float parameter) in {len(bad)} "
            f"tensors, e.g. {bad[:3]}; the weights belong to another model configuration"
        )
    if strict and (required_missing or unexpected):
        raise CheckpointError(
            f"load_hf({path}): missing {required_missing[:5]} ({len(required_missing)} in all), unexpected "
            f"{list(unexpected[:5])} ({len(unexpected)} in all); fix the model config or pass strict=False"
        )
    return LoadPlan(where, source, missing, unexpected)


@dataclass(frozen=True)
class Round:
    """One broadcast round: ``rules`` (in weight-map order) are complete after it; ``reads[r]`` are
    the ``(file name, entry, buffer offset)`` rank ``r`` reads into its buffer of ``sizes[r]`` bytes."""

    rules: tuple[WeightRule, ...]
    reads: tuple[tuple[tuple[str, SafetensorsEntry, int], ...], ...]
    sizes: tuple[int, ...]


def schedule(wmap: WeightMap, plan: LoadPlan, world: int, bucket_bytes: int) -> list[Round]:
    """The rounds that load every rule whose HF tensors are all present (see the module docstring).
    Deterministic: every rank computes the same rounds from the same plan."""
    rules = [r for r in wmap.rules if all(hf in plan.source for hf in r.hf_names)]
    names = sorted(
        {plan.source[hf] for r in rules for hf in r.hf_names},
        key=lambda n: (str(plan.where[n].file), plan.where[n].offset),
    )
    total = sum(plan.where[n].nbytes for n in names) or 1
    owner: dict[str, int] = {}
    done = 0
    for n in names:  # contiguous runs of ~total/world bytes, cut at the tensor whose middle crosses
        size = plan.where[n].nbytes
        owner[n] = min(world - 1, (2 * done + size) * world // (2 * total))
        done += size
    queues: list[list[tuple[int, WeightRule, int]]] = [[] for _ in range(world)]
    for i, rule in enumerate(rules):
        by_rank = [0] * world
        for hf in rule.hf_names:
            by_rank[owner[plan.source[hf]]] += plan.where[plan.source[hf]].nbytes
        lead = max(range(world), key=lambda r: (by_rank[r], -r))
        queues[lead].append((i, rule, sum(by_rank)))
    share = max(1, bucket_bytes // world)
    heads = [0] * world
    rounds: list[Round] = []
    while any(heads[r] < len(queues[r]) for r in range(world)):
        picked: list[tuple[int, WeightRule]] = []
        for r in range(world):
            taken = 0
            while heads[r] < len(queues[r]) and (taken == 0 or taken + queues[r][heads[r]][2] <= share):
                i, rule, size = queues[r][heads[r]]
                picked.append((i, rule))
                taken += size
                heads[r] += 1
        picked.sort(key=lambda p: p[0])
        per_rank: list[list[str]] = [[] for _ in range(world)]
        for _, rule in picked:
            for hf in rule.hf_names:
                per_rank[owner[plan.source[hf]]].append(plan.source[hf])
        reads: list[tuple[tuple[str, SafetensorsEntry, int], ...]] = []
        sizes: list[int] = []
        for r in range(world):
            at = 0
            mine: list[tuple[str, SafetensorsEntry, int]] = []
            for n in sorted(per_rank[r], key=lambda n: (str(plan.where[n].file), plan.where[n].offset)):
                mine.append((n, plan.where[n], at))
                at += -(-plan.where[n].nbytes // _ALIGN) * _ALIGN
            reads.append(tuple(mine))
            sizes.append(at)
        rounds.append(Round(tuple(rule for _, rule in picked), tuple(reads), tuple(sizes)))
    return rounds


class _Reader:
    """This rank's reader thread: fills one of three host buffers with its bytes of each round, in
    order, and hands them over through ``ready`` (a buffer is refilled only after ``release``)."""

    def __init__(self, rounds: Sequence[Round], rank: int, pin: bool) -> None:
        self.rounds, self.rank = rounds, rank
        size = max((r.sizes[rank] for r in rounds), default=0)
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(min(3, len(rounds))):  # one being read, one broadcast, one converted
            self.free.put(torch.empty(size, dtype=torch.uint8, pin_memory=pin))
        self.ready: queue.Queue[tuple[torch.Tensor | None, int, BaseException | None]] = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="underlay-load-hf-reader", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for rnd in self.rounds:
            buf = self.free.get()
            if self.stop.is_set():
                return
            try:
                nbytes = read_entries([(e, buf[at : at + e.nbytes]) for _, e, at in rnd.reads[self.rank]])
            except BaseException as exc:  # handed to the main thread, which agrees and raises
                self.ready.put((None, 0, exc))
                return
            self.ready.put((buf, nbytes, None))

    def release(self, buf: torch.Tensor) -> None:
        self.free.put(buf)

    def close(self) -> None:
        self.stop.set()
        self.free.put(torch.empty(0, dtype=torch.uint8))  # wakes a reader waiting for a buffer
        self.thread.join()


def _transfer_device(world: int) -> torch.device:
    """Where round buffers go before conversion: the collective's device with several ranks (host
    memory for gloo); with one rank the accelerator when there is one (one bulk copy per round from
    pinned memory instead of one pageable copy per tensor), else host memory."""
    if world > 1:
        return collective_device()
    from underlay.registry import get_device

    dev = get_device()
    return dev.torch_device(dev.current_index()) if dev.is_accelerator else torch.device("cpu")


def _views(rnd: Round, bufs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r, reads in enumerate(rnd.reads):
        for name, entry, at in reads:
            if entry.nbytes == 0:
                out[name] = torch.empty(entry.shape, dtype=entry.dtype, device=bufs[r].device)
            else:
                out[name] = bufs[r][at : at + entry.nbytes].view(entry.dtype).view(entry.shape)
    return out


def load_rounds(
    engine: ParallelEngine, plan: LoadPlan, rounds: Sequence[Round], path: Path
) -> Iterator[tuple[int, int]]:
    """Run ``rounds`` (collective, every rank the same rounds): yields, after each round, the HF
    tensors loaded and the bytes this rank read in it. A read that fails on any rank raises
    ``CheckpointError`` on every rank at the next round's agreement (the earlier rounds stay loaded); a
    conversion or copy that fails here is agreed at the next round or, after the last round, raised
    on this rank alone: the caller must ``agree`` once more after the loop."""
    rank, world = _world()
    device = _transfer_device(world)
    reader = _Reader(rounds, rank, pin=device.type != "cpu")
    error: BaseException | None = None  # of a conversion, agreed with the next round's read

    def convert(rnd: Round, bufs: list[torch.Tensor]) -> int:
        nonlocal error
        loaded = 0
        try:
            tensors = _views(rnd, bufs)
            for rule in rnd.rules:
                full = rule.from_hf({hf: tensors[plan.source[hf]] for hf in rule.hf_names})
                engine.copy_full_parameter(rule.engine_name, full)
                del full
                loaded += len(rule.hf_names)
        except Exception as exc:  # agreed at the next round, or by the caller after the last
            error = exc
        return loaded

    # round k+1's broadcasts run while round k is converted (two rounds of buffers live at once);
    # round k+2 reuses round k's buffers, whose conversion finished before it starts
    largest = [max((rnd.sizes[r] for rnd in rounds), default=0) for r in range(world)]
    slots: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] = ([None] * world, [None] * world)
    pending: tuple[Round, list[torch.Tensor], torch.Tensor | None, int] | None = None
    try:
        for k, rnd in enumerate(rounds):
            own, nbytes, read_error = reader.ready.get()
            error = error or read_error
            agree(
                error is None,
                describe(error),
                what=f"load_hf({path})",
                error_type=CheckpointError,
                cause=error,
            )
            assert own is not None
            bufs: list[torch.Tensor] = []
            works = []
            slot = slots[k % 2]
            for r in range(world):
                if r == rank and device.type == "cpu":
                    buf = own[: rnd.sizes[rank]]
                else:  # reused per round parity: fresh pages per round cost page faults
                    held = slot[r]
                    if held is None:
                        held = slot[r] = torch.empty(largest[r], dtype=torch.uint8, device=device)
                    buf = held[: rnd.sizes[r]]
                    if r == rank:
                        buf.copy_(own[: rnd.sizes[rank]])
                if world > 1 and rnd.sizes[r]:
                    works.append(dist.broadcast(buf, src=r, async_op=True))
                bufs.append(buf)
            if device.type != "cpu":
                reader.release(own)  # the device copy above was synchronous
                own = None
            if pending is not None:
                loaded = convert(pending[0], pending[1])
                if pending[2] is not None:
                    reader.release(pending[2])
                yield loaded, pending[3]
            for work in works:
                assert work is not None
                work.wait()
            pending = (rnd, bufs, own, nbytes)
        if pending is not None:
            loaded = convert(pending[0], pending[1])
            yield loaded, pending[3]
    finally:
        pending = None
        reader.close()
    if error is not None:
        raise error


def load_hf_files(
    engine: ParallelEngine,
    path: str | Path,
    *,
    strict: bool = True,
    bucket_bytes: int = DEFAULT_LOAD_BUCKET_BYTES,
    file_layout: Callable[[WeightMap, Mapping[str, tuple[int, ...]]], WeightMap] | None = None,
) -> LoadReport:
    """``WeightLoader.load_hf`` of every engine: load the HF safetensors of ``path`` into ``engine``
    through the ``ParallelEngine`` protocol only (``weight_map`` and ``copy_full_parameter``).

    Every HF name the map expects is looked up in the file headers (a tied alias stands in for its
    canonical name), names and shapes are all checked before any parameter changes: a shape mismatch
    always raises ``CheckpointError``; with ``strict``, missing names (except those of ``optional``
    rules) and unexpected names (neither expected, tied nor ``ignored``) raise it too. A bad header or
    index found by any rank, or a file shorter than its header says (truncated), raises on every rank,
    before any change. ``file_layout(wmap, {name: shape})`` may switch rules to the layout the files
    hold before the check (fsdp2's fused experts stored either way).

    Reading is split across ranks (module docstring): each rank validates about ``1/world`` of the file
    headers and reads about ``1/world`` of the tensor bytes, once, and the bytes reach every rank by
    broadcast, in rounds of about ``bucket_bytes``; each engine parameter is built from its HF tensors
    (``rule.from_hf``) and copied into the shards while the next round is broadcast and the one after
    is read. Extra memory per rank: about ``2 * bucket_bytes`` (two rounds; a single parameter larger
    than a round's share makes its round larger), one prefetched share of a third round and one full
    parameter.

    ``LoadReport.loaded`` counts HF tensors loaded; ``missing`` lists the expected HF names not found;
    ``unexpected`` the names in the files the map neither expects, ties nor ignores; ``bytes_read`` is
    the tensor bytes this rank read from the files. ``InvalidInput`` for a ``bucket_bytes`` that is not
    an int >= 1. Collective."""
    check_byte_count(bucket_bytes, "load_hf: bucket_bytes")
    path = Path(path)
    where = gather_headers(path)  # collective; raises on every rank for a bad file on any
    wmap = engine.weight_map
    if file_layout is not None:
        wmap = file_layout(wmap, {name: entry.shape for name, entry in where.items()})
    error: BaseException | None = None
    plan: LoadPlan | None = None
    try:
        plan = plan_load(wmap, where, path, strict)
    except CheckpointError as exc:
        error = exc
    # every rank checked the same entries: all go on, or all raise (no rank left in a collective)
    agree(error is None, str(error), what=f"load_hf({path})", error_type=CheckpointError, cause=error)
    assert plan is not None
    rounds = schedule(wmap, plan, _world()[1], bucket_bytes)
    loaded, nbytes = 0, 0
    try:
        for n, b in load_rounds(engine, plan, rounds, path):
            loaded, nbytes = loaded + n, nbytes + b
    except Exception as exc:
        error = exc
    agree(error is None, describe(error), what=f"load_hf({path})", error_type=CheckpointError, cause=error)
    return LoadReport(loaded=loaded, missing=plan.missing, unexpected=plan.unexpected, bytes_read=nbytes)
