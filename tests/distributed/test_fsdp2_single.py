"""The fsdp2 engine's world-size-1 path (``options.single_device``, ``engines/fsdp2/single.py``) against
FSDP2 at one rank: the same bf16 steps (gradient accumulation over micro-batches and calls, clipping,
AdamW), tied embeddings and LoRA; the auto choice; offload/onload; a 1-rank checkpoint resumed at 2
ranks equals the uninterrupted 1-rank run; the configurations it refuses."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in engine.named_full_parameters()}


def _bf16(hf: Any, single: bool | None, **over: Any) -> Any:
    options = dict(over.pop("options", {}))
    if single is not None:
        options["single_device"] = single
    return H.engine_config(hf, param_dtype="bfloat16", options=options, max_tokens=24, **over)


def _train(engine: Any, seeds: list[tuple[int, int]]) -> dict[str, Any]:
    """Per step: two ``forward_backward`` calls (several micro-batches each), one optimizer step."""
    losses, norms, micro = [], [], 0
    for s1, s2 in seeds:
        r1 = engine.forward_backward(H.global_batch(s1), H.pg_loss)
        r2 = engine.forward_backward(H.global_batch(s2, n=4), H.pg_loss)
        micro = max(micro, r1.num_micro_batches)
        st = engine.optimizer_step()
        engine.lr_scheduler_step()
        losses += [r1.metrics["loss"], r2.metrics["loss"]]
        norms.append(st.grad_norm)
    return {"losses": losses, "norms": norms, "weights": _weights(engine), "micro": micro}


def _compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    return {
        "loss": max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)),
        "norm": max(abs(x - y) for x, y in zip(a["norms"], b["norms"], strict=True)),
        "weights": H.max_diff(a["weights"], b["weights"]),
        "micro": float(min(a["micro"], b["micro"])),
    }


STEPS = [(1, 2), (3, 4)]


def _cases(names: list[str]) -> dict[str, tuple[Any, dict[str, Any]]]:
    from underlay.interfaces import LoraConfig

    lora = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    cases: dict[str, tuple[Any, dict[str, Any]]] = {
        "llama": (H.llama_config(), {}),
        "tied": (H.qwen2_tied_config(), {}),
        "lora": (H.llama_config(), {"lora": lora}),
        "full_recompute": (H.llama_config(), {"recompute": "full"}),
    }
    return {n: cases[n] for n in names}


def job_compare(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """The path against FSDP2 at one rank (bf16 compute, fp32 masters and gradients), per case."""
    return _compare_cases(names)[0]


def _compare_cases(names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``job_compare``'s figures, and each case's run on the world-size-1 path."""
    import dataclasses

    from torch.distributed.tensor import DTensor

    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.registry import get_device

    dev = get_device("cpu")
    out: dict[str, Any] = {}
    single_runs: dict[str, Any] = {}
    for name, (hf, kw) in _cases(names).items():
        runs = {}
        for single in (True, False):
            extra = {k: v for k, v in kw.items() if k != "lora"}
            cfg = _bf16(copy.deepcopy(hf), single, **extra)
            if "lora" in kw:
                cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=kw["lora"]))
            engine = FSDP2Engine(cfg, dev)
            runs[single] = _train(engine, STEPS)
            if single:
                out[f"{name}_plain"] = not any(isinstance(p, DTensor) for p in engine.model.parameters())
                out[f"{name}_fp32_masters"] = all(p.dtype == torch.float32 for p in engine.model.parameters())
        out[name] = _compare(runs[True], runs[False])
        single_runs[name] = runs[True]
    return out, single_runs


def job_one(rank: int, world: int, root: str) -> dict[str, Any]:
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.interfaces import ConfigError
    from underlay.registry import get_device

    dev = get_device("cpu")
    out, single_runs = _compare_cases(["tied"])

    # auto: the path is chosen at one rank
    auto = FSDP2Engine(_bf16(H.qwen2_tied_config(), None), dev)
    out["auto_single"] = auto.options.single_device
    out["auto_reason"] = auto.option_reasons["single_device"]
    # a failed forward_backward and an infer leave the masters registered, no gradient behind
    try:
        auto.forward_backward(H.global_batch(9), lambda o, b, c: (1.0, {}))  # type: ignore[arg-type,return-value]
        out["failed_error"] = "no error"
    except Exception as exc:
        out["failed_error"] = type(exc).__name__
    auto.infer(H.global_batch(9))
    out["masters_back"] = all(p.dtype == torch.float32 and p.grad is None for p in auto.model.parameters())
    # step 1, a checkpoint (resumed at 2 ranks), everything offloaded and back, step 2: the same run
    # as the uninterrupted one
    _train(auto, STEPS[:1])
    (Path(root) / "ckpt").mkdir()
    auto.save_checkpoint(Path(root) / "ckpt")
    auto.offload()
    auto.onload()
    cont = _train(auto, STEPS[1:])
    out["offload"] = H.max_diff(cont["weights"], single_runs["tied"]["weights"])
    torch.save({"weights": cont["weights"], "losses": cont["losses"]}, Path(root) / "expected.pt")

    # refused configurations, before any work
    for key, cfg in (
        ("err_cpu_offload", _bf16(H.llama_config(), True, cpu_offload=True)),
        ("err_reshard", _bf16(H.llama_config(), True, options={"reshard_after_forward": True})),
    ):
        try:
            FSDP2Engine(cfg, dev)
            out[key] = "no error"
        except ConfigError as exc:
            out[key] = str(exc)
    return out


def job_two(rank: int, world: int, root: str) -> dict[str, Any]:
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.interfaces import ConfigError
    from underlay.registry import get_device

    dev = get_device("cpu")
    out: dict[str, Any] = {}
    engine = FSDP2Engine(_bf16(H.qwen2_tied_config(), None), dev)
    out["auto_single"] = engine.options.single_device
    engine.load_checkpoint(Path(root) / "ckpt")
    r1 = engine.forward_backward(H.shard(H.global_batch(3), rank, world), H.pg_loss)
    r2 = engine.forward_backward(H.shard(H.global_batch(4, n=4), rank, world), H.pg_loss)
    engine.optimizer_step()
    expected = torch.load(Path(root) / "expected.pt", weights_only=True)
    out["resume_weights"] = H.max_diff(_weights(engine), expected["weights"])
    out["resume_loss"] = max(
        abs(r1.metrics["loss"] - expected["losses"][0]), abs(r2.metrics["loss"] - expected["losses"][1])
    )
    try:
        FSDP2Engine(_bf16(H.llama_config(), True), dev)
        out["err_world"] = "no error"
    except ConfigError as exc:
        out["err_world"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("single")
    one = run_distributed(job_one, 1, str(root), timeout_s=240)[0]
    two = run_distributed(job_two, 2, str(root), timeout_s=240)
    return {"one": one, "two": two}


def _check_equal(r: dict[str, Any], names: list[str]) -> None:
    for name in names:
        assert r[f"{name}_plain"] and r[f"{name}_fp32_masters"], name
        assert r[name]["micro"] >= 2, "the batches must be split into several micro-batches"
        # same casts, same fp32 accumulation, same AdamW: bit-identical to FSDP2 at one rank
        assert r[name]["loss"] == 0.0 and r[name]["norm"] == 0.0 and r[name]["weights"] == 0.0, (
            name,
            r[name],
        )


def test_single_device_equals_fsdp2_at_one_rank(runs: dict[str, Any]) -> None:
    _check_equal(runs["one"], ["tied"])


@pytest.mark.slow
def test_single_device_equals_fsdp2_untied_lora_and_recompute() -> None:
    names = ["llama", "lora", "full_recompute"]
    _check_equal(run_distributed(job_compare, 1, names, timeout_s=240)[0], names)


def test_auto_choice_by_world_size(runs: dict[str, Any]) -> None:
    assert runs["one"]["auto_single"] is True and "world size 1" in runs["one"]["auto_reason"]
    assert all(r["auto_single"] is False for r in runs["two"])


def test_failed_step_and_infer_leave_the_masters(runs: dict[str, Any]) -> None:
    assert runs["one"]["failed_error"] == "InvalidInput" and runs["one"]["masters_back"]


def test_offload_onload_keeps_the_run(runs: dict[str, Any]) -> None:
    assert runs["one"]["offload"] == 0.0


def test_one_rank_checkpoint_resumes_at_two_ranks(runs: dict[str, Any]) -> None:
    for r in runs["two"]:
        # bf16 compute on other micro-batch splits: the losses agree to bf16 rounding; AdamW's
        # normalised update turns that noise into up to ~lr (1e-3) where a gradient is near zero, so
        # the weights agree within 0.3 lr (a resume that loaded nothing is off by a whole step)
        assert r["resume_weights"] < 3e-4 and r["resume_loss"] < 1e-4, r


def test_refused_configurations(runs: dict[str, Any]) -> None:
    r = runs["one"]
    assert "cpu_offload" in r["err_cpu_offload"] and "single_device" in r["err_cpu_offload"]
    assert "reshard_after_forward" in r["err_reshard"]
    assert all("world size 1" in t["err_world"] for t in runs["two"])
