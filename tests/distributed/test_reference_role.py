"""``EngineConfig(role="reference")`` on the fsdp2 engine, at 2 gloo ranks: the engine holds only its
weights, in ``param_dtype`` (no fp32 master copy, no optimizer state, no gradients); its ``infer`` equals a
trainable engine's ``infer`` bit for bit on the same weights (seeded, after ``load_hf`` of an export, after
``load_checkpoint`` of a trainable checkpoint, across offload/onload); every training call is refused
naming the role (the mcore engine's refusal: ``tests/mcore/test_mcore_roles.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H
from underlay.interfaces import ConfigError, EngineConfig, LoraConfig, ModelConfig, UnsupportedOperation

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _local_bytes(tensors: Any) -> int:
    """Bytes this rank holds for ``tensors`` (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        if torch.is_tensor(t):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def _held(engine: Any) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes held on this rank."""
    params = list(engine.model.parameters())
    try:
        state = [v for s in engine.optimizer.state.values() for v in s.values()]
    except UnsupportedOperation:
        state = []
    return {
        "params": _local_bytes(params),
        "grads": _local_bytes(p.grad for p in params),
        "optimizer": _local_bytes(state),
    }


def _same(a: Any, b: Any) -> bool:
    return all(
        x is not None and y is not None and torch.equal(x, y)
        for x, y in ((a.log_probs, b.log_probs), (a.entropy, b.entropy))
    )


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    from underlay import registry

    out: dict[str, Any] = {}
    hf = H.llama_config()
    batch = H.shard(H.global_batch(5), rank, world)
    loader = registry.get_weight_loader("fsdp2")
    cfg = H.engine_config(hf, param_dtype="bfloat16")
    train = registry.get_engine(cfg)
    ref = registry.get_engine(dataclasses.replace(cfg, role="reference"))
    out["dtypes"] = sorted({str(p.dtype) for p in ref.model.parameters()})
    out["requires_grad"] = any(p.requires_grad for p in ref.model.parameters())
    out["seeded_equal"] = _same(train.infer(batch, with_entropy=True), ref.infer(batch, with_entropy=True))

    # train (weights move off their seeded values), then hand them over: an HF export, a checkpoint
    train.forward_backward(batch, H.pg_loss)
    train.optimizer_step()
    want = train.infer(batch, with_entropy=True)
    out["moved"] = not _same(want, ref.infer(batch, with_entropy=True))
    loader.export_hf(train, Path(root) / "hf", dtype=torch.float32)
    loader.load_hf(ref, Path(root) / "hf")
    out["load_hf_equal"] = _same(want, ref.infer(batch, with_entropy=True))
    train.forward_backward(batch, H.pg_loss)
    train.optimizer_step()
    ckpt = Path(root) / "ckpt"
    if rank == 0:
        ckpt.mkdir()
    torch.distributed.barrier()
    train.save_checkpoint(ckpt)
    train.forward_backward(batch, H.pg_loss)  # gradients held by the trainable engine
    held_train = _held(train)
    want = train.infer(batch, with_entropy=True)
    ref.load_checkpoint(ckpt)
    out["ckpt_equal"] = _same(want, ref.infer(batch, with_entropy=True))
    out["ckpt_step"] = ref.global_step
    ref.offload()
    ref.onload()
    out["offload_equal"] = _same(want, ref.infer(batch, with_entropy=True))
    out["ref_held"] = _held(ref)
    out["train_held"] = held_train
    out["grads_after_infer"] = any(p.grad is not None for p in ref.model.parameters())

    refused: dict[str, str] = {}
    calls = {
        "forward_backward": lambda: ref.forward_backward(batch, H.pg_loss),
        "optimizer_step": ref.optimizer_step,
        "lr_scheduler_step": ref.lr_scheduler_step,
        "save_checkpoint": lambda: ref.save_checkpoint(ckpt),
        "optimizer": lambda: ref.optimizer,
    }
    for name, call in calls.items():
        try:
            call()
            refused[name] = "no error"
        except UnsupportedOperation as exc:
            refused[name] = str(exc)
    out["refused"] = refused
    out["after_refusals_equal"] = _same(want, ref.infer(batch, with_entropy=True))
    return out


def test_reference_role_holds_only_weights_and_infers_like_the_trainable(tmp_path: Path) -> None:
    results = run_distributed(_job, 2, str(tmp_path))
    for r in results:
        assert r["dtypes"] == ["torch.bfloat16"] and not r["requires_grad"]
        assert r["seeded_equal"] and r["moved"]
        assert r["ckpt_equal"] and r["ckpt_step"] == 2
        assert r["load_hf_equal"] and r["offload_equal"] and r["after_refusals_equal"]
        assert not r["grads_after_infer"]
        ref, train = r["ref_held"], r["train_held"]
        # fp32 masters -> bf16 weights: half the parameter bytes; nothing else held
        assert ref["params"] * 2 == train["params"], (ref, train)
        assert ref["grads"] == 0 and ref["optimizer"] == 0
        assert (
            train["grads"] == train["params"] and train["optimizer"] >= 2 * train["params"]
        )  # AdamW moments
        for name, msg in r["refused"].items():
            assert f"{name}: this fsdp2 engine has EngineConfig.role='reference'" in msg, (name, msg)


def test_reference_role_config_refusals() -> None:
    hf = H.llama_config()
    with pytest.raises(ConfigError, match="role='bogus'"):
        EngineConfig(model=ModelConfig(hf_config=hf), role="bogus")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="disable_adapter"):
        EngineConfig(model=ModelConfig(hf_config=hf, lora=LoraConfig()), role="reference")
