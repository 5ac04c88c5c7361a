"""ResumableSampler: order, sharding, state refusal, and exact resume after a SIGKILL on 1 and 2 gloo ranks."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._dist import START_METHOD, join_group, rendezvous_store, run_distributed
from underlay.data.sampler import ResumableSampler
from underlay.interfaces import CheckpointError, ConfigError

N, GBS, SEED, FP = 22, 4, 5, "dataset-abc"


def _reference(steps: int, gbs: int = GBS) -> list[list[int]]:
    s = ResumableSampler(N, gbs, seed=SEED, fingerprint=FP)
    return [s.next_global_batch() for _ in range(steps)]


def test_global_order_sharding_and_epochs() -> None:
    ref = _reference(12)
    per_epoch = N // GBS  # 5 batches, the 2-sample tail of each permutation is dropped
    first, second = ref[:per_epoch], ref[per_epoch : 2 * per_epoch]
    assert len({i for b in first for i in b}) == per_epoch * GBS  # no repeats within an epoch
    assert first != second  # reshuffled per epoch
    for world in (1, 2, 4):
        shards = [
            ResumableSampler(N, GBS, seed=SEED, rank=r, world_size=world, fingerprint=FP)
            for r in range(world)
        ]
        for g in ref:
            parts = [s.next_batch() for s in shards]
            assert [i for p in parts for i in p] == g  # disjoint, rank-major, same global order
    other = ResumableSampler(N, GBS, seed=SEED + 1, fingerprint=FP)
    assert other.next_global_batch() != ref[0]
    plain = ResumableSampler(N, GBS, shuffle=False)
    assert plain.next_global_batch() == [0, 1, 2, 3]
    # drop_last=False: the last batch is completed from the start of the same permutation
    full = ResumableSampler(6, 4, seed=1, drop_last=False)
    a, b = full.next_global_batch(), full.next_global_batch()
    assert sorted(set(a + b)) == list(range(6)) and b[2:] == a[:2]
    s = ResumableSampler(N, GBS, seed=SEED)
    assert len(list(s)) == per_epoch and s.epoch == 0 and len(list(s)) == per_epoch and s.epoch == 1


def test_state_roundtrip_and_refusals() -> None:
    s = ResumableSampler(N, GBS, seed=SEED, fingerprint=FP)
    for _ in range(7):
        s.next_global_batch()
    state = json.loads(json.dumps(s.state_dict()))
    t = ResumableSampler(N, GBS, seed=SEED, fingerprint=FP)
    t.load_state_dict(state)
    assert [t.next_global_batch() for _ in range(6)] == [s.next_global_batch() for _ in range(6)]
    for key, value in (("seed", SEED + 1), ("fingerprint", "other-data"), ("dataset_size", N + 1)):
        u = ResumableSampler(N, GBS, seed=SEED, fingerprint=FP)
        bad = dict(state, **{key: value})
        with pytest.raises(CheckpointError, match=f"sampler state {key}="):
            u.load_state_dict(bad)
        assert (u.epoch, u.consumed) == (0, 0)  # nothing changed
    with pytest.raises(CheckpointError, match="no 'consumed'"):
        t.load_state_dict({k: v for k, v in state.items() if k != "consumed"})
    with pytest.raises(ConfigError, match="multiple of world_size=2"):
        ResumableSampler(N, 3, world_size=2, rank=0)
    with pytest.raises(ConfigError, match="empty"):
        ResumableSampler(0, 1)


def _write_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def _train(rank: int, world: int, run_dir: str, steps: int, kill_after: int | None) -> list[list[int]]:
    """Draw ``steps`` batches, recording the gathered global batch; rank 0 saves the sampler state
    after every step (as a trainer saves it with its checkpoint). With ``kill_after`` every rank
    SIGKILLs itself right after that step's state is saved."""
    out = Path(run_dir)
    sampler = ResumableSampler(N, GBS, seed=SEED, rank=rank, world_size=world, fingerprint=FP)
    state_file = out / "state.json"
    if state_file.exists():
        sampler.load_state_dict(json.loads(state_file.read_text())["sampler"])
    seen: list[list[int]] = []
    for step in range(steps):
        mine = torch.tensor(sampler.next_batch())
        parts = [torch.empty_like(mine) for _ in range(world)] if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather(parts, mine)
        seen.append(torch.cat(parts).tolist())
        if rank == 0:
            _write_state(state_file, {"sampler": sampler.state_dict(), "seen": seen})
        if dist.is_initialized():
            dist.barrier()
        if kill_after is not None and step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    return seen


def _killed_run(world: int, run_dir: Path, kill_after: int) -> None:
    """``world`` ranks started as ``tests/_dist.py`` starts them (forked from the preloaded server on a
    CPU host: no fresh interpreter per rank) run until they SIGKILL themselves."""
    import importlib

    spawn: Any = importlib.import_module("torch.multiprocessing.spawn")
    store = rendezvous_store(world)
    with pytest.raises(spawn.ProcessExitedException, match="signal"):
        spawn.start_processes(
            _killed_entry,
            args=(world, str(run_dir), store.port, kill_after),
            nprocs=world,
            start_method=START_METHOD,
        )


def _killed_entry(rank: int, world: int, run_dir: str, port: int, kill_after: int) -> None:
    join_group(port, rank, world)
    _train(rank, world, run_dir, steps=100, kill_after=kill_after)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world_before", "world_after"), [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_resume_after_kill_continues_with_the_next_batch(
    tmp_path: Path, world_before: int, world_after: int
) -> None:
    kill_after = 6  # 7 batches drawn: past the end of the first epoch (5 batches)
    _killed_run(world_before, tmp_path, kill_after)
    saved = json.loads((tmp_path / "state.json").read_text())
    ref = _reference(14)
    assert saved["seen"] == ref[: kill_after + 1]
    after = (
        run_distributed(_train, world_after, str(tmp_path), 7, None)
        if world_after > 1
        else [_train(0, 1, str(tmp_path), 7, None)]
    )
    for seen in after:  # every rank gathered the same global batches
        assert seen == ref[kill_after + 1 :]
