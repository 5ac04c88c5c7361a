"""``parallel.agree.shared_failure``: after a phase every rank ran to its end, every rank raises the first
failing rank's exception (its own when it failed), on 2 real gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed]


class _TwoArgs(Exception):
    """An exception that pickles but does not unpickle (its ``__init__`` needs two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


def _outcome(error: Exception | None) -> dict[str, Any]:
    from underlay.parallel.agree import shared_failure

    got = shared_failure(error, what="phase", where="stage X")
    if got is None:
        return {"got": None}
    return {
        "got": type(got).__name__,
        "text": str(got),
        "notes": list(getattr(got, "__notes__", [])),
        "own": got is error,
    }


def job(rank: int, world: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    out = [_outcome(None)]
    out.append(_outcome(ValueError("bad value 7") if rank == 1 else None))
    out.append(_outcome(_TwoArgs("x", "y") if rank == 1 else None))
    both = KeyError(f"from rank {rank}")
    out.append(_outcome(both))
    dist.barrier()  # the group still works after the failures
    return out


def test_every_rank_raises_the_first_failing_ranks_exception() -> None:
    r0, r1 = run_distributed(job, 2, timeout_s=60)
    # nobody failed: nothing to raise
    assert r0[0] == r1[0] == {"got": None}
    # rank 1 failed: it keeps its own exception; rank 0 gets a ValueError with rank 1's text and a note
    assert r1[1] == {"got": "ValueError", "text": "bad value 7", "notes": [], "own": True}
    assert r0[1]["got"] == "ValueError" and r0[1]["text"] == "bad value 7" and not r0[1]["own"]
    assert r0[1]["notes"] == ["phase: raised on rank 1 (stage X), not on this rank; every rank raises it"]
    # an exception that does not rebuild: rank 0 gets UnderlayError with its type and text
    assert r1[2]["got"] == "_TwoArgs" and r1[2]["own"]
    assert r0[2]["got"] == "UnderlayError", r0[2]
    assert r0[2]["text"] == "phase failed on rank 1 (stage X): _TwoArgs: x/y; this rank raises it too"
    # both failed: each keeps its own
    assert r0[3]["own"] and r1[3]["own"] and r0[3]["text"] != r1[3]["text"]
