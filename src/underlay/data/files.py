"""Files from anywhere, safely: local paths and ``fsspec`` URLs copied into a local cache.

Guarantees of :func:`copy_to_local`:

- atomic: a file or directory is assembled under a temporary name in the cache and renamed into place;
  it counts as present only once its ``<name>.complete`` record exists (written last, atomically), so
  a download killed midway is never taken for a complete one and is redone on the next call;
- one download per host: ranks on one host serialise on a file lock (``filelock``) next to the entry;
- verified: every file's size is compared with the store's; when the store reports an MD5
  (``md5``/``ETag`` of a single-part object, GCS ``md5Hash``) the content is hashed and compared too;
- contained: remote names or archive members that would land outside the target (``..``, absolute
  paths, links pointing out) raise ``InvalidInput`` before anything is written.

:func:`upload_dir` / :func:`download_dir` move a directory (a checkpoint, an HF export) to and from a
URL with the same rule: the remote copy is complete only once its manifest ``underlay-manifest.json``
(relative path -> size) exists, and it is uploaded last.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tarfile
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from underlay.interfaces import BackendUnavailable, InvalidInput, UnderlayError
from underlay.utils import env

__all__ = [
    "MANIFEST",
    "cache_root",
    "copy_to_local",
    "download_dir",
    "extract_archive",
    "get_filesystem",
    "is_remote",
    "upload_dir",
]

MANIFEST = "underlay-manifest.json"
"""Written last by :func:`upload_dir`; a remote directory without it is incomplete."""

_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "abfs": "adlfs",
    "az": "adlfs",
    "hdfs": "pyarrow",
}


def is_remote(path_or_uri: str | Path) -> bool:
    """True for ``scheme://...`` other than ``file://``."""
    s = str(path_or_uri)
    return "://" in s and not s.startswith("file://")


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$UNDERLAY_CACHE``, else ``~/.cache/underlay/files`` (``~`` expanded)."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(env.get("UNDERLAY_CACHE")).expanduser()


def get_filesystem(uri: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for ``uri``. Raises ``BackendUnavailable`` naming the
    package to install when the scheme's implementation is missing (``s3://`` needs ``s3fs``,
    ``hdfs://`` needs ``pyarrow`` with libhdfs) and ``InvalidInput`` for an unknown scheme."""
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - fsspec comes with torch
        raise BackendUnavailable(
            "filesystem", "fsspec", "fsspec is not installed", [], "pip install fsspec"
        ) from exc
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except ImportError as exc:
        pkg = _PACKAGES.get(scheme, f"the fsspec implementation of {scheme!r}")
        loaded = sorted({"file", "memory", *fsspec.registry})
        raise BackendUnavailable(
            "filesystem",
            scheme,
            f"{uri} needs {pkg}, which is not importable ({exc})",
            loaded,
            f"pip install {pkg}",
        ) from exc
    except ValueError as exc:
        raise InvalidInput(f"{uri}: unknown filesystem scheme {scheme!r} ({exc})") from exc
    except OSError as exc:  # e.g. hdfs:// with pyarrow but no libhdfs / JVM on this host
        pkg = _PACKAGES.get(scheme, scheme)
        raise BackendUnavailable(
            "filesystem", scheme, f"{uri}: connecting failed ({exc})", [], f"check the {pkg} client setup"
        ) from exc
    return fs, str(path)


def _safe_join(root: Path, rel: str, what: str) -> Path:
    """``root / rel`` after refusing absolute, drive-qualified or ``..`` components."""
    p = PurePosixPath(rel.replace("\\", "/"))
    if p.is_absolute() or ".." in p.parts or (p.parts and ":" in p.parts[0]) or rel == "":
        raise InvalidInput(f"{what}: {rel!r} would be written outside {root}; refusing it")
    return root.joinpath(*p.parts)


def _store_md5(info: dict[str, Any]) -> str | None:
    """The hex MD5 a store reports for an object, when it reports one."""
    if isinstance(info.get("md5"), str):
        return str(info["md5"]).lower()
    if isinstance(info.get("md5Hash"), str):  # gcs: base64
        return base64.b64decode(info["md5Hash"]).hex()
    etag = info.get("ETag") or info.get("etag")
    if isinstance(etag, str):
        e = etag.strip('"').lower()
        if len(e) == 32 and "-" not in e:  # single-part S3 upload: the ETag is the MD5
            return e
    return None


def _md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _remote_files(fs: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(relative posix path, info)`` of every file under directory ``path``."""
    base = path.rstrip("/")
    for full, info in sorted(fs.find(base, detail=True).items()):
        if info.get("type") == "directory":
            continue
        rel = full[len(base) :].lstrip("/") if full.startswith(base) else full
        yield rel, info


def _fetch_file(fs: Any, src: str, dst: Path, info: dict[str, Any]) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with fs.open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
        fout.flush()
        os.fsync(fout.fileno())
    size = info.get("size")
    if size is not None and dst.stat().st_size != int(size):
        raise UnderlayError(f"{src}: downloaded {dst.stat().st_size} bytes, the store reports {size}; retry")
    md5 = _store_md5(info)
    if md5 is not None and _md5(dst) != md5:
        raise UnderlayError(f"{src}: MD5 of the downloaded copy differs from the store's ({md5}); retry")


def _atomic_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _entry_name(uri: str) -> str:
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    tail = PurePosixPath(uri.split("://", 1)[-1].rstrip("/")).name or "root"
    return f"{digest}-{tail}"


def copy_to_local(uri: str, cache_dir: str | Path | None = None, *, extract: bool = False) -> Path:
    """A local path holding ``uri`` (a file or a directory).

    Local paths (and ``file://``) are returned as they are (``InvalidInput`` when missing). Remote
    URLs are copied once into :func:`cache_root` under a name derived from the URL; later calls (and
    other ranks on the host, which wait on the lock) reuse the complete copy. With ``extract=True`` a
    ``.tar``/``.tar.gz``/``.tgz``/``.zip`` file is unpacked (members escaping the target refused) and
    the directory returned. Raises ``BackendUnavailable`` for a missing filesystem package,
    ``InvalidInput`` for a missing object or unsafe names, ``UnderlayError`` for a size/checksum
    mismatch (nothing is marked complete then).
    """
    s = str(uri)
    if not is_remote(s):
        local = Path(s.removeprefix("file://"))
        if not local.exists():
            raise InvalidInput(f"copy_to_local: {s} does not exist")
        if extract and local.is_file():
            return _extract_cached(local, cache_root(cache_dir), _entry_name(str(local.resolve())))
        return local
    from filelock import FileLock

    fs, path = get_filesystem(s)
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = _entry_name(s)
    final, marker = root / name, root / f"{name}.complete"
    with FileLock(str(root / f"{name}.lock")):
        if marker.is_file() and final.exists():
            return _extract_cached(final, root, name) if extract and final.is_file() else final
        if not fs.exists(path):
            raise InvalidInput(f"copy_to_local: {s} does not exist")
        marker.unlink(missing_ok=True)
        tmp = root / f"{name}.{uuid.uuid4().hex}.partial"
        try:
            if fs.isdir(path):
                tmp.mkdir()
                for rel, info in _remote_files(fs, path):
                    _fetch_file(fs, f"{path.rstrip('/')}/{rel}", _safe_join(tmp, rel, s), info)
            else:
                _fetch_file(fs, path, tmp, fs.info(path))
            if final.is_dir():
                shutil.rmtree(final)
            elif final.exists():
                final.unlink()
            os.replace(tmp, final)
        finally:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            elif tmp.exists():
                tmp.unlink()
        _atomic_json(marker, {"uri": s})
    return _extract_cached(final, root, name) if extract and final.is_file() else final


def _extract_cached(archive: Path, root: Path, name: str) -> Path:
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    dest, marker = root / f"{name}.d", root / f"{name}.d.complete"
    with FileLock(str(root / f"{name}.d.lock")):
        if marker.is_file() and dest.is_dir():
            return dest
        tmp = root / f"{name}.{uuid.uuid4().hex}.partial.d"
        try:
            extract_archive(archive, tmp)
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _atomic_json(marker, {"archive": str(archive)})
    return dest


def extract_archive(archive: str | Path, dest: str | Path) -> Path:
    """Unpack a tar (any compression) or zip ``archive`` into ``dest``. Every member is checked
    before anything is written: absolute names, ``..`` components, and links or devices raise
    ``InvalidInput`` naming the member. Returns ``dest``."""
    src, out = Path(archive), Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    if zipfile.is_zipfile(src):
        with zipfile.ZipFile(src) as zf:
            infos = zf.infolist()
            for zi in infos:
                _safe_join(out, zi.filename.rstrip("/") or ".", f"{src} member")
            for zi in infos:
                target = _safe_join(out, zi.filename.rstrip("/"), f"{src} member")
                if zi.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(zi) as fin, open(target, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
        return out
    if not tarfile.is_tarfile(src):
        raise InvalidInput(f"{src} is neither a tar nor a zip archive")
    with tarfile.open(src) as tf:
        members = tf.getmembers()
        for m in members:
            _safe_join(out, m.name, f"{src} member")
            if not (m.isfile() or m.isdir()):
                raise InvalidInput(f"{src} member {m.name!r} is a link or device; refusing to extract it")
        for m in members:
            target = _safe_join(out, m.name, f"{src} member")
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            member = tf.extractfile(m)
            assert member is not None
            with member, open(target, "wb") as fout:
                shutil.copyfileobj(member, fout)
    return out


def upload_dir(local_dir: str | Path, uri: str, *, require_file: str | None = None) -> str:
    """Copy directory ``local_dir`` to ``uri`` (an fsspec URL or a local path). Files are written
    first, the manifest :data:`MANIFEST` (relative path -> size) last, so a reader that checks for it
    (:func:`download_dir`) never sees a partial upload as complete. An existing manifest at ``uri`` is
    removed before the first byte is written. ``require_file`` (e.g. a checkpoint's ``COMPLETE``
    marker) must exist locally or ``InvalidInput`` is raised before anything is uploaded. Returns
    ``uri``."""
    src = Path(local_dir)
    if not src.is_dir():
        raise InvalidInput(f"upload_dir: {src} is not a directory")
    if require_file is not None and not (src / require_file).is_file():
        raise InvalidInput(
            f"upload_dir: {src} has no {require_file}; it is not complete, refusing to upload it"
        )
    fs, base = get_filesystem(uri)
    base = base.rstrip("/")
    if fs.exists(f"{base}/{MANIFEST}"):
        fs.rm(f"{base}/{MANIFEST}")
    manifest: dict[str, int] = {}
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = path.relative_to(src).as_posix()
        if rel == MANIFEST:
            continue
        fs.makedirs(f"{base}/{PurePosixPath(rel).parent}".rstrip("/."), exist_ok=True)
        fs.put_file(str(path), f"{base}/{rel}")
        manifest[rel] = path.stat().st_size
    with fs.open(f"{base}/{MANIFEST}", "w") as fh:
        fh.write(json.dumps({"files": manifest}, sort_keys=True))
    return uri


def download_dir(uri: str, local_dir: str | Path) -> Path:
    """Restore a directory written by :func:`upload_dir` into ``local_dir`` (which must not exist).
    Raises ``InvalidInput`` when ``uri`` has no manifest (an incomplete or foreign upload) or names a
    path outside ``local_dir``; ``UnderlayError`` when a file is missing or its size differs. The copy
    is assembled under a temporary sibling and renamed, so ``local_dir`` appears only complete."""
    dest = Path(local_dir)
    if dest.exists():
        raise InvalidInput(f"download_dir: {dest} exists; choose a new directory")
    fs, base = get_filesystem(uri)
    base = base.rstrip("/")
    if not fs.exists(f"{base}/{MANIFEST}"):
        raise InvalidInput(f"download_dir: {uri} has no {MANIFEST}; the upload did not finish or is not ours")
    with fs.open(f"{base}/{MANIFEST}", "r") as fh:
        files: dict[str, int] = json.loads(fh.read())["files"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{uuid.uuid4().hex}.partial")
    try:
        for rel, size in files.items():
            target = _safe_join(tmp, rel, uri)
            if not fs.exists(f"{base}/{rel}"):
                raise UnderlayError(f"download_dir: {uri}/{rel} is listed in the manifest but missing")
            info = dict(fs.info(f"{base}/{rel}"))
            info["size"] = size
            _fetch_file(fs, f"{base}/{rel}", target, info)
        tmp.mkdir(exist_ok=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
