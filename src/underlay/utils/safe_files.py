"""Files that cannot run code, cannot load corrupt and cannot be half-written.

Engine-neutral helpers shared by checkpointing and weight loading (engines may not import services,
so they live here):

- ``restricted_load``: unpickles only an allow-list of classes (what a ``torch.distributed.checkpoint``
  ``.metadata`` file holds); anything else is refused with ``CheckpointError`` naming the file, and no
  code from the file runs.
- ``write_manifest`` / ``verify_manifest``: sizes and blake2b digests of every file of a directory,
  written at save and verified before anything is loaded (``check_hash=False`` keeps the size check).
- ``atomic_directory``: build a directory in a fresh sibling, fsync it, swap it in by renames;
  ``recover_directory`` puts a crashed swap back together.
- ``read_safetensors_dir``: the tensors of a Hugging Face directory (following
  ``model.safetensors.index.json`` when present) with every file's header validated (names, shapes,
  dtypes, sizes: a truncated file is refused) before one tensor is read; its three steps
  (``safetensors_files``, ``read_safetensors_header``, ``merge_safetensors_headers``) are public so
  ranks can validate disjoint files, and ``read_entries`` reads validated byte ranges with plain reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import struct
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from underlay.interfaces import CheckpointError, InvalidInput

__all__ = [
    "DCP_METADATA_CLASSES",
    "INDEX_FILE",
    "MANIFEST_FILE",
    "SAFETENSORS_DTYPES",
    "SafetensorsEntry",
    "abort_directory",
    "as_path",
    "atomic_directory",
    "begin_directory",
    "commit_directory",
    "digest_files",
    "fsync_path",
    "fsync_tree",
    "iter_safetensors",
    "list_files",
    "merge_safetensors_headers",
    "read_entries",
    "read_safetensors_dir",
    "read_safetensors_header",
    "recover_directory",
    "restricted_load",
    "safetensors_files",
    "verify_manifest",
    "writable_directory",
    "write_manifest",
]

MANIFEST_FILE = "MANIFEST.json"

# (module, name) of every class a torch.distributed.checkpoint ``.metadata`` pickle may construct.
# Their constructors only store their arguments; none reads or writes files or calls back into code.
DCP_METADATA_CLASSES: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class _Restricted(pickle.Unpickler):
    def __init__(self, fh: IO[bytes], allowed: frozenset[tuple[str, str]], source: str) -> None:
        super().__init__(fh)
        self._allowed = allowed
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self._allowed:
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self._source}: refuses to unpickle {module}.{name} (not a type a checkpoint holds); the "
            "file was tampered with or written by something else, nothing from it was run"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self._source}: holds a persistent reference {pid!r}; refused")


def restricted_load(
    fh: IO[bytes], *, source: str, allowed: frozenset[tuple[str, str]] = DCP_METADATA_CLASSES
) -> Any:
    """Unpickle ``fh`` constructing only the classes in ``allowed`` (plus torch dtypes and the
    builtin containers and scalars pickle encodes without lookups). Anything else, and any malformed
    pickle, raises ``CheckpointError`` naming ``source`` before any object of the file is called."""
    try:
        return _Restricted(fh, allowed, source).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{source}: not a readable pickle ({type(exc).__name__}: {exc})") from exc


# ---------------------------------------------------------------------------------------- fsync


def fsync_path(path: Path) -> None:
    """fsync one file or directory (its entries) so a crash after a rename cannot lose it."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (``path`` included)."""
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


# ------------------------------------------------------------------------------------- manifest


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(directory: Path, skip: frozenset[str]) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(directory).as_posix()
            if rel not in skip:
                out.append(rel)
    return sorted(out)


def list_files(directory: Path, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Relative POSIX paths of every file under ``directory`` except the manifest and ``skip``, sorted
    (the order ``digest_files`` shares split by rank)."""
    return _files(Path(directory), frozenset((MANIFEST_FILE, *skip)))


def digest_files(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"size": bytes, "blake2b": hex}}`` for ``names`` (relative to ``directory``): the
    manifest entries of those files, computed where they are (ranks hash disjoint shares in parallel)."""
    directory = Path(directory)
    return {
        rel: {"size": (directory / rel).stat().st_size, "blake2b": _digest(directory / rel)} for rel in names
    }


def write_manifest(
    directory: Path,
    *,
    skip: tuple[str, ...] = (),
    known: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Write ``directory/MANIFEST.json``: size in bytes and blake2b-256 digest of every file under
    ``directory`` (relative POSIX paths; ``skip`` names files written after the manifest). Entries in
    ``known`` (from ``digest_files`` on other ranks) are used as given when their file's size still
    matches; the rest are hashed here. Written to a temporary name, fsynced and renamed; returns its
    path."""
    directory = Path(directory)
    known = known or {}
    files: dict[str, dict[str, Any]] = {}
    for rel in list_files(directory, skip=skip):
        entry = known.get(rel)
        if entry is None or entry["size"] != (directory / rel).stat().st_size:
            entry = digest_files(directory, [rel])[rel]
        files[rel] = entry
    target = directory / MANIFEST_FILE
    tmp = directory / (MANIFEST_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"version": 1, "files": files}, fh, sort_keys=True, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    return target


def verify_manifest(
    directory: Path,
    *,
    check_hash: bool = True,
    skip: tuple[str, ...] = (),
    share: tuple[int, int] = (0, 1),
) -> None:
    """Check ``directory`` against its ``MANIFEST.json`` without loading anything else: every listed
    file exists with its recorded size and (with ``check_hash``) digest, and no unlisted file is there
    (``skip`` excepted). ``share=(rank, world)`` hashes only every ``world``-th listed file from
    ``rank`` on (ranks verify disjoint shares in parallel; existence and sizes are checked for all).
    Raises ``CheckpointError`` naming the first bad file and the cause."""
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        assert isinstance(files, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        raise CheckpointError(
            f"{path}: missing or unreadable manifest ({exc}); the checkpoint is incomplete or corrupt"
        ) from exc
    rank, world = share
    for i, (rel, entry) in enumerate(sorted(files.items())):
        f = directory / rel
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(
                f"{f}: listed in the manifest but missing; the checkpoint is corrupt"
            ) from None
        if size != entry["size"]:
            raise CheckpointError(
                f"{f}: {size} bytes, the manifest recorded {entry['size']} (truncated or overwritten)"
            )
        if check_hash and i % world == rank and _digest(f) != entry["blake2b"]:
            raise CheckpointError(f"{f}: blake2b digest differs from the manifest (the bytes are corrupt)")
    extra = sorted(set(list_files(directory, skip=skip)) - set(files))
    if extra:
        raise CheckpointError(
            f"{directory}: files not in the manifest {extra[:5]}; something wrote into the checkpoint after "
            "it was saved"
        )


# ------------------------------------------------------------------------------ atomic directories


def as_path(value: object, what: str) -> Path:
    """``value`` (a ``str`` or ``os.PathLike``, not empty) as a ``Path``; ``InvalidInput`` naming
    ``what`` and the value otherwise."""
    if isinstance(value, (str, os.PathLike)) and str(value).strip():
        return Path(value)
    raise InvalidInput(f"{what}={value!r}: give a non-empty directory or file path (str or pathlib.Path)")


def writable_directory(path: Path, what: str) -> Path:
    """Create directory ``path`` (and its parents) unless it exists; ``InvalidInput`` naming ``what``
    when ``path`` or one of its parents is an existing file, or the directory cannot be created
    (permissions, read-only file system). Nothing existing is changed."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise InvalidInput(
                f"{what}: {p} is an existing file, not a directory; choose another path (the file is left as it is)"
            )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidInput(f"{what}: cannot create directory {path} ({exc}); choose a writable path") from exc
    return path


def _sibling(final: Path, tag: str) -> Path:
    return final.with_name(f"{final.name}.{tag}")


def recover_directory(final: Path) -> None:
    """Undo a swap of ``atomic_directory`` that a crash interrupted: when ``final`` is missing and
    its ``.old`` copy exists, the old copy is renamed back; leftover ``.tmp-*`` build directories and
    an ``.old`` next to a present ``final`` are removed. Safe to call at any time no swap runs."""
    final = Path(final)
    old = _sibling(final, "old")
    if old.exists():
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)
    for tmp in final.parent.glob(f"{final.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def begin_directory(final: Path, *, replaceable: Callable[[str], bool] | None = None) -> Path:
    """Recover ``final`` (``recover_directory``) and create a fresh empty sibling to build its new
    contents in; finish with ``commit_directory`` or ``abort_directory``.

    The swap replaces ``final`` whole, so it is refused (``InvalidInput`` naming the path and the fix,
    before anything changes) when ``final`` is not a path, is an existing file (it would be moved
    aside), lies under one, or, given ``replaceable`` (a test of entry names), is a directory holding
    a subdirectory or a file ``replaceable`` does not accept (what the caller does not own is never
    deleted)."""
    final = as_path(final, "target directory")
    if final.name in ("", ".", ".."):
        raise InvalidInput(f"target directory {str(final)!r} has no name of its own; name a new directory")
    if final.exists() and not final.is_dir():
        raise InvalidInput(
            f"{final} is an existing file, not a directory: writing there would move it aside; choose a "
            "directory path (the file is left as it is)"
        )
    if replaceable is not None and final.is_dir():
        foreign = sorted(c.name for c in final.iterdir() if c.is_dir() or not replaceable(c.name))
        if foreign:
            raise InvalidInput(
                f"{final} holds {foreign[:5]}, which this write does not own and would delete when it "
                "replaces the directory; choose an empty or new directory, or move them away"
            )
    writable_directory(final.parent, f"target directory {final}")
    recover_directory(final)
    tmp = _sibling(final, f"tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    return tmp


def commit_directory(tmp: Path, final: Path) -> None:
    """fsync ``tmp`` and swap it in place of ``final``: rename ``final`` -> ``final.old``, rename
    ``tmp`` -> ``final``, delete ``.old``. A crash between the renames leaves ``.old`` complete and
    ``recover_directory(final)`` (run by the next ``begin_directory``) renames it back."""
    fsync_tree(tmp)
    old = _sibling(final, "old")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def abort_directory(tmp: Path) -> None:
    """Delete a build directory of ``begin_directory`` (the target is left as it was)."""
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(final: Path, *, replaceable: Callable[[str], bool] | None = None) -> Iterator[Path]:
    """``begin_directory`` / ``commit_directory`` around a block: yields a fresh empty sibling of
    ``final`` that replaces ``final`` when the block completes; an exception in the block deletes it
    and leaves ``final`` as it was. ``replaceable``: see ``begin_directory``."""
    tmp = begin_directory(final, replaceable=replaceable)
    try:
        yield tmp
    except BaseException:
        abort_directory(tmp)
        raise
    commit_directory(tmp, Path(final))


# ------------------------------------------------------------------------------- safetensors


SAFETENSORS_DTYPES: dict[str, torch.dtype] = {  # the safetensors dtype names underlay reads and writes
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors directory, from its validated header: the file, shape, dtype and
    where its bytes lie in the file (``offset``: absolute byte position, ``nbytes``: length)."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def _header(path: Path) -> dict[str, SafetensorsEntry]:
    """Parse and validate one safetensors header: JSON within the file, every tensor's byte range
    matching its dtype and shape and lying inside the file (a truncated file fails here)."""
    try:
        size = path.stat().st_size
        with open(path, "rb", buffering=0) as fh:  # unbuffered: read the header, not 8 KiB of data
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header (truncated)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: header of {n} bytes exceeds the file ({size} bytes): truncated"
                )
            meta = json.loads(fh.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    out: dict[str, SafetensorsEntry] = {}
    end_max = 0
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({exc})") from exc
        numel = 1
        for d in shape:
            numel *= d
        if end - start != numel * dtype.itemsize or start < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {end - start} bytes, {shape} {dtype} needs {numel * dtype.itemsize}"
            )
        end_max = max(end_max, end)
        out[name] = SafetensorsEntry(path, shape, dtype, 8 + n + start, end - start)
    if 8 + n + end_max > size:
        raise CheckpointError(
            f"{path}: {size} bytes, its header describes {8 + n + end_max}: the file is truncated"
        )
    return out


def safetensors_files(directory: Path) -> dict[Path, frozenset[str] | None]:
    """The safetensors files of a Hugging Face directory, each with the tensor names
    ``model.safetensors.index.json`` assigns to it (``None`` without an index), sorted by path. Reads
    the index only, no file header. With an index: exactly the files its ``weight_map`` names, all
    present, and no other ``*.safetensors`` file (a stale shard of an earlier export is refused).
    Without one: every ``*.safetensors`` file. Raises ``CheckpointError`` naming the cause."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; give a local HF model directory")
    present = sorted(p.name for p in directory.glob("*.safetensors"))
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        if not present:
            raise CheckpointError(
                f"no *.safetensors in {directory}; convert the weights to safetensors first"
            )
        return {directory / f: None for f in present}
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        assert isinstance(weight_map, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        raise CheckpointError(f"{index_path}: unreadable index ({exc})") from exc
    by_file: dict[str, set[str]] = {}
    for name, fname in weight_map.items():
        by_file.setdefault(str(fname), set()).add(str(name))
    stale = sorted(set(present) - set(by_file))
    if stale:
        raise CheckpointError(
            f"{directory}: {stale[:5]} are not in {INDEX_FILE} (left over from another export?); "
            "remove them or re-export into an empty directory"
        )
    out: dict[Path, frozenset[str] | None] = {}
    for fname, names in sorted(by_file.items()):
        f = directory / fname
        if not f.is_file():
            raise CheckpointError(f"{f}: named by {INDEX_FILE} but missing")
        out[f] = frozenset(names)
    return out


def read_safetensors_header(path: Path, names: frozenset[str] | None = None) -> dict[str, SafetensorsEntry]:
    """The validated header of one safetensors file (``_header``: every byte range inside the file,
    so a truncated file is refused); with ``names`` (from ``safetensors_files``) the file must hold
    exactly those tensors. ``CheckpointError`` naming the file and the cause."""
    header = _header(Path(path))
    if names is not None and set(header) != names:
        extra = sorted(set(header) - names)[:3]
        lost = sorted(names - set(header))[:3]
        raise CheckpointError(
            f"{path}: disagrees with {INDEX_FILE} (in the file only: {extra}, in the index only: "
            f"{lost}); the directory mixes two exports"
        )
    return header


def merge_safetensors_headers(
    directory: Path, headers: Iterable[Mapping[str, SafetensorsEntry]]
) -> dict[str, SafetensorsEntry]:
    """One name -> entry map from the headers of a directory's files (in file order).
    ``CheckpointError`` when a name is in two files (two exports mixed; with an index this cannot
    pass ``read_safetensors_header``)."""
    where: dict[str, SafetensorsEntry] = {}
    for header in headers:
        for name, entry in header.items():
            if name in where:
                raise CheckpointError(
                    f"{directory}: tensor {name!r} is in both {where[name].file.name} and "
                    f"{entry.file.name} (two exports mixed, and no {INDEX_FILE} says which is current)"
                )
            where[name] = entry
    return where


def read_safetensors_dir(directory: Path) -> dict[str, SafetensorsEntry]:
    """Every tensor of a Hugging Face safetensors directory, validated before anything is loaded:
    ``safetensors_files`` (the index followed and checked), then every file's header
    (``read_safetensors_header``), then ``merge_safetensors_headers``. Raises ``CheckpointError``
    naming the file and the cause."""
    files = safetensors_files(directory)
    return merge_safetensors_headers(
        directory, [read_safetensors_header(f, names) for f, names in files.items()]
    )


def read_entries(reads: Sequence[tuple[SafetensorsEntry, torch.Tensor]]) -> int:
    """Read the bytes of each entry straight into its destination, a contiguous 1-D ``uint8`` cpu
    tensor of exactly ``entry.nbytes`` elements, with plain ``read`` system calls (unbuffered, no
    memory map, no intermediate copy); each file is opened once, entries are read in the given order.
    Returns the bytes read. ``CheckpointError`` naming the file for an I/O error or a file shorter
    than its header said (it changed after validation)."""
    total = 0
    handle: IO[bytes] | None = None
    current: Path | None = None
    try:
        for entry, out in reads:
            if out.dtype != torch.uint8 or out.device.type != "cpu" or out.numel() != entry.nbytes:
                raise CheckpointError(
                    f"read_entries: destination of {entry.file} @ {entry.offset} must be {entry.nbytes} "
                    f"uint8 bytes on the cpu, got {out.numel()} {out.dtype} on {out.device}"
                )
            if entry.file != current:
                if handle is not None:
                    handle.close()
                current = entry.file
                handle = open(entry.file, "rb", buffering=0)  # noqa: SIM115 (closed below)
            assert handle is not None
            view = out.numpy().data.cast("B")
            handle.seek(entry.offset)
            done = 0
            while done < entry.nbytes:
                got = handle.readinto(view[done:])  # type: ignore[attr-defined]
                if not got:
                    raise CheckpointError(
                        f"{entry.file}: ended {entry.nbytes - done} bytes early at offset "
                        f"{entry.offset + done} (the file changed after its header was validated)"
                    )
                done += got
            total += done
    except OSError as exc:
        raise CheckpointError(f"{current}: reading failed ({type(exc).__name__}: {exc})") from exc
    finally:
        if handle is not None:
            handle.close()
    return total


def iter_safetensors(
    entries: Mapping[str, SafetensorsEntry], wanted: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the tensors of ``entries`` that ``wanted`` accepts, one at a time, file by file.
    Read errors raise ``CheckpointError`` naming the file."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, entry in entries.items():
        if wanted(name):
            by_file.setdefault(entry.file, []).append(name)
    for f, names in sorted(by_file.items()):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for name in names:
                    yield name, handle.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{f}: reading failed ({type(exc).__name__}: {exc})") from exc
