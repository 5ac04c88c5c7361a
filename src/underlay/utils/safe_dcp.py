"""``torch.distributed.checkpoint`` loading that never runs code from the checkpoint.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle`` and its
``DefaultLoadPlanner.load_bytes`` reads every non-tensor entry (optimizer param groups, ...) with
``torch.load(weights_only=False)``: a tampered file runs arbitrary code in either. ``safe_dcp_load``
plugs in a reader whose metadata goes through ``restricted_load`` and a planner whose byte entries go
through ``torch.load(weights_only=True)``. Failures, including torch's ``CheckpointException`` (a
``BaseException``), become ``CheckpointError`` naming the checkpoint and the cause.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from underlay.interfaces import CheckpointError
from underlay.utils.safe_files import restricted_load

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "safe_dcp_load"]


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by ``restricted_load`` (DCP metadata types only)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's ``Metadata``; ``CheckpointError`` naming the file for anything else in it."""
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            fh = open(path, "rb")  # noqa: SIM115 (closed below; the error names the file)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot open DCP metadata ({exc})") from exc
        with fh:
            metadata = restricted_load(fh, source=str(path))
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Store one non-tensor entry, refusing any pickle that needs more than plain data."""
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn!r}: refused ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); only plain data is unpickled"
            ) from exc
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _first_cause(exc: CheckpointException) -> BaseException | None:
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return None


def safe_dcp_load(state: dict[str, Any], directory: Path) -> None:
    """``torch.distributed.checkpoint.load(state, checkpoint_id=directory)`` in place into ``state``
    through ``SafeFileSystemReader`` and ``SafeLoadPlanner``. Raises ``CheckpointError`` (naming
    ``directory`` and the first failing rank's cause) for every failure, torch's
    ``CheckpointException`` included. Collective like ``dcp.load``."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    # read the metadata once up front: a refused or missing file fails here with its own message
    # (inside dcp.load torch retries a rank-local file and merges both failures into one string)
    SafeFileSystemReader(str(directory)).read_metadata()
    try:
        dcp_load(state, storage_reader=SafeFileSystemReader(str(directory)), planner=SafeLoadPlanner())
    except CheckpointError:
        raise
    except CheckpointException as exc:
        cause = _first_cause(exc)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from cause
        what = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc).splitlines()[0]
        raise CheckpointError(f"{directory}: loading the sharded state failed ({what})") from cause
    except Exception as exc:
        raise CheckpointError(
            f"{directory}: loading the sharded state failed ({type(exc).__name__}: {exc})"
        ) from exc
