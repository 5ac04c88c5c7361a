"""Multi-GPU checks of the FSDP2 engine and the vocab-parallel log-prob kernel (2 GPUs of one host,
NCCL; skipped with fewer). Ranks start through ``tests._dist.run_distributed`` (spawn on CUDA hosts).

- step: one fp32 engine step of a tiny Llama and a tiny Qwen3-MoE at 1 and 2 data-parallel ranks
  against a float64 torch reference on the host (padded HF eager forward, token-mean loss, clip,
  AdamW), and the 2-rank weights against the 1-rank ones; Ulysses sp=2 the same way;
- checkpoint: saved on 2 ranks, resumed on 1: the next step's loss and weights equal the saved ones;
- vocab-parallel log-prob: each rank holds a vocabulary shard of the head weight; log-probs and entropy
  within 1e-3 (absolute) of the unsharded kernel, gradients within 2e-2 (relative to their max).

fp32 on cuda (Triton's fp32 dots may use TF32): engine tolerance 2e-3.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H
from underlay.interfaces import ParallelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
    ),
]

TOL = 2e-3


def weights(engine: Any) -> dict[str, torch.Tensor]:
    """Full parameters under the transformers module's names (fused experts stay fused, as in the
    reference model; the checkpoint names ``iter_weights`` yields are the conformance suites' part)."""
    from underlay.engines.fsdp2._build import hf_name

    return {hf_name(n): t.detach().float().cpu().clone() for n, t in engine.named_full_parameters()}


def job_step(rank: int, world: int, sp: int, out_dir: str, compare: str | None) -> dict[str, Any]:
    """One fp32 step of a tiny Llama and Qwen3-MoE on this world (dp = world / sp) against the float64
    reference; rank 0 saves the weights under ``out_dir``; ``compare``: a 1-rank run's directory."""
    from underlay.registry import get_device

    dev = get_device("cuda")
    from underlay.engines.fsdp2.engine import FSDP2Engine

    res: dict[str, Any] = {}
    for arch, hf in (("llama", H.llama_config()), ("qwen3_moe", H.qwen3_moe_config())):
        ec = H.engine_config(copy.deepcopy(hf), parallel=ParallelConfig(ulysses=sp))
        engine = FSDP2Engine(ec, dev)
        sp = engine.layout.ulysses
        gb = H.global_batch(11)
        local = H.shard(gb, rank // sp, world // sp)
        inf = engine.infer(local, with_entropy=True)
        out = engine.forward_backward(local, H.pg_loss)
        st = engine.optimizer_step()
        w = weights(engine)
        ref = H.reference_model(copy.deepcopy(hf), 0)
        with torch.no_grad():
            ref_out = H.reference_outputs(ref, local)
        loss, norm, ref_w = H.reference_step(ref, gb, ec)
        res[f"{arch}_infer_logp"] = float((inf.log_probs.double().cpu() - ref_out.log_probs).abs().max())
        res[f"{arch}_loss"] = abs(out.metrics["loss"] - loss)
        res[f"{arch}_grad_norm"] = abs(st.grad_norm - norm)
        res[f"{arch}_weights"] = H.max_diff(w, ref_w)
        if rank == 0:
            torch.save(w, Path(out_dir) / f"step_{arch}_w{world}_sp{sp}.pt")
        if compare:
            other = torch.load(Path(compare) / f"step_{arch}_w1_sp1.pt", weights_only=True)
            res[f"{arch}_vs_1rank"] = H.max_diff(w, other)
        del engine
    return res


def job_save(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """One step, a checkpoint, a second step whose loss and weights rank 0 saves as the expectation."""
    from underlay.registry import get_device

    dev = get_device("cuda")
    from underlay.checkpoint import CheckpointManager
    from underlay.engines.fsdp2.engine import FSDP2Engine

    engine = FSDP2Engine(H.engine_config(H.llama_config()), dev)
    engine.forward_backward(H.shard(H.global_batch(1), rank, world), H.pg_loss)
    engine.optimizer_step()
    CheckpointManager(ckpt, engine).save(1, {"world": world})
    r2 = engine.forward_backward(H.shard(H.global_batch(2), rank, world), H.pg_loss)
    engine.optimizer_step()
    w = weights(engine)
    if rank == 0:
        torch.save({"loss2": r2.metrics["loss"], "w2": w}, Path(ckpt) / "expected.pt")
    return {"saved": 1.0}


def job_resume(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """Load the checkpoint saved at another world size and redo the second step."""
    from underlay.registry import get_device

    dev = get_device("cuda")
    from underlay.checkpoint import CheckpointManager
    from underlay.engines.fsdp2.engine import FSDP2Engine

    engine = FSDP2Engine(H.engine_config(H.llama_config()), dev)
    state = CheckpointManager(ckpt, engine).load()
    expected = torch.load(Path(ckpt) / "expected.pt", weights_only=True)
    r2 = engine.forward_backward(H.shard(H.global_batch(2), rank, world), H.pg_loss)
    engine.optimizer_step()
    return {
        "saved_world": float(state["world"]),
        "resume_loss": abs(r2.metrics["loss"] - expected["loss2"]),
        "resume_weights": H.max_diff(weights(engine), expected["w2"]),
    }


def run(
    kernel: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, g: Any, group: Any
) -> Any:
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    out = kernel(h, w, labels, with_entropy=True, vocab_group=group)
    (out.log_probs * g[0] + out.entropy * g[1]).sum().backward()
    return out.log_probs.detach(), out.entropy.detach(), h.grad, w.grad


def job_vocab_parallel(rank: int, world: int, tokens: int, hidden_size: int, vocab: int) -> dict[str, float]:
    """Sharded against unsharded kernel (and float64) on identical inputs on every rank."""
    from underlay.registry import get_device, get_logprob_kernel

    dev = get_device("cuda")
    device = dev.torch_device() if dev.is_accelerator else torch.device("cpu")
    dtype = torch.bfloat16 if dev.is_accelerator else torch.float32
    gen = torch.Generator().manual_seed(0)  # identical inputs on every rank
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(device, dtype)
    weight = (0.02 * torch.randn(vocab, hidden_size, generator=gen)).to(device, dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::17] = -100
    labels = labels.to(device)
    g = (
        torch.randn(tokens, generator=gen).to(device),
        torch.randn(tokens, generator=gen).to(device),
    )
    kernel = get_logprob_kernel()
    vl = vocab // world
    rows = slice(rank * vl, (rank + 1) * vl)
    lp_s, ent_s, gh_s, gw_s = run(kernel, hidden, weight[rows], labels, g, dist.group.WORLD)
    lp_f, ent_f, gh_f, gw_f = run(kernel, hidden, weight, labels, g, None)
    with torch.no_grad():
        logits = hidden.double() @ weight.double().T
        lsm = logits.log_softmax(-1)
        keep = labels >= 0
        lp_64 = lsm.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1) * keep
        ent_64 = -(lsm.exp() * lsm).sum(-1) * keep

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))

    res = {
        "logp_vs_unsharded": float((lp_s - lp_f).abs().max()),
        "entropy_vs_unsharded": float((ent_s - ent_f).abs().max()),
        "grad_hidden_rel": rel(gh_s, gh_f),
        "grad_weight_rel": rel(gw_s, gw_f[rows]),
        "logp_vs_fp64": float((lp_s.double() - lp_64).abs().max()),
        "entropy_vs_fp64": float((ent_s.double() - ent_64).abs().max()),
    }
    return res


def _errors(res: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in res.items() if k not in ("saved", "saved_world")}


@pytest.fixture(autouse=True)
def _no_nvls(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVLink multicast off, as the lent GPU hosts require."""
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")


def test_step_at_two_ranks_matches_reference_and_one_rank(tmp_path: Path) -> None:
    (one,) = run_distributed(job_step, 1, 1, str(tmp_path), None, backend="nccl", timeout_s=600)
    two = run_distributed(job_step, 2, 1, str(tmp_path), str(tmp_path), backend="nccl", timeout_s=600)
    for res in (one, *two):
        for key, err in _errors(res).items():
            assert err < TOL, (key, res)
    assert all(f"{arch}_vs_1rank" in two[0] for arch in ("llama", "qwen3_moe"))


def test_ulysses_sp2_matches_reference(tmp_path: Path) -> None:
    for res in run_distributed(job_step, 2, 2, str(tmp_path), None, backend="nccl", timeout_s=600):
        for key, err in _errors(res).items():
            assert err < TOL, (key, res)


def test_checkpoint_saved_on_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_distributed(job_save, 2, ckpt, backend="nccl", timeout_s=600)
    (res,) = run_distributed(job_resume, 1, ckpt, backend="nccl", timeout_s=600)
    assert res["saved_world"] == 2.0
    for key, err in _errors(res).items():
        assert err < TOL, (key, res)


def test_vocab_parallel_logprob_equals_unsharded() -> None:
    for res in run_distributed(job_vocab_parallel, 2, 4096, 1024, 32768, backend="nccl", timeout_s=300):
        assert res["logp_vs_unsharded"] < 1e-3 and res["entropy_vs_unsharded"] < 1e-3, res
        assert res["grad_hidden_rel"] < 2e-2 and res["grad_weight_rel"] < 2e-2, res
