"""The mcore engine on one CUDA GPU: correctness against float64 and against the fsdp2 engine.

1. fp32: log-probs of a packed variable-length batch (Qwen3 tiny, q/k norm, GQA) equal the float64 HF
   model's (< 2e-4), and one step's loss (< 1e-4 absolute) / gradient norm (< 1e-3 relative) equal the
   float64 ones.
2. bf16: the same step through mcore and through fsdp2 on 5 batches; each engine's loss and grad-norm
   error against float64 per batch. One batch's grad-norm error is a single scalar whose sign and size
   are luck (errors of the gradient entries partly cancel in the norm), so the test compares the root
   mean square over the batches: mcore's must be no larger than 1.5x fsdp2's (+ a 1e-4 floor).
3. A Qwen3-MoE step (bf16) runs with finite loss and grad norm and is not skipped.

Needs megatron-core (``bash scripts/gpu_wheels.sh`` fetches the wheel; ``scripts/test_gpu.sh --wheels``
installs it); skipped without it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from underlay.interfaces import EngineConfig, LossContext, ModelConfig, OptimConfig, TokenBatch, TokenOutputs
from underlay.ops import aggregate_loss

pytestmark = pytest.mark.gpu

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/gpu_wheels.sh)")

VOCAB = 512


def tiny(family: str) -> Any:
    import transformers as tf

    kw: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
        return tf.Qwen3MoeConfig(**kw)
    return tf.Qwen3Config(**kw)


def batch(device: torch.device, seed: int = 0) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    b, s = 8, 200
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    lens = torch.randint(20, s + 1, (b,), generator=g)
    mask = (torch.arange(s)[None] < lens[:, None]).long()
    loss = mask.clone()
    loss[:, :10] = 0
    return TokenBatch(ids * mask, mask, loss, {"adv": torch.randn(b, generator=g)}).to(device)


def pg_loss(
    out: TokenOutputs, b: TokenBatch, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    assert out.log_probs is not None
    return aggregate_loss(
        -(b.extras["adv"][:, None].float() * out.log_probs), b.loss_mask, "token-mean", ctx
    ), {}


def reference(cfg: Any, b: TokenBatch) -> tuple[torch.Tensor, float, float]:
    """float64 HF: token-aligned log-probs, token-mean loss, gradient norm."""
    from underlay.engines.fsdp2._build import build_model

    model = build_model(ModelConfig(hf_config=cfg, seed=0), cfg, meta=False).double().to(b.input_ids.device)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], 1) * b.attention_mask
    m = b.loss_mask.double()
    loss = -(b.extras["adv"].double()[:, None] * lp * m).sum() / m.sum()
    loss.backward()
    norm = math.sqrt(
        sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    )
    return lp.detach(), float(loss), norm


def engine_cfg(cfg: Any, dtype: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(hf_config=cfg, seed=0),
        optim=OptimConfig(lr=1e-5, grad_clip=1e9),
        micro_batch_max_tokens=512,
        param_dtype=dtype,
        reduce_dtype="float32",
        with_entropy=False,
    )


def step(name: str, cfg: Any, dtype: str, b: TokenBatch) -> dict[str, Any]:
    from underlay.registry import get_engine

    eng = get_engine(engine_cfg(cfg, dtype), name)
    lp = eng.infer(b).log_probs
    res = eng.forward_backward(b, pg_loss)
    opt = eng.optimizer_step()
    out = {"loss": res.metrics["loss"], "grad_norm": opt.grad_norm, "skipped": opt.skipped, "lp": lp}
    del eng
    torch.cuda.empty_cache()
    return out


def test_mcore_fp32_matches_float64() -> None:
    cfg = tiny("qwen3")
    b = batch(torch.device("cuda"))
    ref_lp, ref_loss, ref_norm = reference(cfg, b)
    m32 = step("mcore", cfg, "float32", b)
    assert float((m32["lp"].double() - ref_lp).abs().max()) < 2e-4
    assert abs(m32["loss"] - ref_loss) < 1e-4, (m32["loss"], ref_loss)
    assert abs(m32["grad_norm"] - ref_norm) / ref_norm < 1e-3, (m32["grad_norm"], ref_norm)


def test_mcore_moe_bf16_step_is_finite() -> None:
    moe = step("mcore", tiny("qwen3_moe"), "bfloat16", batch(torch.device("cuda")))
    assert math.isfinite(moe["loss"]) and math.isfinite(moe["grad_norm"]) and not moe["skipped"], moe


def test_mcore_bf16_error_no_larger_than_fsdp2() -> None:
    cfg = tiny("qwen3")
    per_seed: dict[str, dict[str, list[float]]] = {
        n: {"loss_err": [], "norm_rel": []} for n in ("mcore", "fsdp2")
    }
    for seed in range(5):
        bs = batch(torch.device("cuda"), seed)
        _, s_loss, s_norm = reference(cfg, bs)
        for name in ("mcore", "fsdp2"):
            r = step(name, cfg, "bfloat16", bs)
            per_seed[name]["loss_err"].append(abs(r["loss"] - s_loss))
            per_seed[name]["norm_rel"].append(abs(r["grad_norm"] - s_norm) / s_norm)
    rms = {
        name: {key: math.sqrt(sum(x * x for x in xs) / len(xs)) for key, xs in d.items()}
        for name, d in per_seed.items()
    }
    for key in ("loss_err", "norm_rel"):
        assert rms["mcore"][key] <= 1.5 * rms["fsdp2"][key] + 1e-4, (key, rms, per_seed)


def test_mcore_lora_on_cuda(tmp_path: Any) -> None:
    """LoRA on mcore (``engines.mcore.lora``) on cuda. fp32, adapters drawn off peft's init: log-probs
    equal peft's float64 model (< 2e-4) and the step's loss and grad norm (adapters only) equal its
    float64 ones. bf16, seeded adapters: three steps move the adapters and leave every base weight
    bit-unchanged, and ``disable_adapter()`` log-probs are bit-equal to a LoRA-free engine's."""
    import dataclasses

    from peft import PeftModel

    from underlay.engines.fsdp2._build import build_model
    from underlay.interfaces import LoraConfig
    from underlay.registry import get_engine

    cfg = tiny("qwen3")
    b = batch(torch.device("cuda"), 3)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lora = LoraConfig(rank=8, alpha=16.0, target_modules=targets)
    seeded = build_model(ModelConfig(hf_config=cfg, seed=0, lora=lora), cfg, meta=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in seeded.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    seeded.save_pretrained(str(tmp_path / "adapter"))  # type: ignore[operator]
    ref = build_model(ModelConfig(hf_config=cfg, seed=0), cfg, meta=False).double()
    ref = PeftModel.from_pretrained(ref, str(tmp_path / "adapter"), is_trainable=True).double().cuda()
    logits = ref(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    ref_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None])[..., 0]
    ref_lp = torch.cat([torch.zeros_like(ref_lp[:, :1]), ref_lp], 1) * b.attention_mask
    m = b.loss_mask.double()
    ref_loss = -(b.extras["adv"].double()[:, None] * ref_lp * m).sum() / m.sum()
    ref_loss.backward()
    ref_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for n, p in ref.named_parameters() if "lora_" in n))

    def with_lora(dtype: str, lc: LoraConfig | None) -> EngineConfig:
        base = engine_cfg(cfg, dtype)
        return dataclasses.replace(base, model=dataclasses.replace(base.model, lora=lc))

    eng = get_engine(with_lora("float32", LoraConfig.from_adapter(str(tmp_path / "adapter"))), "mcore")
    lp = eng.infer(b).log_probs
    assert float((lp.double() - ref_lp.detach()).abs().max()) < 2e-4
    res = eng.forward_backward(b, pg_loss)
    opt = eng.optimizer_step()
    assert abs(res.metrics["loss"] - float(ref_loss)) < 1e-4, (res.metrics["loss"], float(ref_loss))
    assert abs(opt.grad_norm - ref_norm) / ref_norm < 1e-3, (opt.grad_norm, ref_norm)
    del eng
    torch.cuda.empty_cache()

    plain = get_engine(with_lora("bfloat16", None), "mcore")
    base_lp = plain.infer(b).log_probs
    del plain
    eng = get_engine(with_lora("bfloat16", LoraConfig(rank=8, alpha=16.0, target_modules=targets)), "mcore")
    before = {n: t.clone() for n, t in eng.named_full_parameters()}
    adapters = {n: t.clone() for n, t in eng.named_adapter_tensors()}
    for seed in (4, 5, 6):
        eng.forward_backward(batch(torch.device("cuda"), seed), pg_loss)
        out = eng.optimizer_step()
        assert math.isfinite(out.grad_norm) and not out.skipped, out
    assert all(torch.equal(before[n], t) for n, t in eng.named_full_parameters())
    assert min(float((adapters[n] - t).abs().max()) for n, t in eng.named_adapter_tensors()) > 0
    with eng.disable_adapter():
        off = eng.infer(b).log_probs
    assert torch.equal(off, base_lp)
    assert not torch.equal(eng.infer(b).log_probs, base_lp)
