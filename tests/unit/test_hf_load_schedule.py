"""``underlay.engines._hf_load.schedule``: how ``load_hf`` splits the reads over ranks (pure planning,
no process group): every needed tensor is read exactly once, ranks get about equal bytes in contiguous
file order, every round completes the parameters it names, and rounds respect the bucket size."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from underlay.engines._hf_load import LoadPlan, schedule
from underlay.engines._weightmap import fuse_gate_up, rename
from underlay.interfaces import WeightMap
from underlay.utils.safe_files import SafetensorsEntry


def _model(seed: int, files: int) -> tuple[WeightMap, LoadPlan]:
    """A random model: renamed tensors and fused gate/up pairs of random sizes, laid out in order over
    ``files`` files (a pair may straddle two files)."""
    rng = random.Random(seed)
    rules, sizes = [], {}
    for i in range(40):
        if i % 3 == 0:
            rows = rng.randint(1, 64)
            rules.append(replace(fuse_gate_up(f"p{i}", f"g{i}", f"u{i}"), engine_shape=(2 * rows, 16)))
            sizes[f"g{i}"] = sizes[f"u{i}"] = (rows, 16)
        else:
            shape = (rng.randint(1, 512),)
            rules.append(replace(rename(f"p{i}", f"t{i}"), engine_shape=shape))
            sizes[f"t{i}"] = shape
    names = list(sizes)
    where, at = {}, 0
    per_file = -(-len(names) // files)
    for k, name in enumerate(names):
        if k % per_file == 0:
            at = 100
        nbytes = 4 * int(torch.Size(sizes[name]).numel())
        where[name] = SafetensorsEntry(Path(f"f{k // per_file:02d}"), sizes[name], torch.float32, at, nbytes)
        at += nbytes
    wmap = WeightMap(tuple(rules))
    return wmap, LoadPlan(where, {n: n for n in names}, (), ())


@pytest.mark.parametrize("files", [1, 3, 7])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket", [1, 4096, 1 << 30])
def test_schedule_reads_each_tensor_once_balanced_and_complete(files: int, world: int, bucket: int) -> None:
    wmap, plan = _model(files * 10 + world, files)
    rounds = schedule(wmap, plan, world, bucket)
    read = [(r, name) for rnd in rounds for r, reads in enumerate(rnd.reads) for name, _, _ in reads]
    assert sorted(n for _, n in read) == sorted(plan.where)  # every tensor exactly once
    total = sum(e.nbytes for e in plan.where.values())
    largest = max(e.nbytes for e in plan.where.values())
    per_rank = [sum(plan.where[n].nbytes for r, n in read if r == rank) for rank in range(world)]
    assert all(abs(b - total / world) <= largest for b in per_rank), (per_rank, total)
    # contiguous runs: in file/offset order, the owning rank never decreases
    owner = {n: r for r, n in read}
    order = sorted(plan.where, key=lambda n: (str(plan.where[n].file), plan.where[n].offset))
    assert [owner[n] for n in order] == sorted(owner[n] for n in order)
    index = {r.engine_name: i for i, r in enumerate(wmap.rules)}
    loaded = [r.engine_name for rnd in rounds for r in rnd.rules]
    assert sorted(loaded, key=index.__getitem__) == list(index)  # every parameter exactly once
    for rnd in rounds:
        assert [index[r.engine_name] for r in rnd.rules] == sorted(index[r.engine_name] for r in rnd.rules)
        names = {n for reads in rnd.reads for n, _, _ in reads}
        assert names == {hf for rule in rnd.rules for hf in rule.hf_names}  # complete in its round
        for r, reads in enumerate(rnd.reads):  # aligned, non-overlapping, inside the buffer
            ends = 0
            for _, entry, at in reads:
                assert at % 64 == 0 and at >= ends
                ends = at + entry.nbytes
            assert ends <= rnd.sizes[r]
        if bucket >= 1 << 30:
            assert len(rounds) == 1
    if bucket == 1:  # one parameter per rank per round
        assert all(len(rnd.rules) <= world for rnd in rounds)
