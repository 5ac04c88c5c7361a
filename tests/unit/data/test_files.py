"""underlay.data.files with fsspec's local and in-memory file systems."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import tarfile
import threading
import zipfile
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from underlay.data import files
from underlay.data.files import MANIFEST, copy_to_local, download_dir, extract_archive, upload_dir
from underlay.interfaces import BackendUnavailable, InvalidInput, UnderlayError


class _CountingMemory(MemoryFileSystem):
    """The memory file system under another protocol, counting opened reads and reporting an MD5
    (as object stores do) that a test can corrupt."""

    protocol = "h4count"
    opens = 0
    bad_md5 = False
    lie_size = False

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return str(MemoryFileSystem._strip_protocol(path.replace("h4count://", "memory://", 1)))

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        if "r" in mode:
            type(self).opens += 1
        return super()._open(path, mode, **kw)

    def info(self, path: str, **kw: Any) -> dict[str, Any]:
        out = dict(super().info(path, **kw))
        if out.get("type") == "file":
            with super()._open(path, "rb") as fh:
                data = fh.read()
            out["md5"] = "0" * 32 if self.bad_md5 else hashlib.md5(data).hexdigest()
            if self.lie_size:
                out["size"] = len(data) + 1
        return out


fsspec.register_implementation("h4count", _CountingMemory, clobber=True)


@pytest.fixture
def mem() -> Any:
    fs = fsspec.filesystem("memory")
    yield fs
    for p in fs.ls("/", detail=False):
        fs.rm(p, recursive=True)
    _CountingMemory.opens, _CountingMemory.bad_md5, _CountingMemory.lie_size = 0, False, False


def test_local_paths_pass_through(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("x")
    assert copy_to_local(str(f)) == f and copy_to_local(f"file://{f}") == f
    with pytest.raises(InvalidInput, match="does not exist"):
        copy_to_local(str(tmp_path / "nope"))


def test_copy_file_and_dir_once_per_host(mem: Any, tmp_path: Path) -> None:
    mem.pipe({"/d/x/a.bin": b"a" * 1000, "/d/x/sub/b.txt": b"bee", "/d/file.json": b"{}"})
    cache = tmp_path / "cache"
    got: list[Path] = []

    def work() -> None:
        got.append(copy_to_local("h4count://d/x", cache_dir=cache))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and _CountingMemory.opens == 2  # two files, downloaded once in all
    d = got[0]
    assert (d / "a.bin").read_bytes() == b"a" * 1000 and (d / "sub" / "b.txt").read_text() == "bee"
    one = copy_to_local("memory://d/file.json", cache_dir=cache)
    assert one.read_text() == "{}" and one.parent == cache
    assert not list(cache.glob("*.partial*"))


def test_killed_download_is_never_complete(mem: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mem.pipe({"/k/big.bin": b"z" * 5000})
    cache = tmp_path / "cache"
    real = files._fetch_file

    def dies_midway(fs: Any, src: str, dst: Path, info: dict[str, Any]) -> None:
        dst.write_bytes(b"z" * 100)  # part of the bytes, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(files, "_fetch_file", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        copy_to_local("memory://k/big.bin", cache_dir=cache)
    assert not list(cache.glob("*.complete")) and not [p for p in cache.iterdir() if p.suffix == ".bin"]
    monkeypatch.setattr(files, "_fetch_file", real)
    # a final-looking entry without its completion record (killed between rename and record) is redone
    name = files._entry_name("memory://k/big.bin")
    (cache / name).write_bytes(b"z" * 10)
    assert copy_to_local("memory://k/big.bin", cache_dir=cache).read_bytes() == b"z" * 5000


def test_size_and_checksum_verified(mem: Any, tmp_path: Path) -> None:
    mem.pipe({"/v/f.bin": b"payload"})
    assert copy_to_local("h4count://v/f.bin", cache_dir=tmp_path / "ok").read_bytes() == b"payload"
    _CountingMemory.bad_md5 = True
    with pytest.raises(UnderlayError, match="MD5"):
        copy_to_local("h4count://v/f.bin", cache_dir=tmp_path / "md5")
    _CountingMemory.bad_md5, _CountingMemory.lie_size = False, True
    with pytest.raises(UnderlayError, match="the store reports 8"):
        copy_to_local("h4count://v/f.bin", cache_dir=tmp_path / "size")
    assert not list((tmp_path / "size").glob("*.complete")) and not list(
        (tmp_path / "md5").glob("*.complete")
    )


def test_missing_filesystem_package_is_named() -> None:
    with pytest.raises(BackendUnavailable, match="hdfs"):  # pyarrow's client needs libhdfs + a JVM
        copy_to_local("hdfs://namenode.invalid:8020/model")
    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed here")
    with pytest.raises(BackendUnavailable, match="s3fs"):
        copy_to_local("s3://bucket/model")


def _tar(path: Path, members: dict[str, bytes], link: str | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        if link is not None:
            ti = tarfile.TarInfo("link")
            ti.type, ti.linkname = tarfile.SYMTYPE, link
            tf.addfile(ti)
    return path


def test_archives_are_contained(mem: Any, tmp_path: Path) -> None:
    good = _tar(tmp_path / "good.tar.gz", {"m/config.json": b"{}", "m/w.bin": b"123"})
    mem.pipe({"/a/good.tar.gz": good.read_bytes()})
    out = copy_to_local("memory://a/good.tar.gz", cache_dir=tmp_path / "c", extract=True)
    assert (out / "m" / "w.bin").read_bytes() == b"123"
    for name, bad in (
        ("dots", _tar(tmp_path / "dots.tgz", {"ok": b"1", "../../evil": b"x"})),
        ("abs", _tar(tmp_path / "abs.tgz", {"/tmp/evil": b"x"})),
        ("link", _tar(tmp_path / "link.tgz", {"ok": b"1"}, link="/etc/passwd")),
    ):
        dest = tmp_path / f"x-{name}"
        with pytest.raises(InvalidInput, match="outside|link"):
            extract_archive(bad, dest)
        assert not list(dest.iterdir())  # checked before anything was written
    zpath = tmp_path / "z.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        zf.writestr("fine.txt", "1")
        zf.writestr("../escape.txt", "x")
    with pytest.raises(InvalidInput, match="outside"):
        extract_archive(zpath, tmp_path / "z")
    assert not (tmp_path / "escape.txt").exists()


def _checkpoint(root: Path) -> Path:
    (root / "model").mkdir(parents=True)
    (root / "model" / "shard0.pt").write_bytes(b"\x00" * 4096)
    (root / "trainer_state.json").write_text('{"step": 3}')
    (root / "COMPLETE").write_text("{}")
    return root


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_upload_and_restore_directories(mem: Any, tmp_path: Path, scheme: str) -> None:
    src = _checkpoint(tmp_path / "step_3")
    url = "memory://ckpts/step_3" if scheme == "memory" else f"file://{tmp_path / 'remote' / 'step_3'}"
    upload_dir(src, url, require_file="COMPLETE")
    back = download_dir(url, tmp_path / "restored" / "step_3")
    assert sorted(p.relative_to(back) for p in back.rglob("*")) == sorted(
        p.relative_to(src) for p in src.rglob("*")
    )
    assert (back / "model" / "shard0.pt").read_bytes() == b"\x00" * 4096
    fs, base = files.get_filesystem(url)
    # a remote file that changed size after the upload: refused, and no partial directory appears
    fs.pipe_file(f"{base}/model/shard0.pt", b"\x00" * 10)
    with pytest.raises(UnderlayError, match="the store reports 4096"):
        download_dir(url, tmp_path / "restored2")
    assert not (tmp_path / "restored2").exists()
    # an upload that did not finish (no manifest) is not taken for a checkpoint
    fs.rm(f"{base}/{MANIFEST}")
    with pytest.raises(InvalidInput, match="did not finish"):
        download_dir(url, tmp_path / "restored3")
    (src / "COMPLETE").unlink()
    with pytest.raises(InvalidInput, match="no COMPLETE"):
        upload_dir(src, url, require_file="COMPLETE")
