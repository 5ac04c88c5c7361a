"""``CheckpointManager``: atomic, rotated training checkpoints of a ``ParallelEngine``.

Layout of ``root``::

    step_<k>/                  one complete checkpoint
        COMPLETE               written last, atomically (temp file + os.replace)
        signature.json         engine.model_signature(), checked before anything is loaded
        trainer_state.json     the trainer's dict (JSON)
        rng_rank<r>.pt         per-rank host/device RNG state (tensors; loaded with weights_only=True)
        ...                    what engine.save_checkpoint wrote (sharded model/optimizer/scheduler)
    step_<k>.tmp/              a save in progress (or one that crashed: ignored and cleaned up)

A crash at any point of ``save`` leaves every previously complete checkpoint loadable: the new one is
assembled under ``step_<k>.tmp``, renamed, and only counts once its ``COMPLETE`` marker exists;
rotation deletes old checkpoints only after that.
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
from underlay.parallel.rank import current_rank

__all__ = ["COMPLETE_MARKER", "CheckpointManager", "complete_checkpoints", "latest"]

log = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d+)$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_path(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first (empty if none)."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or ``None``. Incomplete
    (``.tmp`` or unmarked) directories never count."""
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


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
    trainer-state dict under ``root``, keeping the newest ``max_to_keep`` complete checkpoints.

    All methods are collective over the engine's world. ``device`` (default: ``engine.device``)
    provides the RNG state. Raises ``InvalidInput`` for ``max_to_keep < 1``.
    """

    def __init__(
        self,
        root: str | Path,
        engine: ParallelEngine,
        max_to_keep: int = 3,
        device: Device | None = None,
    ) -> None:
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise InvalidInput(f"CheckpointManager: max_to_keep={max_to_keep!r} must be an int >= 1")
        self.root = Path(root)
        self.engine = engine
        self.max_to_keep = max_to_keep
        self.device = device or engine.device

    def latest(self) -> Path | None:
        """``latest(self.root)``."""
        return latest(self.root)

    def save(self, step: int, trainer_state: Mapping[str, Any]) -> Path:
        """Write checkpoint ``root/step_<step>`` atomically and rotate; returns its path.

        ``trainer_state`` must be JSON-serialisable (``InvalidInput`` before anything is written).
        Saving a step that already exists replaces it only once the new copy is complete."""
        if not isinstance(step, int) or step < 0:
            raise InvalidInput(f"CheckpointManager.save: step={step!r} must be an int >= 0")
        try:
            state_text = json.dumps(dict(trainer_state), sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(
                f"CheckpointManager.save: trainer_state is not JSON-serialisable ({exc}); keep plain "
                "numbers, strings, lists and dicts in it"
            ) from exc
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        rank = current_rank()
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("step_*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        self.engine.save_checkpoint(tmp)
        torch.save(self.device.get_rng_state(), tmp / f"rng_rank{rank}.pt")
        _fsync_path(tmp / f"rng_rank{rank}.pt")
        if rank == 0:
            (tmp / "trainer_state.json").write_text(state_text)
            signature = json.dumps(dict(self.engine.model_signature()), sort_keys=True)
            (tmp / "signature.json").write_text(signature)
        _barrier()
        if rank == 0:
            _fsync_tree(tmp)
            old = None
            if final.exists():
                old = self.root / f"step_{step}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_path(self.root)
            _atomic_write(final / COMPLETE_MARKER, json.dumps({"step": step}))
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self._rotate(keep=final)
        _barrier()
        return final

    def _rotate(self, keep: Path) -> None:
        done = complete_checkpoints(self.root)
        excess = len(done) - self.max_to_keep
        for _, path in done:
            if excess <= 0:
                break
            if path == keep:
                continue
            shutil.rmtree(path, ignore_errors=True)
            excess -= 1

    def load(self, path: str | Path | None = None) -> dict[str, Any]:
        """Restore the checkpoint at ``path`` (default: the latest complete one) into the engine and
        this rank's RNG; returns the trainer state. Everything is validated first (complete marker,
        model signature, files present and readable): ``CheckpointError`` before any state changes.
        The RNG file of this rank is used when it exists (a world-size change keeps the RNG of ranks
        that have none)."""
        target = Path(path) if path is not None else self.latest()
        if target is None:
            raise CheckpointError(f"no complete checkpoint under {self.root}; save one first")
        if not (target / COMPLETE_MARKER).is_file():
            raise CheckpointError(
                f"{target} is not a complete checkpoint (no {COMPLETE_MARKER} marker: the save did not "
                "finish); load latest(root) instead"
            )
        try:
            saved_sig = json.loads((target / "signature.json").read_text())
            trainer_state = json.loads((target / "trainer_state.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{target}: unreadable signature or trainer state ({exc})") from exc
        mine = json.loads(json.dumps(dict(self.engine.model_signature()), sort_keys=True))
        diff = _differences(saved_sig, mine)
        if diff:
            raise CheckpointError(
                f"checkpoint {target} belongs to another model: {diff}; build the engine from the "
                "same model config"
            )
        rng_file = target / f"rng_rank{current_rank()}.pt"
        rng = torch.load(rng_file, weights_only=True) if rng_file.is_file() else None
        if rng is None:
            log.warning("%s has no RNG state for rank %d; keeping this rank's RNG", target, current_rank())
        self.engine.load_checkpoint(target)
        if rng is not None:
            self.device.set_rng_state(rng)
        _barrier()
        return dict(trainer_state)

    def export_hf(self, out_dir: str | Path, **kwargs: Any) -> Path | None:
        """Full Hugging Face export of the engine's current weights through its weight loader
        (``WeightLoader.export_hf``; keyword arguments pass through). Collective."""
        from underlay.registry import get_weight_loader

        return get_weight_loader(self.engine.name).export_hf(self.engine, out_dir, **kwargs)
