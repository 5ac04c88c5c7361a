"""Per-rank bodies and references of the mcore LoRA tests (module level so ``run_distributed`` can
pickle them). References are peft models on the float64 (MoE: fp32) Hugging Face model of seed 0."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from tests.mcore import _helpers as H
from tests.mcore._workers import eng_dp_rank
from underlay.interfaces import EngineConfig, InvalidInput, LoraConfig, ModelConfig, TokenBatch

DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def hf_config(family: str, kind: str) -> Any:
    """The tiny config of ``family``; a value model's with ``num_labels=1`` and no classifier dropout."""
    cfg = H.tiny_config(family)
    if kind == "value":
        cfg.num_labels = 1
        cfg.classifier_dropout = 0.0
    return cfg


def write_adapter(root: str, family: str, kind: str, targets: Any, seed: int) -> str:
    """A peft adapter directory (``save_pretrained``) for the seed-0 model of ``family``, rank 4, alpha
    8, every A and B drawn from ``N(0, 0.1^2)`` (off peft's init, where B = 0 hides every A gradient).
    Runs in the test process (no megatron)."""
    from underlay.engines.fsdp2._build import build_model

    cfg = hf_config(family, kind)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=targets)
    model = build_model(ModelConfig(hf_config=cfg, seed=0, kind=kind, lora=lora), cfg, meta=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    out = Path(root) / f"adapter_{family}_{kind}_{seed}"
    model.save_pretrained(str(out))  # type: ignore[operator]
    return str(out)


def _reference_model(family: str, kind: str, adapter: str | None) -> Any:
    from peft import PeftModel

    from underlay.engines.fsdp2._build import build_model

    cfg = hf_config(family, kind)
    dtype = torch.float32 if getattr(cfg, "num_experts", 0) else torch.float64
    model = build_model(ModelConfig(hf_config=cfg, seed=0, kind=kind), cfg, meta=False).to(dtype)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True).to(dtype)
    return model


def reference(
    family: str, kind: str, adapter: str | None, batch: TokenBatch
) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """Per-token log-probs (values for ``kind="value"``) ``[B, S]`` of the peft model (the base model
    for ``adapter=None``), the token-mean loss of ``H.pg_loss`` (``H.value_loss``) over the whole
    batch and the adapter gradients under peft's saved names, in float64."""
    model = _reference_model(family, kind, adapter)
    m = batch.loss_mask.double()
    if kind == "value":
        model.train()
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[..., 0]
        out = out.double() * batch.attention_mask
        loss = (0.5 * (out - batch.extras["ret"].double()).pow(2) * m).sum() / m.sum()
    else:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        out = torch.cat([torch.zeros_like(lp[:, :1]), lp], 1).double() * batch.attention_mask
        loss = -(batch.extras["adv"].double()[:, None] * out * m).sum() / m.sum()
    grads: dict[str, torch.Tensor] = {}
    if adapter is not None:
        loss.backward()
        grads = {
            n.replace(".default.", "."): p.grad.detach().double()
            for n, p in model.named_parameters()
            if "lora_" in n and p.grad is not None
        }
    return out.detach(), float(loss), grads


def adapter_grads(eng: Any) -> dict[str, torch.Tensor]:
    """The reduced adapter gradients by peft name: megatron's ``main_grad`` gathered like the adapters."""
    eng.finalize_grads()
    saved = {}
    for c in eng.chunks:
        for p in c.parameters():
            if p.requires_grad:
                saved[p] = p.data.clone()
                p.data.copy_(p.main_grad.to(p.dtype))
    out = {n: t.double().clone() for n, t in eng.named_adapter_tensors()}
    for p, v in saved.items():
        p.data.copy_(v)
    return out


def _engine(family: str, kind: str, lora: LoraConfig, **sizes: Any) -> Any:
    opts = sizes.pop("opts", {})
    cfg = H.engine_config(hf_config(family, kind), kind=kind, **sizes, **opts)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=lora))
    return H.make_engine(cfg)


def _batch(kind: str, seed: int) -> TokenBatch:
    return H.value_batch(seed) if kind == "value" else H.make_batch(seed)


def _rel(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    if got.keys() != ref.keys():
        return float("inf")
    return max(float((got[n] - ref[n]).abs().max() / (ref[n].abs().max() + 1e-6)) for n in ref)


def check_against_peft(eng: Any, family: str, kind: str, adapter: str) -> dict[str, float]:
    """One forward_backward and step of ``eng`` (built from ``adapter``) against the peft reference:
    outputs (``infer``), loss, every adapter gradient, the grad norm; base parameters unchanged by the
    step while the adapters move; ``disable_adapter`` gives the base model and refuses training."""
    loss_fn = H.value_loss if kind == "value" else H.pg_loss
    dp = eng.layout.dp_shard
    full = _batch(kind, 3)
    rows = list(range(eng_dp_rank(eng), full.batch_size, dp))
    mine = full.select(rows)
    ref_out, ref_loss, ref_grads = reference(family, kind, adapter, full)
    base_out, _, _ = reference(family, kind, None, full)
    key = "values" if kind == "value" else "log_probs"
    out = getattr(eng.infer(mine), key).double()
    with eng.disable_adapter():
        off = getattr(eng.infer(mine), key).double()
        try:
            eng.forward_backward(mine, loss_fn)
            refused = 0.0
        except InvalidInput:
            refused = 1.0
    res = eng.forward_backward(mine, loss_fn)
    grads = adapter_grads(eng)
    base = {n: t.clone() for n, t in eng.named_full_parameters()}
    adapters = {n: t.clone() for n, t in eng.named_adapter_tensors()}
    step = eng.optimizer_step()
    ref_norm = float(sum(g.pow(2).sum() for g in ref_grads.values()) ** 0.5)
    frozen = all(torch.equal(base[n], t) for n, t in eng.named_full_parameters())
    moved = min(float((adapters[n] - t).abs().max()) for n, t in eng.named_adapter_tensors())
    return {
        "out": float((out - ref_out[rows]).abs().max()),
        "off": float((off - base_out[rows]).abs().max()),
        "on_vs_off": float((out - off).abs().max()),  # the adapters matter (not a vacuous check)
        "refused": refused,
        "loss": abs(res.metrics["loss"] - ref_loss),
        "grad_rel": _rel(grads, ref_grads),
        "n_grads": float(len(grads)),
        "norm_rel": abs(step.grad_norm - ref_norm) / ref_norm,
        "frozen": float(frozen),
        "moved": moved,
    }


def _continue(eng: Any, seed: int) -> dict[str, Any]:
    dp = eng.layout.dp_shard
    full = H.make_batch(seed)
    res = eng.forward_backward(full.select(list(range(eng_dp_rank(eng), full.batch_size, dp))), H.pg_loss)
    step = eng.optimizer_step()
    return {
        "loss": res.metrics["loss"],
        "norm": step.grad_norm,
        "adapters": {n: t.double().cpu() for n, t in eng.named_adapter_tensors()},
    }


def lora_layouts(rank: int, world: int, root: str, adapters: dict[str, str]) -> dict[str, Any]:
    """The LoRA properties at several layouts in one spawn (megatron's parallel state is torn down
    between them): (1) llama at TP=2 with sequence parallelism, policy and value model, against peft;
    export of the stepped adapters (peft reloads them) and of the merged weights (transformers reloads
    them); a checkpoint saved there; (2) llama at PP=2 against peft, then the checkpoint of (1)
    resumed there; (3) qwen3-MoE at EP=2 x DP=2 with attention adapters (experts frozen) against
    peft; (4) llama at DP=2, mcore against the fsdp2 engine from the same seeded adapters
    (``all-linear``) over two steps."""
    from megatron.core import parallel_state as ps

    from underlay.engines.mcore.weights import MCoreWeightLoader

    out: dict[str, Any] = {}
    loader = MCoreWeightLoader()
    lora = LoraConfig.from_adapter(adapters["llama"])

    # (1) TP=2 + SP
    eng = _engine("llama", "causal_lm", lora, tp=2, opts={"sequence_parallel": True})
    out["tp"] = check_against_peft(eng, "llama", "causal_lm", adapters["llama"])
    exported = loader.export_adapters(eng, Path(root) / "exported")
    merged = loader.export_hf(eng, Path(root) / "merged")
    batch = H.make_batch(4)
    lp_after = eng.infer(batch).log_probs.double()
    if rank == 0:
        from transformers import AutoModelForCausalLM

        assert exported is not None and merged is not None
        peft_after, _, _ = reference("llama", "causal_lm", str(exported), batch)
        out["export_peft"] = float((lp_after - peft_after).abs().max())
        hf = AutoModelForCausalLM.from_pretrained(str(merged)).double()
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], 1) * batch.attention_mask
        out["export_merged"] = float((lp_after - lp).abs().max())
    (Path(root) / "ckpt").mkdir(exist_ok=True)
    eng.save_checkpoint(Path(root) / "ckpt")
    out["tp_continue"] = _continue(eng, 9)
    del eng
    vlora = LoraConfig.from_adapter(adapters["llama_value"])
    veng = _engine("llama", "value", vlora, tp=2, opts={"sequence_parallel": True})
    out["tp_value"] = check_against_peft(veng, "llama", "value", adapters["llama_value"])
    del veng
    ps.destroy_model_parallel()

    # (2) PP=2, then resume (1)'s checkpoint
    eng = _engine("llama", "causal_lm", lora, pp=2)
    out["pp"] = check_against_peft(eng, "llama", "causal_lm", adapters["llama"])
    del eng
    eng = _engine("llama", "causal_lm", lora, pp=2)
    eng.load_checkpoint(Path(root) / "ckpt")
    out["pp_continue"] = _continue(eng, 9)
    del eng
    ps.destroy_model_parallel()

    # (3) qwen3-MoE, EP=2 x DP=2, attention adapters
    mlora = LoraConfig.from_adapter(adapters["qwen3_moe"])
    eng = _engine("qwen3_moe", "causal_lm", mlora, ep=2, opts={"distributed_optimizer": False})
    out["moe"] = check_against_peft(eng, "qwen3_moe", "causal_lm", adapters["qwen3_moe"])
    del eng
    ps.destroy_model_parallel()

    # (4) DP=2: mcore and fsdp2 from the same seeded adapters
    out["vs_fsdp2"] = _vs_fsdp2()
    return out


def _vs_fsdp2() -> dict[str, float]:
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.registry import get_device

    lora = LoraConfig(rank=4, alpha=8.0, target_modules="all-linear")
    mc = _engine("llama", "causal_lm", lora)
    base = H.engine_config(hf_config("llama", "causal_lm"))
    fcfg: EngineConfig = dataclasses.replace(base, model=dataclasses.replace(base.model, lora=lora))
    fs = FSDP2Engine(fcfg, get_device("cpu"))
    start = max(
        float((a - b).abs().max())
        for (_, a), (_, b) in zip(sorted(mc.named_adapter_tensors()), sorted(fs.named_adapter_tensors()))
    )
    worst: dict[str, float] = {"start": start, "params": 0.0, "loss": 0.0, "norm": 0.0, "merged": 0.0}
    for seed in (5, 6):
        m, f = _continue(mc, seed), _continue(fs, seed)
        worst["loss"] = max(worst["loss"], abs(m["loss"] - f["loss"]))
        worst["norm"] = max(worst["norm"], abs(m["norm"] - f["norm"]))
        diff = max(float((m["adapters"][n] - f["adapters"][n]).abs().max()) for n in m["adapters"])
        worst["params"] = max(worst["params"], diff)
    merged_f = dict(fs.named_full_tensors())
    worst["merged"] = max(float((t - merged_f[n]).abs().max()) for n, t in mc.named_full_tensors())
    worst["names"] = float(
        sorted(dict(mc.named_adapter_tensors())) == sorted(dict(fs.named_adapter_tensors()))
    )
    return worst
