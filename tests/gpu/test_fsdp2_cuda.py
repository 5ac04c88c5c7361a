"""The FSDP2 engine step on cuda in bf16 with the cuda attention and log-prob kernels, world of 1 (NCCL).

For tiny random Llama / Qwen2 / Qwen3-MoE models one engine step (bf16 compute, fp32 master weights and
reduction, packed micro-batches of 2048 tokens) is compared with a plain float64 torch reference of the
same model and loss (padded HF eager forward, token-mean loss, global-norm clip, AdamW; no FSDP, no
underlay code; run on the host):

- ``loss`` / ``grad_norm``: relative errors (bf16 tolerance: 2e-2 / 5e-2);
- ``upd_cos``: cosine between the engine's and the reference's weight update (>= 0.95);
- ``infer``: mean |log-prob error| of ``engine.infer`` (<= 5e-2).

Then, on the Llama engine: ``offload()`` frees device memory (measured) and ``onload()`` restores
parameters, gradients and optimizer state bit-exactly; the same step with ``cpu_offload=True``, with
activation checkpointing and with optimizer offload gives the same loss (relative 1e-3); the engine
defaults and the compiled variants within 1e-2 (compiled kernels round bf16 differently).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H
from underlay.interfaces import EngineConfig, ModelConfig, OptimConfig, TokenBatch

pytestmark = pytest.mark.gpu


def tiny(arch: str, quick: bool = False) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    kw: dict[str, Any] = dict(
        vocab_size=512 if quick else 4096,
        hidden_size=64 if quick else 256,
        intermediate_size=128 if quick else 688,
        num_hidden_layers=2,
        num_attention_heads=4 if quick else 8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    if arch == "qwen3_moe":
        kw.update(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
        return Qwen3MoeConfig(head_dim=16 if quick else 32, **kw)
    return (Qwen2Config if arch == "qwen2" else LlamaConfig)(**kw)


def batch(vocab: int, n: int, max_len: int, seed: int) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max_len // 4, max_len + 1, (n,), generator=g)
    pos = torch.arange(max_len)[None]
    attn = (pos < lens[:, None]).long()
    ids = torch.randint(0, vocab, (n, max_len), generator=g) * attn
    loss_mask = ((pos >= 16) & (attn == 1)).long()
    return TokenBatch(ids, attn, loss_mask, {"advantages": torch.randn(n, generator=g)})


def engine_cfg(hf: Any, dtype: str, **over: Any) -> EngineConfig:
    kw: dict[str, Any] = dict(
        model=ModelConfig(hf_config=copy.deepcopy(hf), seed=0),
        optim=OptimConfig(lr=1e-3, eps=1e-6, weight_decay=0.01, grad_clip=1.0),
        micro_batch_max_tokens=2048,
        param_dtype=dtype,
        reduce_dtype="float32",
    )
    kw.update(over)
    return EngineConfig(**kw)


def fp32_weights(engine: Any) -> dict[str, torch.Tensor]:
    """Full weights under the transformers module's names (fused experts stay fused, as in the reference)."""
    from underlay.engines.fsdp2._build import hf_name

    return {hf_name(n): t.float().cpu().clone() for n, t in engine.named_full_parameters()}


def snapshot(engine: Any) -> list[torch.Tensor]:
    out = []
    for p in engine.model.parameters():
        out.append(H.local(p).detach().clone())
        if p.grad is not None:
            out.append(H.local(p.grad).detach().clone())
    for st in engine.optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                out.append((v.to_local() if hasattr(v, "to_local") else v).detach().clone())
    return out


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    x = torch.cat([a[k].double().flatten() for k in sorted(a)])
    y = torch.cat([b[k].double().flatten() for k in sorted(a)])
    return float(x @ y / (x.norm() * y.norm()).clamp_min(1e-30))


def run_arch(arch: str, dev: Any, quick: bool) -> dict[str, Any]:
    from underlay.engines.fsdp2.engine import FSDP2Engine

    hf = tiny(arch, quick)
    gb = batch(hf.vocab_size, 8 if quick else 16, 64 if quick else 256, seed=1)
    ec = engine_cfg(hf, "bfloat16")
    engine = FSDP2Engine(ec, dev)
    w0 = fp32_weights(engine)
    inf = engine.infer(gb)
    t0 = time.perf_counter()
    res = engine.forward_backward(gb, H.pg_loss)
    st = engine.optimizer_step()
    dev.synchronize()
    step_s = time.perf_counter() - t0
    w1 = fp32_weights(engine)
    ref = H.reference_model(copy.deepcopy(hf), 0)
    ref_w0 = H.merged_weights(ref)
    with torch.no_grad():
        ref_out = H.reference_outputs(ref, gb)
    loss, norm, ref_w1 = H.reference_step(ref, gb, ec)
    mask = gb.attention_mask.bool()
    infer_err = float((inf.log_probs.double().cpu() - ref_out.log_probs)[mask].abs().mean())
    row = {
        "arch": arch,
        "loss": res.metrics["loss"],
        "ref_loss": loss,
        "loss_rel": abs(res.metrics["loss"] - loss) / abs(loss),
        "grad_norm": st.grad_norm,
        "ref_grad_norm": norm,
        "norm_rel": abs(st.grad_norm - norm) / norm,
        "upd_cos": cosine({k: w1[k] - w0[k] for k in w0}, {k: ref_w1[k] - ref_w0[k] for k in w0}),
        "infer_err": infer_err,
        "micro_batches": res.num_micro_batches,
        "step_s": step_s,
    }
    return row


def offload_checks(dev: Any, quick: bool) -> dict[str, Any]:
    from underlay.engines.fsdp2.engine import FSDP2Engine

    hf = tiny("llama", quick)
    gb = batch(hf.vocab_size, 8 if quick else 16, 64 if quick else 256, seed=2)
    out: dict[str, Any] = {}
    losses = {}
    for name, over in (
        # eager rows say compile=False: on cuda the engine compiles whole layers by default
        ("plain", {"recompute": "none", "options": {"compile": False}}),
        ("cpu_offload", {"cpu_offload": True, "recompute": "none", "options": {"compile": False}}),
        ("act_ckpt", {"recompute": "full", "options": {"compile": False}}),
        # AdamW state in host memory, streamed through the device: the same update as "plain"
        (
            "optimizer_offload",
            {"recompute": "none", "options": {"compile": False, "optimizer_offload": True}},
        ),
        ("defaults", {}),  # no options: the engine's auto choices
        ("compiled", {"recompute": "full", "options": {"compile": True}}),
        # whole layers compiled with the attention call in the graph, parameters kept unsharded
        ("compiled_layer", {"options": {"compile": "layer", "reshard_after_forward": False}}),
        ("compiled_layer_ckpt", {"recompute": "full", "options": {"compile": "layer"}}),
    ):
        dev.empty_cache()
        dev.reset_peak_memory_stats()
        engine = FSDP2Engine(engine_cfg(hf, "bfloat16", **over), dev)
        res = engine.forward_backward(gb, H.pg_loss)
        engine.optimizer_step()
        res = engine.forward_backward(gb, H.pg_loss)
        losses[name] = res.metrics["loss"]
        out[f"{name}_peak_mib"] = dev.memory_stats().peak_allocated / 2**20
        if name == "plain":
            before = snapshot(engine)
            dev.synchronize()
            alloc0 = dev.memory_stats().allocated
            engine.offload()
            alloc1 = dev.memory_stats().allocated
            engine.onload()
            after = snapshot(engine)
            out["offload_freed_mib"] = (alloc0 - alloc1) / 2**20
            out["onload_exact"] = len(before) == len(after) and all(
                torch.equal(a, b) for a, b in zip(before, after)
            )
            engine.optimizer_step()
        del engine
    out["cpu_offload_loss_rel"] = abs(losses["cpu_offload"] - losses["plain"]) / abs(losses["plain"])
    for name in (
        "act_ckpt",
        "optimizer_offload",
        "defaults",
        "compiled",
        "compiled_layer",
        "compiled_layer_ckpt",
    ):
        out[f"{name}_loss_rel"] = abs(losses[name] - losses["plain"]) / abs(losses["plain"])
    return out


def job_arch(rank: int, world: int, arch: str) -> dict[str, Any]:
    """One engine step of ``arch`` against the float64 reference (a rank of ``run_distributed``)."""
    from underlay.registry import get_device

    return run_arch(arch, get_device("cuda"), quick=False)


def job_offload(rank: int, world: int) -> dict[str, Any]:
    """The offload, recompute and compile variants of the Llama step (a rank of ``run_distributed``)."""
    from underlay.registry import get_device

    return offload_checks(get_device("cuda"), quick=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe"])
def test_bf16_step_matches_float64_reference(arch: str) -> None:
    (row,) = run_distributed(job_arch, 1, arch, backend="nccl", timeout_s=600)
    assert math.isfinite(row["loss"]), row
    assert row["loss_rel"] < 2e-2 and row["norm_rel"] < 5e-2, row
    assert row["upd_cos"] >= 0.95 and row["infer_err"] <= 5e-2, row


def test_offload_recompute_and_compile_keep_the_step() -> None:
    (out,) = run_distributed(job_offload, 1, backend="nccl", timeout_s=900)
    assert out["onload_exact"] and out["offload_freed_mib"] > 0, out
    for name in ("cpu_offload", "act_ckpt", "optimizer_offload"):
        assert out[f"{name}_loss_rel"] < 1e-3, (name, out)
    for name in ("defaults", "compiled", "compiled_layer", "compiled_layer_ckpt"):
        assert out[f"{name}_loss_rel"] < 1e-2, (name, out)
