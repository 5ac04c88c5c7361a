"""Parallel ``load_hf`` and concurrent ``export_hf`` of the fsdp2 weight loader on real gloo groups.

Reads are measured by the kernel (``rchar`` of ``/proc/self/io``: bytes this process got from
``read``-family system calls; gloo's socket traffic is not counted there), so "each rank reads about
1/N of the bytes" is checked on the real file layer, not on a counter the loader keeps itself.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _config() -> Any:
    """4 layers, hidden 64: 39 tensors, about 0.66 MB in fp32, the largest 32 KiB (the embeddings)."""
    return H.llama_config(hidden_size=64, intermediate_size=128, num_hidden_layers=4)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _files(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _state(loader: Any, engine: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in loader.iter_hf_tensors(engine)}


def _tensor_bytes(d: Path) -> int:
    return sum(t.numel() * t.element_size() for t in _files(d).values())


def _job_load(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from underlay import registry
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader
    from underlay.interfaces import CheckpointError

    base = Path(root)
    multi, single, bad = base / "multi", base / "single", base / "bad"
    cfg = _config()
    if rank == 0:
        ref = H.reference_model(copy.deepcopy(cfg), 3).float()
        ref.save_pretrained(str(multi), max_shard_size="100KB")
        ref.save_pretrained(str(single))
        ref.save_pretrained(str(bad), max_shard_size="100KB")
    dist.barrier()
    registry.reset()
    engine = registry.get_engine(H.engine_config(copy.deepcopy(cfg), seed=11))
    out: dict[str, Any] = {"rank": rank}
    for label, d in (("multi", multi), ("single", single)):
        for bucket in (1, 256 << 20):  # one parameter per rank per round, and one round for all
            loader = FSDP2WeightLoader(load_bucket_bytes=bucket)
            loader.load_hf(engine, d)  # warm-up: imports and page cache, so rchar counts this call's reads
            engine_reset = registry.get_engine(H.engine_config(copy.deepcopy(cfg), seed=11))
            dist.barrier()
            before = _rchar()
            report = loader.load_hf(engine_reset, d)
            read = _rchar() - before
            disk = _files(d)
            state = _state(loader, engine_reset)
            out[f"{label}_{bucket}"] = {
                "bytes_read": report.bytes_read,
                "rchar": read,
                "loaded": report.loaded,
                "equal": H.max_diff(state, disk) if state.keys() == disk.keys() else float("inf"),
            }
    out["files"] = len(list(multi.glob("*.safetensors")))
    out["total"] = _tensor_bytes(multi)
    out["names"] = sorted(_files(multi))
    # what a rank may read besides tensor bytes: the index, the headers, and /proc/self/io itself
    out["overhead"] = (
        4096
        + sum((multi / f).stat().st_size for f in ("model.safetensors.index.json",) if (multi / f).is_file())
        + sum(8 + int.from_bytes((f.read_bytes()[:8]), "little") for f in multi.glob("*.safetensors"))
    )
    # a file whose header only rank 1 validates is truncated: every rank refuses, nothing changes
    files = sorted(bad.glob("*.safetensors"))
    victim = files[1]
    dist.barrier()
    if rank == 0:
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) - 1000])
    dist.barrier()
    before_state = _state(FSDP2WeightLoader(), engine)
    try:
        FSDP2WeightLoader().load_hf(engine, bad)
        out["bad"] = "loaded"
    except CheckpointError as exc:
        out["bad"] = str(exc)
    out["bad_victim"] = victim.name
    out["bad_unchanged"] = H.max_diff(_state(FSDP2WeightLoader(), engine), before_state)
    dist.barrier()
    return out


def test_parallel_load_reads_each_byte_once_and_equals_the_files(tmp_path: Path) -> None:
    results = run_distributed(_job_load, 2, str(tmp_path))
    total = results[0]["total"]
    assert results[0]["files"] >= 4, results[0]["files"]
    largest = 128 * 64 * 4  # the embedding (and lm_head) bytes: the granularity of a cut
    for key in ("multi_1", "multi_268435456", "single_1", "single_268435456"):
        per_rank = [r[key] for r in results]
        # every tensor byte read exactly once over the ranks, each rank about half of them
        assert sum(p["bytes_read"] for p in per_rank) == total, (key, per_rank)
        for p in per_rank:
            assert abs(p["bytes_read"] - total / 2) <= largest, (key, per_rank, total)
            # the kernel saw this rank read its tensor bytes plus headers and the index, no more
            assert p["bytes_read"] <= p["rchar"] <= p["bytes_read"] + results[0]["overhead"], (key, p)
            assert p["equal"] == 0.0 and p["loaded"] == len(results[0]["names"]), (key, p)
    for r in results:
        assert r["bad"].startswith(f"load_hf({tmp_path / 'bad'}) failed on rank 1"), r["bad"]
        assert r["bad_victim"] in r["bad"] and "truncated" in r["bad"], r["bad"]
        assert r["bad_unchanged"] == 0.0


def _job_export(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from underlay import registry
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader

    registry.reset()
    engine = registry.get_engine(H.engine_config(_config(), seed=5))
    out: dict[str, Any] = {}
    for label, buffer in (("sequential", 0), ("one_tensor", 1), ("default", 1 << 30)):
        for dtype in (torch.float32, torch.bfloat16):
            d = Path(root) / f"{label}_{dtype}".replace("torch.", "")
            loader = FSDP2WeightLoader(export_buffer_bytes=buffer)
            loader.export_hf(engine, d, dtype=dtype, max_shard_bytes=100 << 10)
            dist.barrier()
            if rank == 0:
                out[d.name] = {
                    p.name: hashlib.blake2b(p.read_bytes()).hexdigest()  # results travel through a pipe
                    for p in sorted(d.iterdir())
                    if p.suffix in (".safetensors", ".json")
                }
    if rank == 0:
        state = _state(FSDP2WeightLoader(), engine)
        written = _files(Path(root) / "default_bfloat16")
        out["values"] = max(
            float((written[n].float() - state[n].bfloat16().float()).abs().max()) for n in state
        )
        out["names"] = sorted(written) == sorted(state)
        index = json.loads((Path(root) / "default_float32" / "model.safetensors.index.json").read_text())
        out["total_size"] = index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    else:
        _state(FSDP2WeightLoader(), engine)
    return out


def test_concurrent_export_is_bit_equal_to_sequential(tmp_path: Path) -> None:
    out = run_distributed(_job_export, 2, str(tmp_path))[0]
    for dtype in ("float32", "bfloat16"):
        seq = out[f"sequential_{dtype}"]
        assert sum(n.endswith(".safetensors") for n in seq) >= 4, sorted(seq)
        for label in ("one_tensor", "default"):
            assert out[f"{label}_{dtype}"] == seq, (label, dtype)
    assert out["names"] and out["values"] == 0.0 and out["total_size"]
