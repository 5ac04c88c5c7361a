"""``underlay.init_distributed`` starts a real gloo group from torchrun-style environment variables."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._dist import START_METHOD, free_port
from underlay.interfaces import ConfigError
from underlay.parallel.distributed import read_env

pytestmark = pytest.mark.distributed


def _child(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        UNDERLAY_DEVICE="cpu",
    )
    import underlay

    env = underlay.init_distributed()
    assert dist.get_backend() == "gloo"
    assert (env.rank, env.world_size) == (rank, world)
    assert underlay.init_distributed().rank == rank  # idempotent
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    torch.save({"rank": rank, "sum": x.item()}, f"{out}/r{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)  # the result is on disk; skip teardown (c10d threads can abort a finished child at exit)


def test_two_process_group_from_env(tmp_path: pytest.TempPathFactory) -> None:
    # the ranks start as run_distributed's do (forked from the preloaded forkserver on a CPU host), not
    # as fresh interpreters that import torch again; bounded, naming the ranks still running
    procs = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
        _child, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False, start_method=START_METHOD
    )
    deadline = time.monotonic() + 120
    while not procs.join(timeout=0.5):  # a rank that fails raises here, naming its rank
        if time.monotonic() > deadline:
            alive = [r for r, p in enumerate(procs.processes) if p.is_alive()]
            for p in procs.processes:
                p.kill()
            pytest.fail(f"ranks {alive} of 2 still running 120 s after the start")
    for r in range(2):
        got = torch.load(f"{tmp_path}/r{r}.pt", weights_only=True)
        assert got == {"rank": r, "sum": 3.0}


def test_read_env_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("MASTER_PORT", "1234")
    with pytest.raises(ConfigError, match="RANK=5 is outside"):
        read_env()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        read_env()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ConfigError, match="MASTER_PORT is not set"):
        read_env()


def test_single_process_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    env = read_env()
    assert (env.rank, env.local_rank, env.world_size) == (0, 0, 1)
    assert env.master_port > 0


def _fail_loudly(rank: int, world: int) -> None:
    raise ValueError("x" * 300_000)  # an error message far larger than a pipe's buffer


def test_run_distributed_reports_a_huge_error_instead_of_hanging() -> None:
    """A child error whose message is far larger than the result pipe's buffer (an error that prints
    tensors) fails the run with the child's exception, clipped; the run must not hang in the child's
    report while the parent waits for the children to exit."""
    from tests._dist import run_distributed

    with pytest.raises((ValueError, RuntimeError), match="characters cut"):
        run_distributed(_fail_loudly, 2, timeout_s=60)


def test_a_gloo_group_it_started_is_destroyed_at_exit() -> None:
    """A process that calls ``init_distributed`` and exits without ``destroy_process_group`` has its gloo
    group destroyed by underlay's exit hook before interpreter teardown: an exit hook registered before
    the group (so run after underlay's) sees no group, and the process exits 0."""
    import subprocess
    import sys

    code = (
        "import atexit, torch.distributed as dist\n"
        "atexit.register(lambda: print('at exit:', dist.is_initialized(), flush=True))\n"
        "import underlay\n"
        "underlay.init_distributed()\n"
        "print('started:', dist.is_initialized(), dist.get_backend(), flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(UNDERLAY_DEVICE="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["started: True gloo", "at exit: False"], proc.stdout
