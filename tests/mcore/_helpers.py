"""Shared pieces of the mcore tests: tiny HF configs, engine construction under the CPU fixture, and an
HF float64 reference of per-token log-probs and the token-mean loss gradient."""

from __future__ import annotations

import copy
from typing import Any

import torch

from underlay.interfaces import (
    EngineConfig,
    LossContext,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TokenBatch,
)
from underlay.ops import aggregate_loss

VOCAB = 128


def tiny_config(family: str, **over: Any) -> Any:
    """A 4-layer tiny HF config of ``family`` (llama, mistral, qwen2, qwen2_tied, qwen3, qwen3_moe)."""
    import transformers as tf

    base: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    if family == "llama":
        cls = tf.LlamaConfig
    elif family == "mistral":
        cls = tf.MistralConfig
        base["sliding_window"] = None
    elif family in ("qwen2", "qwen2_tied"):
        cls = tf.Qwen2Config
        base["tie_word_embeddings"] = family == "qwen2_tied"
    elif family == "qwen3":
        cls = tf.Qwen3Config
        base["head_dim"] = 16
    elif family == "qwen3_moe":
        cls = tf.Qwen3MoeConfig
        base.update(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    else:
        raise ValueError(family)
    base.update(over)
    return cls(**base)


def engine_config(
    hf_config: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    vpp: int = 1,
    cp: int = 1,
    kind: str = "causal_lm",
    **options: Any,
) -> EngineConfig:
    """fp32 engine config (seed 0) for ``hf_config`` with the given sizes and mcore options."""
    return EngineConfig(
        model=ModelConfig(hf_config=hf_config, seed=0, kind=kind),  # type: ignore[arg-type]
        parallel=ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, cp=cp),
        optim=OptimConfig(lr=1e-3, eps=1e-4, weight_decay=0.01, grad_clip=1.0),
        micro_batch_max_tokens=24,
        param_dtype="float32",
        reduce_dtype="float32",
        with_entropy=True,
        options=options,
    )


def make_engine(cfg: EngineConfig) -> Any:
    """An ``MCoreEngine`` on the CPU under the test fixture."""
    from tests.mcore._cpu_fixture import install

    install()
    from underlay.engines.mcore.engine import MCoreEngine
    from underlay.registry import get_device

    return MCoreEngine(cfg, get_device("cpu"))


def make_batch(seed: int, b: int = 4, s: int = 12) -> TokenBatch:
    """Right-padded random batch with varied lengths (>= 3 tokens) and a loss mask past the prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    lens = torch.randint(3, s + 1, (b,), generator=g)
    mask = (torch.arange(s)[None] < lens[:, None]).long()
    loss = mask.clone()
    loss[:, :2] = 0
    adv = torch.randn(b, generator=g)
    return TokenBatch(ids * mask, mask, loss, {"adv": adv})


def pg_loss(
    outputs: Any, batch: TokenBatch, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token mean of ``-adv * log_prob`` (a policy-gradient surrogate, ``ops.aggregate_loss``
    "token-mean"), plus the token mean of the entropy (a contribution)."""
    m = batch.loss_mask.to(outputs.log_probs.dtype)
    adv = batch.extras["adv"][:, None]
    loss = aggregate_loss(-adv * outputs.log_probs, batch.loss_mask, "token-mean", ctx)
    return loss, {"entropy": (outputs.entropy * m).sum().detach() / max(ctx.global_loss_tokens, 1)}


def hf_reference(
    hf_config: Any, batch: TokenBatch
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """float64 HF model (fp32 for MoE; seed 0): per-token log-probs ``[B, S]`` (token aligned), the token-mean
    pg loss, and the gradients of that loss by HF parameter name (per-expert names)."""
    from underlay.engines.fsdp2._build import build_model
    from underlay.engines.mcore._hf import per_expert_names

    model = build_model(ModelConfig(hf_config=hf_config, seed=0), hf_config, meta=False)
    # transformers' grouped expert matmul has no float64 kernel: MoE references run in fp32
    model = model.float() if getattr(hf_config, "num_experts", 0) else model.double()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], 1) * batch.attention_mask
    lp = lp.double()
    m = batch.loss_mask.double()
    loss = -(batch.extras["adv"].double()[:, None] * lp * m).sum() / m.sum()
    loss.backward()
    grads = per_expert_names(
        {
            n: (p.grad.detach() if p.grad is not None else torch.zeros_like(p)).double()
            for n, p in model.named_parameters()
        }
    )
    return lp.detach(), loss.detach(), grads


def value_batch(seed: int, b: int = 4, s: int = 12) -> TokenBatch:
    """``make_batch`` with per-token returns ``extras["ret"] [B, S]`` for a value loss."""
    base = make_batch(seed, b, s)
    g = torch.Generator().manual_seed(seed + 1000)
    ret = torch.randn(b, s, generator=g)
    return TokenBatch(base.input_ids, base.attention_mask, base.loss_mask, {"ret": ret})


def value_loss(
    outputs: Any, batch: TokenBatch, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token mean of ``0.5 * (value - ret)^2``, plus the token mean of the values (a contribution)."""
    m = batch.loss_mask.to(outputs.values.dtype)
    err = outputs.values - batch.extras["ret"].to(outputs.values.dtype)
    loss = aggregate_loss(0.5 * err.pow(2), batch.loss_mask, "token-mean", ctx)
    return loss, {"value": (outputs.values * m).sum().detach() / max(ctx.global_loss_tokens, 1)}


def hf_value_reference(
    hf_config: Any, batch: TokenBatch
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """float64 HF token-classification model (``num_labels=1``, seed 0, the fsdp2 engine's build) in
    training mode: per-token values ``[B, S]`` (0 at padding), the token-mean value loss and its
    gradients by HF name. Configs here set ``classifier_dropout=0`` so training mode is deterministic."""
    from underlay.engines.fsdp2._build import build_model

    cfg = copy.deepcopy(hf_config)
    model = build_model(ModelConfig(hf_config=cfg, seed=0, kind="value"), cfg, meta=False).double()
    model.train()
    values = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[..., 0]
    values = values * batch.attention_mask
    m = batch.loss_mask.double()
    loss = (0.5 * (values - batch.extras["ret"].double()).pow(2) * m).sum() / m.sum()
    loss.backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    return values.detach(), loss.detach(), grads
