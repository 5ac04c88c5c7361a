"""``CheckpointManager``: atomic, verified, rotated training checkpoints of a ``ParallelEngine``.

Layout of ``root``::

    step_<k>/                  one complete checkpoint (a directory with a COMPLETE marker)
        ...                    what engine.save_checkpoint wrote (sharded model/optimizer/scheduler)
        rng_rank<r>.pt         per-rank host/device RNG state (tensors; loaded with weights_only=True)
        trainer_state.json     the trainer's dict (JSON)
        signature.json         engine.model_signature(), checked before anything is loaded
        MANIFEST.json          size and blake2b digest of every file above
        COMPLETE               {"step": k, "parent": p}: p is the checkpoint this run continued from
    step_<k>.tmp/              a save being assembled (or one that crashed: removed at the next start)
    step_<k>.old/              the previous copy of step k while a re-save swaps it (restored at start
                               when the crash left no step_<k>)
    LATEST                     {"step": k}: the pointer, replaced atomically; the commit point of a save

Guarantees (docs/reliability.md):

- A save is assembled and marked complete under ``step_<k>.tmp`` and renamed into place; re-saving a
  step swaps the copies by two renames, and at every instant one complete copy of each step exists.
- Lineage: ``latest()`` is the checkpoint ``LATEST`` names, i.e. the newest checkpoint this run saved
  or the one it resumed from (``load`` moves the pointer back). Rotation after a save keeps the newest
  ``max_to_keep`` checkpoints of the lineage (the new one and its ancestors through ``parent``) and
  deletes abandoned branches (checkpoints newer than a resume point that the run no longer
  descends from). The checkpoint just saved is never deleted, so a complete one always remains. A
  manager that has neither saved nor loaded continues the lineage ``latest()`` names; markers without
  a ``parent`` (older underlay) continue with the next lower step.
- ``load`` verifies the manifest (sizes always; digests unless ``check_hash=False``) and the model
  signature before the engine changes; the engine loads into fresh state; nothing is unpickled beyond
  plain data. Every failure is a ``CheckpointError`` naming the file and the cause.
- Files written by rank 0 alone are agreed on (``parallel.agree``): a failure raises on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from underlay.interfaces import CheckpointError, Device, InvalidInput, ParallelEngine
from underlay.parallel.agree import agree, agreed
from underlay.parallel.rank import current_rank, current_world_size
from underlay.utils.safe_files import (
    MANIFEST_FILE,
    as_path,
    digest_files,
    fsync_path,
    fsync_tree,
    list_files,
    verify_manifest,
    write_manifest,
)

__all__ = ["COMPLETE_MARKER", "LATEST_POINTER", "CheckpointManager", "complete_checkpoints", "latest"]

log = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
LATEST_POINTER = "LATEST"
_STEP_RE = re.compile(r"^step_(\d+)(\.old)?$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def _gather_dicts(part: dict[str, Any]) -> dict[str, Any]:
    """The union of every rank's ``part`` (collective; the dict itself without a process group)."""
    if not dist.is_initialized():
        return dict(part)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    merged: dict[str, Any] = {}
    for p in parts:
        merged.update(p or {})
    return merged


def _check_step(step: object, where: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidInput(f"{where}: step={step!r} must be an int >= 0 (a bool is not a step)")
    return step


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first (empty if none).

    A directory counts once its ``COMPLETE`` marker exists; ``.tmp`` directories never count. The
    ``.old`` copy of a step counts only while ``step_<k>`` itself is missing or incomplete (a re-save
    that crashed between its two renames), so no complete step is ever invisible."""
    base = as_path(root, "complete_checkpoints: root")
    if not base.is_dir():
        return []
    found: dict[int, Path] = {}
    for child in sorted(base.iterdir(), key=lambda p: p.name.endswith(".old")):
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.setdefault(int(m.group(1)), child)
    return sorted(found.items())


def _marker(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / COMPLETE_MARKER).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _pointer(root: Path) -> int | None:
    try:
        step = json.loads((root / LATEST_POINTER).read_text(encoding="utf-8"))["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def latest(root: str | Path) -> Path | None:
    """The checkpoint to resume from under ``root``, or ``None``: the complete checkpoint the
    ``LATEST`` pointer names; without a usable pointer (none written yet, or it names a checkpoint
    that is gone), the complete checkpoint with the highest step. Incomplete directories never count."""
    done = dict(complete_checkpoints(root))
    if not done:
        return None
    step = _pointer(Path(root))
    if step is not None and step in done:
        return done[step]
    return done[max(done)]


def _differences(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str:
    """Which top-level signature entries differ (for nested mappings: the first differing keys)."""
    out = []
    for key in sorted(set(saved) | set(mine)):
        a, b = saved.get(key), mine.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            out.append(
                f"{key} differ at {keys[:3]} (checkpoint {[a.get(k) for k in keys[:3]]}, "
                f"model {[b.get(k) for k in keys[:3]]})"
            )
        else:
            out.append(f"{key}: checkpoint {a!r} != model {b!r}")
    return "; ".join(out)


class CheckpointManager:
    """Saves and restores ``engine`` (model, optimizer, LR schedule), per-rank RNG state and a
    trainer-state dict under ``root``, keeping the newest ``max_to_keep`` checkpoints of the run's
    lineage (module docstring).

    All methods but ``latest`` are collective over the engine's world. ``device`` (default:
    ``engine.device``) provides the RNG state. ``check_hash=False`` skips the digest check at load
    (for very large checkpoints; sizes are always checked). Raises ``InvalidInput`` for
    ``max_to_keep`` not an int >= 1 and a ``root`` that is not a path. Construction recovers what a
    crashed save left in ``root`` (rank 0): ``.old`` copies without their step are renamed back,
    ``.tmp`` directories removed. One manager writes to a ``root`` at a time.
    """

    def __init__(
        self,
        root: str | Path,
        engine: ParallelEngine,
        max_to_keep: int = 3,
        device: Device | None = None,
        *,
        check_hash: bool = True,
    ) -> None:
        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise InvalidInput(f"CheckpointManager: max_to_keep={max_to_keep!r} must be an int >= 1")
        if not isinstance(check_hash, bool):
            raise InvalidInput(f"CheckpointManager: check_hash={check_hash!r} must be True or False")
        # the type is checked here (the same on every rank); what the file system says is checked by
        # rank 0 inside save's agreed steps, so a failure there reaches every rank as CheckpointError
        self.root = as_path(root, "CheckpointManager: root")
        self.engine = engine
        self.max_to_keep = max_to_keep
        self.device = device or engine.device
        self.check_hash = check_hash
        self._parent: int | None = None  # the step this run last saved or resumed from
        if current_rank() == 0:
            self.recover()

    def recover(self) -> None:
        """Repair ``root`` after a crash (no-op on a clean root; run by rank 0 at construction and
        before each save): a ``step_<k>.old`` whose ``step_<k>`` is missing or incomplete is renamed
        back (removing the incomplete one), other ``.old`` and every ``.tmp`` directory are removed.
        Never removes a complete checkpoint that has no complete replacement."""
        if not self.root.is_dir():
            return
        for child in sorted(self.root.iterdir()):
            m = _STEP_RE.match(child.name)
            if child.name.endswith(".tmp") and child.is_dir() and child.name.startswith("step_"):
                shutil.rmtree(child, ignore_errors=True)
            elif m and m.group(2) and child.is_dir():
                final = self.root / f"step_{m.group(1)}"
                if (final / COMPLETE_MARKER).is_file() or not (child / COMPLETE_MARKER).is_file():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    if final.exists():
                        shutil.rmtree(final)
                    os.replace(child, final)
                    fsync_path(self.root)

    def latest(self) -> Path | None:
        """``latest(self.root)``: the checkpoint a restart of this run resumes from."""
        return latest(self.root)

    def save(self, step: int, trainer_state: Mapping[str, Any]) -> Path:
        """Write checkpoint ``root/step_<step>`` atomically, make it ``latest()`` and rotate; returns
        its path. ``step`` is an int >= 0 (not a bool); ``trainer_state`` must be JSON-serialisable
        (``InvalidInput`` before anything is written). Saving a step that already exists replaces it
        only once the new copy is complete. A failure on any rank raises ``CheckpointError`` on every
        rank, leaving the earlier checkpoints and ``latest()`` as they were."""
        step = _check_step(step, "CheckpointManager.save")
        if not isinstance(trainer_state, Mapping):
            raise InvalidInput(
                f"CheckpointManager.save: trainer_state is a {type(trainer_state).__name__}; give a dict"
            )
        try:
            state_text = json.dumps(dict(trainer_state), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(
                f"CheckpointManager.save: trainer_state is not JSON-serialisable ({exc}); keep plain "
                "finite numbers, strings, lists and dicts in it"
            ) from exc
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        rank = current_rank()
        if self._parent is not None:
            parent: int | None = self._parent
        else:  # a run that neither saved nor loaded yet continues what latest() names
            found = latest(self.root)
            m = _STEP_RE.match(found.name) if found is not None else None
            parent = int(m.group(1)) if m else None
        if parent == step:  # re-saving a step: the new copy takes the old copy's place in the lineage
            parent = self._parent_of(step)
        with agreed(f"save({final}): preparing", error_type=CheckpointError):
            if rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                self.recover()
                tmp.mkdir()
        with agreed(f"save({final}): writing", error_type=CheckpointError):
            self.engine.save_checkpoint(tmp)
            rng_file = tmp / f"rng_rank{rank}.pt"
            torch.save(self.device.get_rng_state(), rng_file)
            fsync_path(rng_file)
        # every file is written now: the ranks hash disjoint shares of them in parallel for the manifest
        digests: dict[str, dict[str, Any]] = {}
        with agreed(f"save({final}): hashing", error_type=CheckpointError):
            world = current_world_size()
            digests = digest_files(tmp, list_files(tmp, skip=(COMPLETE_MARKER,))[rank::world])
        known = _gather_dicts(digests)
        with agreed(f"save({final}): committing", error_type=CheckpointError):
            if rank == 0:
                (tmp / "trainer_state.json").write_text(state_text)
                signature = json.dumps(dict(self.engine.model_signature()), sort_keys=True)
                (tmp / "signature.json").write_text(signature)
                write_manifest(tmp, skip=(COMPLETE_MARKER,), known=known)
                _atomic_write(tmp / COMPLETE_MARKER, json.dumps({"step": step, "parent": parent}))
                fsync_tree(tmp)
                self._commit(tmp, final)
                _atomic_write(self.root / LATEST_POINTER, json.dumps({"step": step}))
        self._parent = step
        if rank == 0:
            try:
                self._rotate(keep=step)
            except OSError as exc:  # the new checkpoint is committed; a leftover old one is harmless
                log.warning("checkpoint rotation under %s failed: %s", self.root, exc)
        _barrier()
        return final

    def _commit(self, tmp: Path, final: Path) -> None:
        """Swap the complete ``tmp`` into ``final``: at every instant a complete copy of the step
        exists as ``final`` or ``final.old`` (``complete_checkpoints`` and ``recover`` see it)."""
        old = final.with_name(final.name + ".old")
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            fsync_path(self.root)
        os.replace(tmp, final)
        fsync_path(self.root)
        if old.exists():
            shutil.rmtree(old)

    def _parent_of(self, step: int) -> int | None:
        """The parent recorded by the complete copy of ``step`` (the next lower complete step for a
        marker without one; ``None`` when there is no such copy)."""
        done = dict(complete_checkpoints(self.root))
        if step not in done:
            return None
        marker = _marker(done[step])
        if "parent" not in marker:
            return max((s for s in done if s < step), default=None)
        parent = marker["parent"]
        return parent if isinstance(parent, int) and not isinstance(parent, bool) and parent != step else None

    def _lineage(self, step: int, done: Mapping[int, Path]) -> list[int]:
        """``step`` and its ancestors through the ``parent`` of each COMPLETE marker, newest first.
        A marker without a ``parent`` entry (written before lineage was recorded) continues with the
        next lower complete step, so upgrading never turns old checkpoints into an abandoned branch."""
        chain: list[int] = []
        cur: int | None = step
        while cur is not None and cur in done and cur not in chain:
            chain.append(cur)
            marker = _marker(done[cur])
            if "parent" not in marker:
                lower = [s for s in done if s < cur]
                cur = max(lower) if lower else None
                continue
            parent = marker["parent"]
            cur = parent if isinstance(parent, int) and not isinstance(parent, bool) else None
        return chain

    def _rotate(self, keep: int) -> None:
        """Delete abandoned branches and all but the newest ``max_to_keep`` of ``keep``'s lineage."""
        done = dict(complete_checkpoints(self.root))
        chain = self._lineage(keep, done)
        kept = set(chain[: self.max_to_keep]) | {keep}
        for step, path in sorted(done.items()):
            if step not in kept:
                shutil.rmtree(path)

    def verify(self, path: str | Path, *, share: tuple[int, int] = (0, 1)) -> Path:
        """Check the checkpoint at ``path`` without loading it: COMPLETE marker, manifest (sizes and
        presence of every file; digests when ``check_hash``, of the ``share=(rank, world)`` part:
        ``load`` splits the hashing over the ranks). Returns the path; ``CheckpointError`` naming the
        bad file and the cause. Local (not collective)."""
        target = Path(path)
        if not (target / COMPLETE_MARKER).is_file():
            raise CheckpointError(
                f"{target} is not a complete checkpoint (no {COMPLETE_MARKER} marker: the save did not "
                "finish); load latest(root) instead"
            )
        if not (target / MANIFEST_FILE).is_file():
            raise CheckpointError(
                f"{target / MANIFEST_FILE} is missing: the checkpoint cannot be verified (written by an "
                "older underlay, or damaged); re-save it from a run that holds the state"
            )
        verify_manifest(target, check_hash=self.check_hash, skip=(COMPLETE_MARKER,), share=share)
        return target

    def load(self, path: str | Path | None = None, *, resume: bool = True) -> dict[str, Any]:
        """Restore the checkpoint at ``path`` (default: ``latest()``) into the engine and this rank's
        RNG; returns the trainer state. Everything is validated first (complete marker, manifest,
        model signature): ``CheckpointError`` before any state changes; the engine then loads into
        fresh state that replaces its live state only once everything was read. With ``resume``
        (default) the checkpoint becomes ``latest()`` and the parent of the next save (later steps
        become an abandoned branch that the next save's rotation deletes). The RNG file of this rank is
        used when it exists (a world-size change keeps the RNG of ranks that have none)."""
        if not isinstance(resume, bool):
            raise InvalidInput(f"CheckpointManager.load: resume={resume!r} must be True or False")
        target = Path(path) if path is not None else self.latest()
        if target is None:
            raise CheckpointError(f"no complete checkpoint under {self.root}; save one first")
        error: CheckpointError | None = None
        trainer_state: dict[str, Any] = {}
        rng: Any = None
        try:
            self.verify(target, share=(current_rank(), current_world_size()))  # disjoint hash shares
            trainer_state, rng = self._read_small_files(target)
        except CheckpointError as exc:
            error = exc
        # every rank checked before any state changes; all raise together (one small all-reduce)
        agree(error is None, str(error), what=f"load({target})", error_type=CheckpointError, cause=error)
        self.engine.load_checkpoint(target)
        if rng is not None:
            self.device.set_rng_state(rng)
        if resume:
            m = _STEP_RE.match(target.name)
            step = int(m.group(1)) if m and target.parent.resolve() == self.root.resolve() else None
            if step is not None:
                self._parent = step
                if current_rank() == 0:
                    _atomic_write(self.root / LATEST_POINTER, json.dumps({"step": step}))
        _barrier()
        return dict(trainer_state)

    def _read_small_files(self, target: Path) -> tuple[dict[str, Any], Any]:
        """Trainer state, checked model signature and this rank's RNG state (or ``None``) of
        ``target``; ``CheckpointError`` naming the file for anything unreadable or mismatched."""
        try:
            saved_sig = json.loads((target / "signature.json").read_text())
            trainer_state = json.loads((target / "trainer_state.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{target}: unreadable signature or trainer state ({exc})") from exc
        if not isinstance(trainer_state, dict):
            raise CheckpointError(
                f"{target / 'trainer_state.json'} holds a {type(trainer_state).__name__}, not a dict"
            )
        mine = json.loads(json.dumps(dict(self.engine.model_signature()), sort_keys=True))
        diff = _differences(saved_sig, mine)
        if diff:
            raise CheckpointError(
                f"checkpoint {target} belongs to another model: {diff}; build the engine from the "
                "same model config"
            )
        rng_file = target / f"rng_rank{current_rank()}.pt"
        if not rng_file.is_file():
            log.warning("%s has no RNG state for rank %d; keeping this rank's RNG", target, current_rank())
            return trainer_state, None
        try:
            return trainer_state, torch.load(rng_file, weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"{rng_file}: unreadable RNG state ({exc})") from exc

    def export_hf(self, out_dir: str | Path, **kwargs: Any) -> Path | None:
        """Full Hugging Face export of the engine's current weights through its weight loader
        (``WeightLoader.export_hf``: written into a fresh sibling directory and swapped in, so an
        earlier export there is replaced whole; keyword arguments pass through). Collective."""
        from underlay.registry import get_weight_loader

        return get_weight_loader(self.engine.name).export_hf(self.engine, out_dir, **kwargs)
