"""CheckpointManager bookkeeping that needs no engine: which directories count as complete, the
atomic marker, and argument/state validation before anything is written or loaded. Saving, loading,
rotation and a save killed midway run against the real FSDP2 engine in
tests/distributed/test_fsdp2_engine.py."""

from __future__ import annotations

import os
import shutil
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


# ------------------------------------------------------------------ crash safety and lineage (issue 18)


class _FileEngine:
    """The part of a ParallelEngine the manager drives, holding its "weights" as one integer written
    to a file: the manager's bookkeeping (renames, pointer, rotation, recovery) is engine-independent,
    and the real FSDP2 engine runs the same paths in tests/distributed/test_reliability.py."""

    name = "file"

    def __init__(self) -> None:
        self.value = 0
        self.device = get_device("cpu")

    def save_checkpoint(self, directory: Path) -> None:
        (directory / "weights.txt").write_text(str(self.value))

    def load_checkpoint(self, directory: Path) -> None:
        self.value = int((directory / "weights.txt").read_text())

    def model_signature(self) -> dict[str, Any]:
        return {"engine": "file"}


def _file_manager(root: Path, **kw: Any) -> tuple[CheckpointManager, _FileEngine]:
    eng = _FileEngine()
    return CheckpointManager(root, cast(ParallelEngine, eng), **kw), eng


def _steps(root: Path) -> list[int]:
    return [s for s, _ in complete_checkpoints(root)]


def test_save_refuses_bool_and_non_int_steps(tmp_path: Path) -> None:
    m, _ = _file_manager(tmp_path)
    for bad in (True, False, 1.0, "3"):
        with pytest.raises(InvalidInput, match="must be an int >= 0"):
            m.save(bad, {})  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="not JSON-serialisable"):
        m.save(1, {"x": float("nan")})
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_resave_killed_between_renames_keeps_a_complete_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, eng = _file_manager(tmp_path)
    eng.value = 7
    m.save(5, {"v": 7})
    eng.value = 8
    real = os.replace
    calls: list[str] = []

    def dying(src: Any, dst: Any) -> None:
        calls.append(Path(dst).name)
        if Path(dst).name == "step_5":  # step_5 already moved to step_5.old: die before the new one
            raise OSError("killed")
        real(src, dst)

    monkeypatch.setattr(os, "replace", dying)
    with pytest.raises(CheckpointError, match="killed"):
        m.save(5, {"v": 8})
    monkeypatch.setattr(os, "replace", real)
    assert "step_5.old" in calls
    assert not (tmp_path / "step_5").exists()
    assert latest(tmp_path) == tmp_path / "step_5.old"  # visible before any recovery
    m2, eng2 = _file_manager(tmp_path)  # a restart recovers
    assert m2.latest() == tmp_path / "step_5"
    assert m2.load()["v"] == 7 and eng2.value == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_5"]


@pytest.mark.parametrize("die_at", ["step_3", "COMPLETE", "LATEST", "MANIFEST.json"])
def test_every_crash_point_of_a_save_leaves_the_previous_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, die_at: str
) -> None:
    m, eng = _file_manager(tmp_path)
    for step in (1, 2):
        eng.value = step
        m.save(step, {"v": step})
    real = os.replace

    def dying(src: Any, dst: Any) -> None:
        if Path(dst).name == die_at:
            raise OSError(f"killed at {die_at}")
        real(src, dst)

    monkeypatch.setattr(os, "replace", dying)
    eng.value = 3
    with pytest.raises(CheckpointError, match=f"killed at {die_at}"):
        m.save(3, {"v": 3})
    monkeypatch.setattr(os, "replace", real)
    m2, eng2 = _file_manager(tmp_path)
    assert m2.load()["v"] == 2 and eng2.value == 2  # the commit point is the pointer
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_from_an_older_step_starts_a_new_lineage(tmp_path: Path) -> None:
    m, eng = _file_manager(tmp_path, max_to_keep=2)
    for step in (10, 20, 30):
        eng.value = step
        m.save(step, {"v": step})
    assert _steps(tmp_path) == [20, 30]
    m2, eng2 = _file_manager(tmp_path, max_to_keep=2)
    assert m2.load(tmp_path / "step_20")["v"] == 20
    assert m2.latest() == tmp_path / "step_20"  # not the abandoned step 30
    eng2.value = 25
    m2.save(25, {"v": 25})
    assert _steps(tmp_path) == [20, 25]  # the abandoned 30 is gone, the new lineage kept
    assert m2.latest() == tmp_path / "step_25"
    for step in (26, 27):
        eng2.value = step
        m2.save(step, {"v": step})
    assert _steps(tmp_path) == [26, 27]
    # load(resume=False) (evaluation) does not move the pointer
    m2.load(tmp_path / "step_26", resume=False)
    assert m2.latest() == tmp_path / "step_27"


def test_rotation_never_deletes_the_only_complete_checkpoint(tmp_path: Path) -> None:
    m, _ = _file_manager(tmp_path, max_to_keep=1)
    for step in (1, 1, 2, 2):
        m.save(step, {"v": step})
        assert len(_steps(tmp_path)) == 1
    assert m.latest() == tmp_path / "step_2"


def test_startup_recovers_leftover_directories(tmp_path: Path) -> None:
    m, _ = _file_manager(tmp_path)
    m.save(1, {"v": 1})
    (tmp_path / "step_2.tmp").mkdir()  # a save that died while writing
    shutil.copytree(tmp_path / "step_1", tmp_path / "step_1.old")  # a swap that finished but not its cleanup
    _file_manager(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_1"]


def test_load_verifies_the_manifest_before_the_engine_changes(tmp_path: Path) -> None:
    m, eng = _file_manager(tmp_path)
    eng.value = 1234
    m.save(1, {"v": 1})
    eng.value = 99
    w = tmp_path / "step_1" / "weights.txt"
    w.write_text("1235")  # same size, one digit flipped
    with pytest.raises(CheckpointError, match=r"weights\.txt: blake2b digest differs"):
        m.load()
    assert eng.value == 99
    w.write_text("123")
    with pytest.raises(CheckpointError, match=r"weights\.txt: 3 bytes, the manifest recorded 4"):
        _file_manager(tmp_path, check_hash=False)[0].load()
    w.unlink()
    with pytest.raises(CheckpointError, match=r"weights\.txt: listed in the manifest but missing"):
        m.load()
    (tmp_path / "step_1" / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="MANIFEST.json is missing"):
        m.load()
    assert eng.value == 99


def test_checkpoints_without_lineage_are_kept_as_ancestors(tmp_path: Path) -> None:
    # markers written before lineage was recorded ({} as COMPLETE): rotation keeps the newest of them
    for step in (1, 2, 3):
        _mk(tmp_path, f"step_{step}", True)
    m, _ = _file_manager(tmp_path, max_to_keep=3)
    m.save(4, {})
    assert _steps(tmp_path) == [2, 3, 4]
    assert m.latest() == tmp_path / "step_4"


_KILLED_CHILD = """
import os, sys
from pathlib import Path
from typing import Any, cast
sys.path.insert(0, {tests!r})
from unit.test_checkpoint_manager import _file_manager
root, die_at = Path(sys.argv[1]), sys.argv[2]
m, eng = _file_manager(root)
eng.value = 1
m.save(5, {{"v": 1}})
real = os.replace
def dying(src: Any, dst: Any) -> None:
    if Path(dst).name == die_at:
        os._exit(9)  # a real death: no exception handler, no cleanup runs
    real(src, dst)
os.replace = dying
eng.value = 2
m.save(5, {{"v": 2}})
"""


@pytest.mark.parametrize(("die_at", "expected"), [("step_5", 1), ("LATEST", 2)])
def test_process_killed_mid_resave_leaves_a_loadable_step(tmp_path: Path, die_at: str, expected: int) -> None:
    """A child process re-saving step 5 is killed between the two renames (old copy moved aside, new
    not yet in place) or just before the pointer moves: the restarted manager loads a complete copy."""
    import subprocess
    import sys

    tests = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(tests).parent / "src"), tests]))
    code = _KILLED_CHILD.format(tests=tests)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), die_at], env=env, timeout=120, check=False
    )
    assert proc.returncode == 9
    m, eng = _file_manager(tmp_path)
    assert m.load()["v"] == expected and eng.value == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_5"]


def test_resaving_the_latest_step_keeps_its_ancestors(tmp_path: Path) -> None:
    m, _ = _file_manager(tmp_path, max_to_keep=3)
    for step in (1, 2, 3):
        m.save(step, {"v": step})
    m.save(3, {"v": 33})
    assert _steps(tmp_path) == [1, 2, 3]
    m2, _ = _file_manager(tmp_path, max_to_keep=3)  # a fresh manager re-saving what latest() names
    m2.save(3, {"v": 333})
    m2.save(4, {"v": 4})
    assert _steps(tmp_path) == [2, 3, 4]
    assert m2.load()["v"] == 4
