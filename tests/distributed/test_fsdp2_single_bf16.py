"""The fsdp2 world-size-1 path (``options.single_device``) in bf16 (bf16 compute copies, fp32 masters):
``infer`` sees every change of the masters. Its compute copies are built by a first ``infer``; then
``load_hf`` replaces every master and an optimizer step moves them, and each following ``infer`` must
return the log-probs of FSDP2 at one rank (which casts the masters afresh on every forward), bit for
bit. A compute view left stale by either change gives the log-probs of the previous weights."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

PHASES = ("init", "load_hf", "step")


def _save_checkpoint(hf: Any, where: Path) -> None:
    """A Hugging Face checkpoint of ``hf`` whose every parameter is off both its init and the engine's
    seed-0 init (so ``load_hf`` changes every master)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(hf))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(where))


def job(rank: int, world: int, root: str) -> dict[str, Any]:
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader
    from underlay.registry import get_device

    dev = get_device("cpu")
    hf = H.llama_config()
    ckpt = Path(root) / "hf"
    _save_checkpoint(hf, ckpt)
    probe = H.global_batch(7)
    out: dict[str, Any] = {}
    for single in (True, False):
        cfg = H.engine_config(
            copy.deepcopy(hf), param_dtype="bfloat16", options={"single_device": single}, max_tokens=24
        )
        engine = FSDP2Engine(cfg, dev)
        lps = [engine.infer(probe).log_probs]  # builds the compute copies from the seed-0 init
        FSDP2WeightLoader(dev).load_hf(engine, ckpt)
        lps.append(engine.infer(probe).log_probs)
        engine.forward_backward(H.global_batch(8), H.pg_loss)
        step = engine.optimizer_step()
        lps.append(engine.infer(probe).log_probs)
        key = "single" if single else "fsdp2"
        out[key] = {p: t.detach().cpu().clone() for p, t in zip(PHASES, lps, strict=True)}
        out[f"{key}_skipped"] = step.skipped
        out[f"{key}_options"] = engine.options.single_device
        out[f"{key}_masters"] = {str(p.dtype) for p in engine.model.parameters()}
        out[f"{key}_compute"] = str(engine._single.compute_dtype) if engine._single is not None else None
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_distributed(job, 1, str(tmp_path_factory.mktemp("single_bf16")), timeout_s=240)[0]


def test_the_paths_ran_in_bf16_with_fp32_masters(run: dict[str, Any]) -> None:
    assert run["single_options"] is True and run["fsdp2_options"] is False
    assert run["single_masters"] == {"torch.float32"} == run["fsdp2_masters"]
    assert run["single_compute"] == "torch.bfloat16" and run["fsdp2_compute"] is None
    assert run["single_skipped"] is False and run["fsdp2_skipped"] is False


def test_infer_after_load_hf_and_step_equals_fsdp2(run: dict[str, Any]) -> None:
    for phase in PHASES:
        a, b = run["single"][phase], run["fsdp2"][phase]
        # same fp32 -> bf16 casts of the same masters, same kernels: bit-identical
        assert torch.equal(a, b), (phase, float((a - b).abs().max()))
    # each change moves the log-probs well beyond bf16 noise, so a stale compute view cannot pass
    for before, after in itertools.pairwise(PHASES):
        moved = (run["fsdp2"][after] - run["fsdp2"][before]).abs().max()
        assert float(moved) > 1e-3, (before, after, float(moved))
