"""fsdp2 ``activation_offload``: the loss, metrics and every gradient of a step with the saved activations
moved to host memory and back equal (bit for bit) the same engine's step without offload, alone and with
recompute="full", TiledMLP and compile="layer", on packed variable-length micro-batches, at 1 and 2 gloo
ranks; the offloader's counters show the copies, prefetches and resident layers really happened."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H

LAYERS = 3

VARIANTS: dict[str, dict[str, Any]] = {
    "alone": {},
    "recompute": {"recompute": "full"},
    "tiled": {"tiles": 3},
    "recompute_tiled": {"recompute": "full", "tiles": 3},
    "compile_layer": {"compile": "layer"},
    "compile_layer_recompute_tiled": {"compile": "layer", "recompute": "full", "tiles": 3},
}


def _step(variant: dict[str, Any], offload: bool, seed: int, device: str = "cpu") -> dict[str, Any]:
    """One forward_backward of a fresh engine; gradients gathered full, loss, metrics, offload counters."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.interfaces import ModelConfig
    from underlay.registry import get_device

    options: dict[str, Any] = {"activation_offload": offload, "activation_offload_min_bytes": 0}
    if "compile" in variant:
        options["compile"] = variant["compile"]
    hf = H.llama_config(num_hidden_layers=LAYERS)
    config = H.engine_config(
        hf,
        model=ModelConfig(hf_config=hf, seed=0, tiled_mlp_tiles=variant.get("tiles")),
        recompute=variant.get("recompute", "none"),
        options=options,
        # accelerators: bf16 compute (what their attention kernels take); fp32 master weights
        param_dtype="float32" if device == "cpu" else "bfloat16",
    )
    engine = FSDP2Engine(config, get_device(device))
    rank, world = dist.get_rank(), engine.layout.world_size
    batch = H.shard(H.global_batch(seed, n=6), rank, world)
    result = engine.forward_backward(batch, H.pg_loss)
    grads = {}
    for name, p in engine.model.named_parameters():
        assert p.grad is not None, name
        g = p.grad
        grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()
    offloader = engine.activation_offloader
    stats = None
    if offloader is not None:
        stats = dict(vars(offloader.stats))
        engine.offload()  # releases the held activations and the free host buffers
        stats["pool_free_after_release"] = offloader.pool.free_buffers
        engine.onload()
    return {
        "metrics": dict(result.metrics),
        "grads": grads,
        "micro": result.num_micro_batches,
        "stats": stats,
    }


def _max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def job_offload_equals_plain(rank: int, world: int, names: list[str], device: str = "cpu") -> dict[str, Any]:
    """Per variant: the gradients (and metrics) of a step with and without offload; on an accelerator
    also a second plain step, whose difference from the first is the run-to-run noise of its kernels."""
    import torch

    os.environ.setdefault("UNDERLAY_COMPILE_BACKEND", "aot_eager")
    out: dict[str, Any] = {}
    for name in names:
        variant = VARIANTS[name]
        plain = _step(variant, offload=False, seed=11, device=device)
        moved = _step(variant, offload=True, seed=11, device=device)
        again = _step(variant, offload=False, seed=11, device=device) if device != "cpu" else plain
        mismatch = [n for n in plain["grads"] if not torch.equal(plain["grads"][n], moved["grads"][n])]
        out[name] = {
            "max_abs_diff": _max_abs_diff(plain["grads"], moved["grads"]),
            "noise_abs_diff": _max_abs_diff(plain["grads"], again["grads"]),
            "grad_scale": max(float(g.abs().max()) for g in plain["grads"].values()),
            "mismatch": mismatch,
            "n_grads": len(plain["grads"]),
            "nonzero": sum(int(bool(g.abs().sum() > 0)) for g in plain["grads"].values()),
            "metrics_plain": plain["metrics"],
            "metrics_moved": moved["metrics"],
            "micro": plain["micro"],
            "stats": moved["stats"],
        }
    return out


def _check(name: str, r: dict[str, Any]) -> None:
    assert r["mismatch"] == [], (name, r["mismatch"])
    assert r["nonzero"] == r["n_grads"] > 0, (name, r)
    assert r["metrics_plain"] == r["metrics_moved"], (name, r)
    assert r["micro"] >= 2, (name, r)  # packed, variable-length micro-batches: several forward passes
    s = r["stats"]
    passes = r["micro"]
    assert s["offloaded_tensors"] > 0 and s["copied_bytes"] > 0, (name, s)
    # the last layer is still resident when backward begins; the others come back host-to-device,
    # all but the first of them (the layer below the resident one) prefetched
    assert s["resident_layers"] == passes, (name, s)
    assert s["fetched_layers"] == passes * (LAYERS - 1), (name, s)
    assert s["prefetched_layers"] == passes * (LAYERS - 1), (name, s)
    assert s["skipped_params"] > 0 or "recompute" in name, (name, s)
    if "recompute" in name:
        # only the checkpoint boundaries (each layer's hidden-state input) are saved through the hooks
        assert s["offloaded_tensors"] == passes * LAYERS, (name, s)
    assert s["pool_free_after_release"] == 0, (name, s)


@pytest.mark.distributed
@pytest.mark.parametrize("names", [["alone", "recompute", "tiled", "recompute_tiled"]])
def test_offload_gradients_equal_plain_one_rank(names: list[str]) -> None:
    (r,) = run_distributed(job_offload_equals_plain, 1, names, timeout_s=600)
    for name in names:
        _check(name, r[name])


@pytest.mark.distributed
@pytest.mark.slow
def test_offload_gradients_equal_plain_with_compiled_layers() -> None:
    names = ["compile_layer", "compile_layer_recompute_tiled"]
    (r,) = run_distributed(job_offload_equals_plain, 1, names, timeout_s=600)
    for name in names:
        _check(name, r[name])


@pytest.mark.distributed
def test_offload_gradients_equal_plain_two_ranks() -> None:
    names = ["alone", "recompute_tiled"]
    results = run_distributed(job_offload_equals_plain, 2, names, timeout_s=600)
    for r in results:
        for name in names:
            _check(name, r[name])
    assert results[0]["alone"]["metrics_moved"] == results[1]["alone"]["metrics_moved"]
