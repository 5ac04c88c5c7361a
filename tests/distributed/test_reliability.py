"""Issue 18 on the real FSDP2 engine (gloo): corrupt and tampered checkpoints leave the live state
unchanged and run no code, a failed step leaves no gradients, loss-function returns are checked
before backward, exports cannot go stale, load_hf validates everything first, and a rank-0 file
failure raises on every rank within seconds. One spawn per world size keeps it fast."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


class _Payload:
    """Unpickling this creates ``target``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.target, "w"))


def _state(engine: Any) -> list[torch.Tensor]:
    """Local shards of parameters and optimizer state, cloned, plus step and LR as tensors."""
    out = [H.local(p).detach().clone() for p in engine.model.parameters()]
    for st in engine.optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                out.append((v.to_local() if hasattr(v, "to_local") else v).detach().clone())
    out.append(torch.tensor([engine.global_step, engine.optimizer.param_groups[0]["lr"]]))
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _err(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def job_one(rank: int, world: int, root: str) -> dict[str, Any]:
    from safetensors.torch import save_file

    from underlay.checkpoint import CheckpointManager
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader
    from underlay.interfaces import ModelConfig, TokenBatch
    from underlay.registry import get_device
    from underlay.utils.safe_files import write_manifest

    dev = get_device("cpu")
    base = Path(root)
    out: dict[str, Any] = {}
    engine = FSDP2Engine(H.engine_config(H.llama_config()), dev)
    batch = H.global_batch(1)
    engine.forward_backward(batch, H.pg_loss)
    engine.optimizer_step()
    manager = CheckpointManager(base / "ckpt", engine)
    good = manager.save(1, {"step": 1})
    engine.forward_backward(H.global_batch(2), H.pg_loss)
    engine.optimizer_step()  # live state now differs from the checkpoint
    live = _state(engine)

    def corrupt(name: str, damage: Any, **kw: Any) -> str:
        copy = base / name / "step_1"
        shutil.copytree(good, copy)
        damage(copy)
        msg = _err(lambda: CheckpointManager(base / name, engine, **kw).load(copy))
        out[f"{name}_unchanged"] = _same(live, _state(engine))
        return msg

    shard = sorted(p.name for p in good.glob("*.distcp"))[0]

    def truncate(d: Path) -> None:
        data = (d / shard).read_bytes()
        (d / shard).write_bytes(data[: len(data) // 2])

    def flip(d: Path) -> None:
        data = bytearray((d / shard).read_bytes())
        data[len(data) // 2] ^= 0x10
        (d / shard).write_bytes(bytes(data))

    out["truncated"] = corrupt("truncated", truncate)
    out["flipped"] = corrupt("flipped", flip)
    out["missing"] = corrupt("missing", lambda d: (d / ".metadata").unlink())

    # a tampered .metadata whose manifest was rewritten to match: the unpickler is what refuses it
    victim = base / "pwned"

    def tamper(d: Path) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        meta = FileSystemReader(str(d)).read_metadata()
        meta.storage_meta.modules = [_Payload(str(victim))]
        (d / ".metadata").write_bytes(pickle.dumps(meta))
        write_manifest(d, skip=("COMPLETE",))

    out["tampered"] = corrupt("tampered", tamper)
    out["tampered_ran_code"] = victim.exists()

    # below the manifest (hash skipped, engine called directly): a truncated shard fails inside DCP,
    # after the fresh copies were partly filled, and the live state is still untouched
    direct = base / "direct"
    shutil.copytree(good, direct)
    truncate(direct)
    out["direct_truncated"] = _err(lambda: engine.load_checkpoint(direct))
    out["direct_unchanged"] = _same(live, _state(engine))
    out["good_load"] = manager.load(good)["step"]
    out["good_step"] = engine.global_step

    # a failed step leaves no gradients; the next step equals one on a fresh engine
    calls = {"n": 0}

    def dies_on_second(outputs: Any, b: Any, ctx: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("loss blew up")
        return H.pg_loss(outputs, b, ctx)

    out["plan"] = engine.forward_backward(batch, H.pg_loss).num_micro_batches
    engine.zero_grad()
    out["failed_step"] = _err(lambda: engine.forward_backward(batch, dies_on_second))
    out["failed_grads"] = sum(p.grad is not None for p in engine.model.parameters())
    fresh = FSDP2Engine(H.engine_config(H.llama_config()), dev)
    fresh.load_checkpoint(good)
    engine.load_checkpoint(good)
    engine.forward_backward(H.global_batch(2), dies_on_second)  # n=3,4,...: no failure now
    r1 = fresh.forward_backward(H.global_batch(2), H.pg_loss)
    out["after_failure_norm"] = (engine.optimizer_step().grad_norm, fresh.optimizer_step().grad_norm)
    del r1

    # loss-function returns are checked before backward
    bad_returns = {
        "python_float": lambda o, b, c: (1.0, {}),
        "no_graph": lambda o, b, c: (H.pg_loss(o, b, c)[0].detach(), {}),
        "vector_metric": lambda o, b, c: (H.pg_loss(o, b, c)[0], {"m": torch.ones(3)}),
        "metric_named_loss": lambda o, b, c: (H.pg_loss(o, b, c)[0], {"loss": 1.0}),
        "not_a_tuple": lambda o, b, c: H.pg_loss(o, b, c)[0],
        "two_parameters": lambda o, b: H.pg_loss(o, b, None),
    }
    for key, fn in bad_returns.items():
        out[f"ret_{key}"] = _err(lambda fn=fn: engine.forward_backward(batch, fn))
        out[f"ret_{key}_grads"] = sum(p.grad is not None for p in engine.model.parameters())

    # masks: padding in the loss mask, values other than 0/1, infinite temperature
    pad_loss = TokenBatch(
        batch.input_ids, batch.attention_mask, torch.ones_like(batch.loss_mask), batch.extras
    )
    two = TokenBatch(batch.input_ids, batch.attention_mask, batch.loss_mask * 2, batch.extras)
    out["mask_padding"] = _err(lambda: engine.forward_backward(pad_loss, H.pg_loss))
    out["mask_two"] = _err(lambda: engine.forward_backward(two, H.pg_loss))
    out["infer_inf"] = _err(lambda: engine.infer(batch, temperature=float("inf")))
    out["bucket_nan"] = _err(lambda: next(engine.iter_weights(float("nan"))))

    # exports: a second export with another sharding replaces the first whole
    loader = FSDP2WeightLoader()
    exp = base / "export"
    out["export_int"] = _err(lambda: loader.export_hf(engine, exp, dtype=torch.int32))
    out["export_frac"] = _err(lambda: loader.export_hf(engine, exp, max_shard_bytes=1.5))
    out["export_refused_wrote"] = exp.exists()
    loader.export_hf(engine, exp, max_shard_bytes=20_000)
    out["export1"] = sorted(p.name for p in exp.iterdir())
    loader.export_hf(engine, exp)
    out["export2"] = sorted(p.name for p in exp.iterdir())
    out["siblings"] = sorted(p.name for p in base.iterdir() if p.name.startswith("export"))

    # a directory that mixes two exports (no index) is refused before any parameter changes
    mixed = base / "mixed"
    loader.export_hf(engine, base / "first", max_shard_bytes=20_000)
    shutil.copytree(exp, mixed)
    for f in (base / "first").glob("model-*.safetensors"):
        shutil.copy(f, mixed / f.name)
    live = _state(engine)
    out["mixed"] = _err(lambda: loader.load_hf(engine, mixed))
    (mixed / "model.safetensors").unlink()  # now the first export's shards without their index
    shutil.copy(base / "first" / "model.safetensors.index.json", mixed)
    out["index_ok"] = loader.load_hf(engine, mixed).loaded
    shutil.copy(exp / "model.safetensors", mixed)  # stale single file next to an index
    out["stale_vs_index"] = _err(lambda: loader.load_hf(engine, mixed))

    # int data for a float parameter, and a truncated file: refused, nothing changed
    from safetensors import safe_open

    with safe_open(str(exp / "model.safetensors"), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    name = sorted(tensors)[-1]
    ints = dict(tensors)
    ints[name] = torch.ones_like(tensors[name], dtype=torch.int32)
    (base / "ints").mkdir()
    save_file(ints, str(base / "ints" / "model.safetensors"))
    out["int_into_float"] = _err(lambda: loader.load_hf(engine, base / "ints"))
    (base / "trunc").mkdir()
    data = (exp / "model.safetensors").read_bytes()
    (base / "trunc" / "model.safetensors").write_bytes(data[: len(data) - 64])
    out["truncated_hf"] = _err(lambda: loader.load_hf(engine, base / "trunc"))
    out["hf_unchanged"] = _same(live, _state(engine))

    # building a value engine and exporting it leave the caller's HF config as it was
    cfg = H.llama_config()
    before = cfg.to_dict()
    value = FSDP2Engine(H.engine_config(cfg, model=ModelConfig(hf_config=cfg, kind="value")), dev)
    loader.export_hf(value, base / "value")
    out["config_untouched"] = cfg.to_dict() == before
    out["value_arch"] = json.loads((base / "value" / "config.json").read_text())["architectures"]
    return out


def job_pair(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from underlay.checkpoint import CheckpointManager
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader
    from underlay.registry import get_device

    base = Path(root)
    engine = FSDP2Engine(H.engine_config(H.llama_config()), get_device("cpu"))
    blocker = base / "blocker"  # a file where rank 0 must create a directory: its write fails
    if rank == 0:
        blocker.write_text("not a directory")
    dist.barrier()
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    out["export"] = _err(lambda: FSDP2WeightLoader().export_hf(engine, blocker / "out"))
    out["export_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    out["save"] = _err(lambda: CheckpointManager(blocker / "ckpt", engine).save(1, {}))
    out["save_s"] = time.monotonic() - t0
    # a load that fails validation on rank 1 only: both ranks raise, no parameter changed on rank 0
    FSDP2WeightLoader().export_hf(engine, base / "exp")
    before = _state(engine)
    t0 = time.monotonic()
    where = base / "exp" if rank == 0 else base / "nowhere"
    out["load_hf"] = _err(lambda: FSDP2WeightLoader().load_hf(engine, where))
    out["load_hf_s"] = time.monotonic() - t0
    out["load_hf_unchanged"] = _same(before, _state(engine))
    # the ranks are still in step: a collective after the failures completes
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["after"] = float(t.item())
    return out


def test_reliability_single_rank(tmp_path: Path) -> None:
    r = run_distributed(job_one, 1, str(tmp_path), timeout_s=240)[0]
    assert "CheckpointError" in r["truncated"] and ".distcp" in r["truncated"] and "bytes" in r["truncated"]
    assert "CheckpointError" in r["flipped"] and "blake2b digest differs" in r["flipped"]
    assert (
        "CheckpointError" in r["missing"] and ".metadata: listed in the manifest but missing" in r["missing"]
    )
    assert "CheckpointError" in r["tampered"] and ".metadata: refuses to unpickle" in r["tampered"]
    assert not r["tampered_ran_code"]
    assert "CheckpointError" in r["direct_truncated"] and "direct" in r["direct_truncated"]
    for key in ("truncated", "flipped", "missing", "tampered", "direct"):
        assert r[f"{key}_unchanged"], key
    assert (r["good_load"], r["good_step"]) == (1, 1)

    assert r["plan"] >= 3
    assert "loss blew up" in r["failed_step"] and r["failed_grads"] == 0
    a, b = r["after_failure_norm"]
    assert abs(a - b) <= 1e-6 * max(1.0, abs(b))

    for key, what in (
        ("python_float", "float"),
        ("no_graph", "without a graph"),
        ("vector_metric", "shape (3,)"),
        ("metric_named_loss", "'loss'"),
        ("not_a_tuple", "return a tuple"),
        ("two_parameters", "ctx: LossContext"),
    ):
        assert r[f"ret_{key}"].startswith("InvalidInput") and what in r[f"ret_{key}"], r[f"ret_{key}"]
        assert r[f"ret_{key}_grads"] == 0, key
    assert r["mask_padding"].startswith("InvalidInput") and "marks padding" in r["mask_padding"]
    assert r["mask_two"].startswith("InvalidInput") and "other than 0/1 ([2])" in r["mask_two"]
    assert r["infer_inf"].startswith("InvalidInput") and "temperature=inf" in r["infer_inf"]
    assert r["bucket_nan"].startswith("InvalidInput") and "bucket_bytes=nan" in r["bucket_nan"]
    assert r["export_int"].startswith("InvalidInput") and "torch.int32" in r["export_int"]
    assert r["export_frac"].startswith("InvalidInput") and "max_shard_bytes=1.5" in r["export_frac"]
    assert not r["export_refused_wrote"]

    assert "model.safetensors.index.json" in r["export1"] and len(r["export1"]) > 3
    assert r["export2"] == ["config.json", "model.safetensors"]
    assert r["siblings"] == ["export"]  # no .tmp/.old left behind
    assert "CheckpointError" in r["mixed"] and "is in both" in r["mixed"]
    assert r["index_ok"] > 0
    assert (
        "CheckpointError" in r["stale_vs_index"]
        and "not in model.safetensors.index.json" in r["stale_vs_index"]
    )
    assert "CheckpointError" in r["int_into_float"] and "torch.int32" in r["int_into_float"]
    assert "CheckpointError" in r["truncated_hf"] and "truncated" in r["truncated_hf"]
    assert r["hf_unchanged"]
    assert r["config_untouched"] and r["value_arch"] == ["LlamaForTokenClassification"]


def test_rank0_file_failure_raises_on_every_rank_promptly(tmp_path: Path) -> None:
    res = run_distributed(job_pair, 2, str(tmp_path), timeout_s=120)
    for rank, r in enumerate(res):
        for key in ("export", "save"):
            assert r[key].startswith("CheckpointError") and "rank 0" in r[key], (rank, key, r[key])
            assert "blocker" in r[key]
            assert r[f"{key}_s"] < 30, (rank, key, r[f"{key}_s"])  # not the 120 s group timeout
        assert r["load_hf"].startswith("CheckpointError") and "rank 1" in r["load_hf"], r["load_hf"]
        assert "nowhere is not a directory" in r["load_hf"] and r["load_hf_s"] < 30
        assert r["load_hf_unchanged"]
        assert r["after"] == 3.0
    assert os.path.isfile(tmp_path / "blocker")
