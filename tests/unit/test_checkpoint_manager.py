"""CheckpointManager bookkeeping that needs no engine: which directories count as complete, the
atomic marker, and argument/state validation before anything is written or loaded. Saving, loading,
rotation and a save killed midway run against the real FSDP2 engine in
tests/distributed/test_fsdp2_engine.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from underlay.checkpoint import COMPLETE_MARKER, CheckpointManager, complete_checkpoints, latest
from underlay.checkpoint.manager import _atomic_write
from underlay.interfaces import CheckpointError, InvalidInput, ParallelEngine
from underlay.registry import get_device


def _mk(root: Path, name: str, complete: bool) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text("{}")
    if complete:
        (d / COMPLETE_MARKER).write_text("{}")
    return d


def test_only_marked_step_directories_count(tmp_path: Path) -> None:
    _mk(tmp_path, "step_1", True)
    three = _mk(tmp_path, "step_3", True)
    _mk(tmp_path, "step_10", False)  # renamed but its marker never written
    _mk(tmp_path, "step_12.tmp", True)  # still being assembled
    _mk(tmp_path, "other_20", True)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1, 3]
    assert latest(tmp_path) == three
    assert latest(tmp_path / "missing") is None
    assert complete_checkpoints(tmp_path / "missing") == []


def test_atomic_write_replaces_without_leftovers(tmp_path: Path) -> None:
    target = tmp_path / COMPLETE_MARKER
    _atomic_write(target, '{"step": 1}')
    _atomic_write(target, '{"step": 2}')
    assert target.read_text() == '{"step": 2}'
    assert [p.name for p in tmp_path.iterdir()] == [COMPLETE_MARKER]


def _manager(root: Path, **kw: Any) -> CheckpointManager:
    # validation happens before the engine is touched; an engine-less manager proves it
    return CheckpointManager(root, cast(ParallelEngine, object()), device=get_device("cpu"), **kw)


def test_bad_arguments_are_rejected_before_writing(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="max_to_keep=0"):
        _manager(tmp_path, max_to_keep=0)
    m = _manager(tmp_path / "ck")
    with pytest.raises(InvalidInput, match="not JSON-serialisable"):
        m.save(1, {"bad": object()})
    with pytest.raises(InvalidInput, match="step=-1"):
        m.save(-1, {})
    assert not (tmp_path / "ck").exists()


def test_load_refuses_missing_and_incomplete(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        m.load()
    half = _mk(tmp_path, "step_2", False)
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        m.load(half)
