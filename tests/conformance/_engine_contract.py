"""The ``ParallelEngine`` and ``WeightLoader`` contracts as functions, so any engine's test package can run
them with its own launcher.

- ``engine_names()``: pytest params for every registered engine, skipped with its probe's reason when
  it cannot run on this host (an engine joins the suites by registering).
- ``world_sizes()``: 1 and 2 ranks on cpu (gloo); on an accelerator as many as there are devices (<= 2).
- ``job_engine`` / ``job_loader``: what every rank runs (module-level, picklable); they return plain
  results that ``check_engine`` / ``check_loader`` assert on.
- ``Launcher``: ``launcher(fn, world_size, *args) -> per-rank results``. The default starts real
  process groups (``tests._dist.run_distributed``; gloo on cpu, the device's backend otherwise). A
  package that must start ranks differently (mcore under a CPU-faking fixture) passes its own to
  ``run_engine_contract`` / ``run_loader_contract``, or overrides the ``contract_launcher`` fixture.

Models are tiny random Hugging Face configs; the reference is a float64 single-process transformers
model. The engine runs fp32 parameters; tolerances depend on the device (``tolerance()``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed import _fsdp_helpers as H
from underlay import registry

Launcher = Callable[..., list[Any]]

__all__ = [
    "Launcher",
    "check_engine",
    "check_loader",
    "default_launcher",
    "device_name",
    "engine_names",
    "job_engine",
    "job_loader",
    "run_engine_contract",
    "run_loader_contract",
    "tolerance",
    "world_sizes",
]


def device_name() -> str:
    """``UNDERLAY_DEVICE`` when set (``cuda`` on the GPU host), else cpu."""
    wanted = os.environ.get("UNDERLAY_DEVICE", "").strip()
    return wanted if wanted and wanted != "auto" else "cpu"


def tolerance(device: str | None = None) -> float:
    """Largest allowed |engine - float64 reference| for an fp32 engine: fp32 rounding on cpu; on an
    accelerator also its kernels' reduction orders (cuBLAS, fused attention)."""
    return 2e-5 if (device or device_name()) == "cpu" else 2e-3


def engine_names(kind: str = "engine") -> list[Any]:
    """One pytest param per registered engine (or weight loader), skipped with the probe's reason when
    it cannot run here."""
    out = []
    for spec in registry.backends(kind):
        probe = registry.probe(kind, spec.name)
        marks = [] if probe.available else [pytest.mark.skip(reason=f"{kind} {spec.name}: {probe.reason}")]
        out.append(pytest.param(spec.name, marks=marks, id=spec.name))
    return out


def world_sizes() -> list[int]:
    """1 and 2 ranks on cpu; on an accelerator host no more ranks than devices."""
    if device_name() == "cpu":
        return [1, 2]
    count = registry.get_device(device_name()).device_count()
    return [w for w in (1, 2) if w <= count]


def default_launcher(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Real process groups: gloo on cpu, the device's backend (one device per rank) otherwise."""
    from tests._dist import run_distributed

    dev = device_name()
    backend = "gloo" if dev == "cpu" else registry.get_device(dev).dist_backend
    return run_distributed(fn, world, *args, timeout_s=300, backend=backend)


def qwen3_config() -> Any:
    """A 2-layer Qwen3 (q/k norms, GQA 4 q / 2 kv heads, head_dim 8), vocab 128, untied."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=H.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


MODELS: dict[str, Callable[[], Any]] = {
    "qwen3": qwen3_config,
    "qwen2_tied": H.qwen2_tied_config,
    "qwen3_moe": H.qwen3_moe_config,
}


def _ctx(name: str, dev_name: str) -> tuple[Any, Any, Any]:
    registry.reset()
    dev = registry.get_device(dev_name)
    return dev, (lambda cfg: registry.get_engine(cfg, name)), registry.get_weight_loader(name)


def _hf_state(loader: Any, engine: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in loader.iter_hf_tensors(engine)}


def _buckets(engine: Any, **kw: Any) -> list[list[tuple[str, torch.Tensor]]]:
    return [[(n, t.detach().cpu().clone()) for n, t in b] for b in engine.iter_weights(**kw)]


def _files(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _dp_coords(engine: Any) -> tuple[int, int]:
    """This rank's data-parallel index and the data-parallel size (the rows it must be given)."""
    group = engine.layout.groups.dp
    return (dist.get_rank(group) if group is not None else 0), engine.layout.dp


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _refused(fn: Callable[[], Any], exc_type: type[BaseException]) -> str:
    try:
        fn()
    except exc_type as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def job_engine(rank: int, world: int, name: str, root: str, dev_name: str) -> dict[str, Any]:
    """Every rank: the engine contract on a tiny Qwen3 (see ``check_engine`` for what must hold)."""
    import copy

    from underlay.interfaces import (
        CheckpointError,
        InvalidInput,
        ModelConfig,
        ParallelEngine,
        ProcessGroups,
        TokenBatch,
        WeightLoader,
    )

    _dev, build, loader = _ctx(name, dev_name)
    base = Path(root) / f"engine_w{world}"
    out: dict[str, Any] = {"rank": rank}
    hf = qwen3_config()
    cfg = H.engine_config(copy.deepcopy(hf))
    engine = build(cfg)
    lay = engine.layout
    out["protocol"] = isinstance(engine, ParallelEngine) and isinstance(loader, WeightLoader)
    out["layout"] = (
        lay.world_size == world
        and lay.dp_replicate * lay.dp_shard * lay.tp * lay.pp * lay.cp == world
        and isinstance(lay.groups, ProcessGroups)
        and lay.dp * lay.mp == world
    )
    out["recompute_none"] = engine.supports_recompute("none").available
    dpi, dps = _dp_coords(engine)
    ref = H.reference_model(copy.deepcopy(hf), cfg.model.seed)
    gb1, gb2 = H.global_batch(21), H.global_batch(22)
    local1, local2 = H.shard(gb1, dpi, dps), H.shard(gb2, dpi, dps)

    # infer: the rows this rank passed, in its order, equal to the float64 forward
    inf = engine.infer(local1, with_entropy=True)
    with torch.no_grad():
        ref_out = H.reference_outputs(ref, local1)
    out["infer_ref"] = float((inf.log_probs.double().cpu() - ref_out.log_probs).abs().max())
    out["infer_entropy_ref"] = float((inf.entropy.double().cpu() - ref_out.entropy).abs().max())
    order = list(range(local1.batch_size))[::-1]
    rev = engine.infer(local1.select(order))
    out["infer_order"] = float((rev.log_probs.cpu()[order] - inf.log_probs.cpu()).abs().max())
    out["infer_shape"] = tuple(inf.log_probs.shape) == tuple(local1.input_ids.shape)

    # iter_weights before any step: HF names and values of the seed model; receivers
    every = _buckets(engine, bucket_bytes=8 << 10)
    flat = {n: t for b in every for n, t in b}
    out["iter_init"] = H.max_diff(flat, H.merged_weights(ref))
    out["iter_buckets"] = len(every)
    only0 = _buckets(engine, bucket_bytes=8 << 10, ranks=[0])
    out["ranks_bucket_count"] = len(only0)
    out["ranks_received"] = sum(len(b) for b in only0)
    out["ranks_equal"] = [[n for n, _ in b] for b in only0] == [[n for n, _ in b] for b in every] and all(
        torch.equal(t, flat[n]) for b in only0 for n, t in b
    )

    # bad input is refused before any state changes
    before = _hf_state(loader, engine)
    bad_ids = local1.input_ids.clone()
    bad_ids[0, 0] = H.VOCAB + 5
    bad = TokenBatch(bad_ids, local1.attention_mask, local1.loss_mask, dict(local1.extras))
    out["bad_token"] = _refused(lambda: engine.forward_backward(bad, H.pg_loss), InvalidInput)
    empty_mask = local1.attention_mask.clone()
    empty_mask[0] = 0
    empty = TokenBatch(local1.input_ids, empty_mask, local1.loss_mask * empty_mask, dict(local1.extras))
    out["bad_empty_row"] = _refused(lambda: engine.infer(empty), InvalidInput)
    out["bad_bucket"] = _refused(lambda: next(iter(engine.iter_weights(0))), InvalidInput)
    out["bad_ranks"] = _refused(lambda: next(iter(engine.iter_weights(ranks=[world]))), InvalidInput)
    other_dir = base / "other_hf"
    if rank == 0:
        other = H.reference_model(qwen3_config(), 3).float()
        other.config.intermediate_size = 48
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_config(other.config).save_pretrained(str(other_dir))
    _barrier()
    out["bad_hf"] = _refused(lambda: loader.load_hf(engine, other_dir), CheckpointError)
    out["bad_unchanged"] = H.max_diff(_hf_state(loader, engine), before)

    # one step equals the float64 single-process step; every rank reports the same metrics
    res = engine.forward_backward(local1, H.pg_loss)
    st = engine.optimizer_step()
    loss, norm, ref_w = H.reference_step(ref, gb1, cfg)
    out["metrics"] = dict(res.metrics)
    out["loss_tokens"] = res.loss_tokens == int(gb1.loss_mask.sum())
    out["step_loss"] = abs(res.metrics["loss"] - loss)
    out["step_norm"] = abs(st.grad_norm - norm)
    out["step_weights"] = H.max_diff(_hf_state(loader, engine), ref_w)

    # save; step 2 with offload/onload between backward and the optimizer step; resume: identical
    ckpt = base / "ckpt"
    if rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    _barrier()
    engine.save_checkpoint(ckpt)
    res2 = engine.forward_backward(local2, H.pg_loss)
    engine.offload()
    engine.onload()
    engine.optimizer_step()
    w2 = _hf_state(loader, engine)
    engine.load_checkpoint(ckpt)
    out["resumed_step"] = engine.global_step
    res2b = engine.forward_backward(local2, H.pg_loss)
    engine.optimizer_step()
    out["resume_loss"] = abs(res2b.metrics["loss"] - res2.metrics["loss"])
    out["resume_offload_weights"] = H.max_diff(_hf_state(loader, engine), w2)

    # iter_weights equals the exported HF state dict; an engine loaded from it equals this one
    current = _hf_state(loader, engine)
    exported = loader.export_hf(engine, base / "hf", dtype=torch.float32, max_shard_bytes=40 << 10)
    streamed = {n: t for b in _buckets(engine) for n, t in b}
    if rank == 0:
        assert exported is not None
        files = _files(exported)
        out["export_vs_iter"] = (
            H.max_diff(files, streamed) if streamed and files.keys() == streamed.keys() else math.inf
        )
        out["export_files"] = len(list(exported.glob("*.safetensors")))
    _barrier()
    reloaded = build(H.engine_config(copy.deepcopy(hf), model=ModelConfig(path=str(base / "hf"))))
    out["load_hf_roundtrip"] = H.max_diff(_hf_state(loader, reloaded), current)
    return out


def check_engine(results: list[dict[str, Any]], world: int, tol: float | None = None) -> None:
    """What ``job_engine``'s results must show, on every rank."""
    tol = tolerance() if tol is None else tol
    assert len(results) == world
    for r in results:
        rank = r["rank"]
        assert r["protocol"] and r["layout"] and r["recompute_none"], r
        # a step equals the float64 single-process reference
        assert r["loss_tokens"], r
        assert r["step_loss"] < tol and r["step_norm"] < tol and r["step_weights"] < tol, r
        # infer: outputs of the rows passed, in their order
        assert r["infer_shape"] and r["infer_ref"] < tol and r["infer_entropy_ref"] < tol, r
        assert r["infer_order"] < tol, r
        # iter_weights: HF names and values; only the receivers get tensors, every rank the same buckets
        assert r["iter_init"] < tol and r["iter_buckets"] > 3, r
        assert r["ranks_bucket_count"] == r["iter_buckets"], r
        if rank == 0:
            assert r["ranks_equal"] and r["ranks_received"] > 0, r
        else:
            assert r["ranks_received"] == 0, r
        # bad input refused before state changes
        assert r["bad_token"].startswith("InvalidInput") and "out of range" in r["bad_token"], r
        assert r["bad_empty_row"].startswith("InvalidInput"), r
        assert r["bad_bucket"].startswith("InvalidInput") and r["bad_ranks"].startswith("InvalidInput"), r
        assert r["bad_hf"].startswith("CheckpointError") and "shape mismatch" in r["bad_hf"], r
        assert r["bad_unchanged"] == 0.0, r
        # save/load resume identical; offload/onload exact
        assert r["resumed_step"] == 1, r
        assert r["resume_loss"] == 0.0 and r["resume_offload_weights"] == 0.0, r
        assert r["load_hf_roundtrip"] == 0.0, r
    # identical metrics on every rank
    assert all(r["metrics"] == results[0]["metrics"] for r in results), [r["metrics"] for r in results]
    r0 = results[0]
    assert r0["export_vs_iter"] == 0.0 and r0["export_files"] > 1, r0


def job_loader(rank: int, world: int, name: str, root: str, dev_name: str, model: str) -> dict[str, Any]:
    """Every rank: the weight-loader contract on a transformers-saved tiny model ``model``."""
    import copy
    import json
    import shutil

    from safetensors.torch import save_file

    from underlay.interfaces import CheckpointError, ModelConfig

    _dev, build, loader = _ctx(name, dev_name)
    base = Path(root) / f"loader_{model}_w{world}"
    src, extra, missing, wrong = (base / n for n in ("src", "extra", "missing", "wrong"))
    hf = MODELS[model]()
    if rank == 0:
        ref = H.reference_model(copy.deepcopy(hf), 5).float()
        ref.save_pretrained(str(src))
        disk = _files(src)
        for d in (extra, missing, wrong):
            d.mkdir(parents=True)
            shutil.copy(src / "config.json", d / "config.json")
        victim = sorted(disk)[1]
        save_file({**disk, "model.unused.weight": torch.ones(3)}, str(extra / "model.safetensors"))
        save_file({k: v for k, v in disk.items() if k != victim}, str(missing / "model.safetensors"))
        save_file({**disk, victim: disk[victim][..., :-1].contiguous()}, str(wrong / "model.safetensors"))
    _barrier()
    disk = _files(src)
    out: dict[str, Any] = {"rank": rank}
    engine = build(H.engine_config(copy.deepcopy(hf), model=ModelConfig(path=str(src))))
    streamed = _hf_state(loader, engine)
    # tied aliases are written once (as save_pretrained does); per-expert files stay per expert
    out["iter_names"] = sorted(streamed) == sorted(disk)
    out["iter_values"] = H.max_diff(streamed, disk) if streamed.keys() == disk.keys() else math.inf
    report = loader.load_hf(engine, src)
    out["report"] = (report.loaded, report.missing, report.unexpected, report.bytes_read > 0)
    out["files"] = len(disk)
    # strictness and shape checks, before any parameter changes
    before = _hf_state(loader, engine)
    out["extra_strict"] = _refused(lambda: loader.load_hf(engine, extra), CheckpointError)
    out["missing_strict"] = _refused(lambda: loader.load_hf(engine, missing), CheckpointError)
    out["wrong_shape"] = _refused(lambda: loader.load_hf(engine, wrong, strict=False), CheckpointError)
    out["unchanged"] = H.max_diff(_hf_state(loader, engine), before)
    lax = loader.load_hf(engine, extra, strict=False)
    out["extra_lax"] = lax.unexpected
    # export: the same files back (sharded with an index), loadable by transformers
    exported = loader.export_hf(engine, base / "out", dtype=torch.float32, max_shard_bytes=4 << 10)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        assert exported is not None
        written = _files(exported)
        out["export_equal"] = H.max_diff(written, disk) if written.keys() == disk.keys() else math.inf
        index = json.loads((exported / "model.safetensors.index.json").read_text())
        out["export_index"] = sorted(index["weight_map"]) == sorted(disk)
        back = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
        again = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        sd_back, sd_again = back.state_dict(), again.state_dict()
        out["transformers_reload"] = (
            H.max_diff(dict(sd_back), dict(sd_again)) if sd_back.keys() == sd_again.keys() else math.inf
        )
    else:
        out["export_none"] = exported is None
    _barrier()
    return out


def check_loader(results: list[dict[str, Any]], world: int) -> None:
    """What ``job_loader``'s results must show, on every rank."""
    assert len(results) == world
    for r in results:
        assert r["iter_names"] and r["iter_values"] == 0.0, r
        loaded, missing, unexpected, read = r["report"]
        assert loaded == r["files"] and missing == () and unexpected == () and read, r
        assert (
            r["extra_strict"].startswith("CheckpointError") and "model.unused.weight" in r["extra_strict"]
        ), r
        assert r["missing_strict"].startswith("CheckpointError") and "missing" in r["missing_strict"], r
        assert r["wrong_shape"].startswith("CheckpointError") and "shape mismatch" in r["wrong_shape"], r
        assert r["unchanged"] == 0.0, r
        assert r["extra_lax"] == ("model.unused.weight",), r
        if r["rank"] == 0:
            assert r["export_equal"] == 0.0 and r["export_index"] and r["transformers_reload"] == 0.0, r
        else:
            assert r["export_none"], r


def run_engine_contract(name: str, world: int, root: Path, launcher: Launcher = default_launcher) -> None:
    """Run and check the engine contract for engine ``name`` on ``world`` ranks."""
    check_engine(launcher(job_engine, world, name, str(root), device_name()), world)


def run_loader_contract(
    name: str, world: int, root: Path, model: str, launcher: Launcher = default_launcher
) -> None:
    """Run and check the weight-loader contract for ``name`` on ``world`` ranks and tiny model ``model``."""
    check_loader(launcher(job_loader, world, name, str(root), device_name(), model), world)
