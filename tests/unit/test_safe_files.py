"""utils.safe_files / utils.safe_dcp / parallel.agree without an engine: the restricted unpickler on
a real torch.distributed.checkpoint ``.metadata`` and on a tampered one, the manifest, the atomic
directory swap and its crash recovery, and the safetensors directory validation."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from underlay.interfaces import CheckpointError
from underlay.utils.safe_files import (
    MANIFEST_FILE,
    atomic_directory,
    read_safetensors_dir,
    recover_directory,
    restricted_load,
    verify_manifest,
    write_manifest,
)


class _Payload:
    """Unpickling this creates the file ``target``: what a malicious ``.metadata`` would do."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.target, "w"))


def _dcp_checkpoint(path: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with pytest.warns(
        UserWarning, match="single process"
    ):  # no process group: torch says it saves in one process
        dcp.save(state, checkpoint_id=str(path))
    return state


def test_restricted_unpickler_reads_real_dcp_metadata_and_refuses_code(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    ck = tmp_path / "ck"
    _dcp_checkpoint(ck)
    with open(ck / ".metadata", "rb") as fh:
        meta = restricted_load(fh, source=str(ck / ".metadata"))
    assert isinstance(meta, Metadata) and "model.weight" in meta.state_dict_metadata

    victim = tmp_path / "pwned"
    blob = pickle.dumps(_Payload(str(victim)))
    with pytest.raises(CheckpointError, match=r"tampered\.bin: refuses to unpickle .*open"):
        restricted_load(io.BytesIO(blob), source="tampered.bin")
    assert not victim.exists()
    with pytest.raises(CheckpointError, match="not a readable pickle"):
        restricted_load(io.BytesIO(b"\x80\x04garbage"), source="x")


def test_safe_dcp_load_reads_real_checkpoints_and_refuses_tampered_metadata(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from underlay.utils.safe_dcp import safe_dcp_load

    ck = tmp_path / "ck"
    saved = _dcp_checkpoint(ck)
    fresh = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}}
    with pytest.warns(UserWarning, match="single process"):
        safe_dcp_load(fresh, ck)
    assert all(torch.equal(fresh["model"][k], v) for k, v in saved["model"].items())

    # a real tampered .metadata: the genuine Metadata with a payload riding in its storage_meta
    victim = tmp_path / "pwned"
    meta = FileSystemReader(str(ck)).read_metadata()
    meta.storage_meta.modules = [_Payload(str(victim))]  # type: ignore[union-attr, list-item]
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match=r"ck/\.metadata: refuses to unpickle \S*open"):
        safe_dcp_load({"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}}, ck)
    assert not victim.exists()


def test_manifest_detects_truncation_flips_missing_and_extra_files(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(os.urandom(1000))
    (d / "sub" / "b.bin").write_bytes(os.urandom(10))
    write_manifest(d)
    verify_manifest(d)
    assert json.loads((d / MANIFEST_FILE).read_text())["files"]["sub/b.bin"]["size"] == 10

    data = bytearray((d / "a.bin").read_bytes())
    data[500] ^= 0x01
    (d / "a.bin").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"a\.bin: blake2b digest differs"):
        verify_manifest(d)
    verify_manifest(d, check_hash=False)  # sizes only: a flip of the same size passes, by contract
    (d / "a.bin").write_bytes(bytes(data[:999]))
    with pytest.raises(CheckpointError, match=r"a\.bin: 999 bytes, the manifest recorded 1000"):
        verify_manifest(d, check_hash=False)  # sizes are never skipped
    (d / "a.bin").unlink()
    with pytest.raises(CheckpointError, match=r"a\.bin: listed in the manifest but missing"):
        verify_manifest(d)
    write_manifest(d)
    (d / "stray.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="stray.bin"):
        verify_manifest(d)


def test_atomic_directory_replaces_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "export"
    with atomic_directory(final) as d:
        (d / "model-00001-of-00002.safetensors").write_text("old1")
        (d / "model-00002-of-00002.safetensors").write_text("old2")
    with atomic_directory(final) as d:
        (d / "model.safetensors").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["model.safetensors"]  # nothing stale left

    def dies_midway() -> None:
        with atomic_directory(final) as d:
            (d / "half").write_text("x")
            raise RuntimeError("writer died")

    with pytest.raises(RuntimeError, match="writer died"):
        dies_midway()
    assert sorted(p.name for p in final.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    # a crash between the two renames: final moved to .old, the new copy never renamed in
    real_replace = os.replace
    calls: list[str] = []

    def dying_replace(src: Any, dst: Any) -> None:
        calls.append(str(dst))
        if len(calls) == 2:
            raise OSError("killed between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dying_replace)
    with pytest.raises(OSError, match="killed"), atomic_directory(final) as d:
        (d / "model.safetensors").write_text("newer")
    monkeypatch.setattr(os, "replace", real_replace)
    assert not final.exists() and (tmp_path / "export.old").is_dir()
    recover_directory(final)
    assert (final / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def test_safetensors_dir_follows_the_index_and_refuses_disagreement(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    _save(d / "model-00001-of-00002.safetensors", {"a": torch.randn(2, 3)})
    _save(
        d / "model-00002-of-00002.safetensors", {"b": torch.randn(4), "c": torch.ones(1, dtype=torch.int64)}
    )
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                            "c": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    entries = read_safetensors_dir(d)
    assert {k: (v.shape, v.dtype) for k, v in entries.items()} == {
        "a": ((2, 3), torch.float32), "b": ((4,), torch.float32), "c": ((1,), torch.int64)
    }  # fmt: skip

    _save(d / "model.safetensors", {"a": torch.randn(2, 3)})  # a stale single-file export next to it
    with pytest.raises(
        CheckpointError, match=r"\['model.safetensors'\] are not in model.safetensors.index.json"
    ):
        read_safetensors_dir(d)
    (d / "model.safetensors").unlink()
    index["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="disagrees with model.safetensors.index.json"):
        read_safetensors_dir(d)

    (d / "model.safetensors.index.json").unlink()
    _save(d / "model-00002-of-00002.safetensors", {"a": torch.randn(2, 3)})
    with pytest.raises(CheckpointError, match="'a' is in both"):
        read_safetensors_dir(d)


def test_truncated_safetensors_file_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    _save(d / "model.safetensors", {"w": torch.randn(64, 64)})
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors_dir(d)
    (d / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors_dir(d)


def test_safe_planner_refuses_code_in_byte_entries(tmp_path: Path) -> None:
    """Non-tensor entries (optimizer param groups, ...) are pickles too: torch's default planner runs
    them with weights_only=False; underlay's refuses anything but plain data."""
    import torch.distributed.checkpoint as dcp

    from underlay.utils.safe_dcp import safe_dcp_load

    ck = tmp_path / "ck"
    victim = tmp_path / "pwned"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.ones(2), "extra": _Payload(str(victim))}, checkpoint_id=str(ck))
    assert not victim.exists()
    with (
        pytest.raises(CheckpointError, match="checkpoint entry 'extra': refused"),
        pytest.warns(UserWarning, match="single process"),
    ):
        safe_dcp_load({"w": torch.zeros(2), "extra": 0}, ck)
    assert not victim.exists()
    # the payload is real: torch's own loader runs it
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"w": torch.zeros(2), "extra": 0}, checkpoint_id=str(ck))
    assert victim.exists()
