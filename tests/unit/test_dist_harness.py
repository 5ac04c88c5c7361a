"""``tests/_dist.py``: how ranks start on each kind of host, and what a stuck or failing run reports."""

from __future__ import annotations

import re
import time

import pytest

from tests import _dist
from tests._dist import ChildFailure, run_distributed

pytestmark = pytest.mark.distributed


def test_start_method_is_spawn_wherever_cuda_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UNDERLAY_TEST_START_METHOD", raising=False)
    monkeypatch.setattr(_dist, "_cuda_visible", lambda: True)
    assert _dist._start_method() == "spawn"
    monkeypatch.setenv("UNDERLAY_TEST_START_METHOD", "forkserver")
    with pytest.raises(ValueError, match="forkserver on a host with a CUDA device"):
        _dist._start_method()
    monkeypatch.setattr(_dist, "_cuda_visible", lambda: False)
    assert _dist._start_method() == "forkserver"
    monkeypatch.delenv("UNDERLAY_TEST_START_METHOD")
    assert _dist._start_method() == "forkserver"
    monkeypatch.setenv("UNDERLAY_TEST_START_METHOD", "fork")
    with pytest.raises(ValueError, match="'fork'"):
        _dist._start_method()


def _rank_one_hangs(rank: int, world: int) -> int:
    if rank == 1:
        while True:  # stuck outside any collective: only the deadline can end it
            time.sleep(0.05)
    return rank


def test_a_stuck_rank_is_stopped_at_the_deadline_and_reported() -> None:
    t0 = time.monotonic()
    with pytest.raises(ChildFailure) as info:
        run_distributed(_rank_one_hangs, 2, timeout_s=30, deadline_s=6)
    assert time.monotonic() - t0 < 40
    text = str(info.value)
    assert "outlived the 6 s deadline" in text
    assert "rank 0: exited (code 0), last done" in text
    assert "rank 1: alive, last running _rank_one_hangs" in text
    assert "in _rank_one_hangs" in text  # rank 1's stack, dumped before it was stopped


def _rank_zero_raises(rank: int, world: int) -> int:
    if rank == 0:
        raise KeyError("bad row on rank zero")
    return rank


def test_a_failing_rank_is_named_with_what_the_others_were_doing() -> None:
    with pytest.raises(KeyError, match="bad row on rank zero") as info:
        run_distributed(_rank_zero_raises, 2, timeout_s=30)
    cause = str(info.value.__cause__)
    assert "rank 0 of 2 failed" in cause and "KeyError" in cause
    # rank 1 is either done or was stopped while still running: either way it is described
    assert re.search(r"rank 1: (done|running _rank_zero_raises) \(since", cause), cause
