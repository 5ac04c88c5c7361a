"""fsdp2 with its default options on the cpu (what auto resolves to, logged and shown), and the
host-offloaded AdamW (``optimizer_offload``): bit-identical parameters to the normal optimizer after
several steps at 1 and 2 gloo ranks, checkpoint save/load and offload()/onload() with it."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H


def job_defaults(rank: int, world: int) -> dict[str, Any]:
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.registry import get_device

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("underlay.engines.fsdp2")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    engine = FSDP2Engine(H.engine_config(H.llama_config()), get_device("cpu"))
    res = engine.forward_backward(H.shard(H.global_batch(1), rank, world), H.pg_loss)
    engine.optimizer_step()
    o = engine.resolved_options
    return {
        "options": (
            o.compile,
            o.fused_adamw,
            o.compile_memory_budget,
            o.reshard_after_forward,
            o.optimizer_offload,
            o.grad_sync,
        ),
        "recompute": engine.recompute,
        "reasons": engine.option_reasons,
        "repr": repr(engine),
        "logs": records,
        "loss": res.metrics["loss"],
        "warmup": engine.compile_warmup,
        "fits": engine.memory_estimate.fits,
    }


@pytest.mark.distributed
def test_cpu_defaults_are_resolved_logged_and_shown() -> None:
    for r in run_distributed(job_defaults, 2, timeout_s=300):
        # per-step gradient sync is opt-in
        assert r["options"] == (False, False, None, False, False, "per_micro_batch"), r
        assert r["recompute"] == "none" and r["fits"]
        assert "cpu" in r["reasons"]["compile"] and "memory policy" in r["reasons"]["recompute"]
        assert "recompute='none'" in r["repr"] and "optimizer_offload=False" in r["repr"]
        assert "grad_sync='per_micro_batch'" in r["repr"] and "memory policy" in r["reasons"]["grad_sync"]
        assert r["warmup"]["steps"] == 0
    logs = run_distributed(job_defaults, 1, timeout_s=300)[0]["logs"]
    names = ("compile", "fused_adamw", "reshard_after_forward", "optimizer_offload", "grad_sync", "recompute")
    for name in names:
        assert any(line.startswith(f"fsdp2 option {name}=") for line in logs), logs


def _params(engine: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.named_full_parameters()}


def job_offload_equal(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Two engines, same seed and batches: normal AdamW vs host-offloaded AdamW (chunks of a few
    parameters, so the streaming loop runs many chunks). offload()/onload() in between on the second;
    then a checkpoint round trip of the offloaded one."""
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.engines.fsdp2.optim_offload import HostOffloadAdamW
    from underlay.registry import get_device

    dev = get_device("cpu")
    plain = FSDP2Engine(H.engine_config(H.llama_config(), options={"optimizer_offload": False}), dev)
    off = FSDP2Engine(H.engine_config(H.llama_config(), options={"optimizer_offload": True}), dev)
    assert isinstance(off.optimizer, HostOffloadAdamW)
    off.optimizer._chunk_bytes = 4096  # many chunks: each holds a few small parameters
    norms = []
    for step in range(steps):
        batch = H.shard(H.global_batch(100 + step), rank, world)
        for e in (plain, off):
            e.forward_backward(batch, H.pg_loss)
        if step == 1:
            off.offload()
            off.onload()
        norms.append((plain.optimizer_step().grad_norm, off.optimizer_step().grad_norm))
    a, b = _params(plain), _params(off)
    equal = all(torch.equal(a[k], b[k]) for k in a)
    # the state stays on the host
    on_host = all(
        (s["exp_avg"].to_local() if hasattr(s["exp_avg"], "to_local") else s["exp_avg"]).device.type == "cpu"
        for s in off.optimizer.state.values()
    )
    # checkpoint round trip: save, step, load, the same step again -> the same parameters
    with tempfile.TemporaryDirectory() as tmp:
        obj = [tmp]
        torch.distributed.broadcast_object_list(obj, src=0)
        ckpt = Path(obj[0]) / "ckpt"
        if rank == 0:
            ckpt.mkdir()
        torch.distributed.barrier()
        off.save_checkpoint(ckpt)
        batch = H.shard(H.global_batch(999), rank, world)
        off.forward_backward(batch, H.pg_loss)
        off.optimizer_step()
        after = _params(off)
        off.forward_backward(H.shard(H.global_batch(5), rank, world), H.pg_loss)
        off.optimizer_step()  # move away from the saved state
        off.load_checkpoint(ckpt)
        off.forward_backward(batch, H.pg_loss)
        off.optimizer_step()
        again = _params(off)
        torch.distributed.barrier()
    resumed = all(torch.equal(after[k], again[k]) for k in after)
    return {"equal": equal, "norms": norms, "on_host": on_host, "resumed": resumed}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_optimizer_offload_is_bit_identical_and_checkpoints(world: int) -> None:
    for r in run_distributed(job_offload_equal, world, 4, timeout_s=400):
        assert r["equal"], r
        assert all(a == b for a, b in r["norms"]), r["norms"]
        assert r["on_host"] and r["resumed"], r


def job_resharded_after_forward_only(rank: int, world: int) -> dict[str, Any]:
    """With parameters kept unsharded (the default on one node), a forward without backward (infer,
    a loss_fn that fails) must still leave every layer's parameters sharded afterwards."""
    from torch.distributed.tensor import DTensor

    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.registry import get_device

    engine = FSDP2Engine(H.engine_config(H.llama_config()), get_device("cpu"))
    assert engine.resolved_options.reshard_after_forward is False
    batch = H.shard(H.global_batch(3), rank, world)
    out = {}
    engine.infer(batch)
    out["after_infer"] = all(isinstance(p, DTensor) for p in engine.model.parameters())
    try:
        engine.forward_backward(batch, lambda o, b, c: (1.0, {}))  # type: ignore[arg-type,return-value]
    except Exception as exc:
        out["error"] = type(exc).__name__
    out["after_failed_step"] = all(isinstance(p, DTensor) for p in engine.model.parameters())
    engine.forward_backward(batch, H.pg_loss)
    out["after_step"] = all(isinstance(p, DTensor) for p in engine.model.parameters())
    return out


@pytest.mark.distributed
def test_kept_unsharded_parameters_are_resharded_after_a_forward_only() -> None:
    for r in run_distributed(job_resharded_after_forward_only, 2, timeout_s=300):
        assert r["error"] == "InvalidInput", r
        assert r["after_infer"] and r["after_failed_step"] and r["after_step"], r
