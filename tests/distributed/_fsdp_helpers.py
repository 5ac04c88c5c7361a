"""Shared pieces of the FSDP2 engine tests: tiny models, batches, a GRPO-like loss, and a plain
float64 torch reference of one training step (no FSDP, no packing, no underlay code)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from underlay.interfaces import (
    EngineConfig,
    LoraConfig,
    LossContext,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TokenBatch,
    TokenOutputs,
)
from underlay.ops import aggregate_loss

VOCAB = 128
SEQ = 12


def llama_config(**over: Any) -> Any:
    """A 2-layer Llama, hidden 32, GQA 4 q / 2 kv heads, vocab 128."""
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    kw.update(over)
    return LlamaConfig(**kw)


def qwen2_tied_config() -> Any:
    """A 2-layer Qwen2 with tied input/output embeddings (the benchmark's shape, tiny)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def qwen3_moe_config() -> Any:
    """A 2-layer Qwen3-MoE, hidden 32, 4 experts (top-2), vocab 128."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def engine_config(
    hf_config: Any,
    *,
    lora: LoraConfig | None = None,
    parallel: ParallelConfig | None = None,
    max_tokens: int = 20,
    seed: int = 0,
    **over: Any,
) -> EngineConfig:
    """fp32 engine config (exact comparisons) with small micro-batches and a visible AdamW step."""
    kw: dict[str, Any] = dict(
        model=ModelConfig(hf_config=hf_config, seed=seed, lora=lora),
        parallel=parallel or ParallelConfig(),
        optim=OptimConfig(lr=1e-3, eps=1e-6, weight_decay=0.01, grad_clip=0.5),
        micro_batch_max_tokens=max_tokens,
        param_dtype="float32",
        reduce_dtype="float32",
        with_entropy=True,
    )
    kw.update(over)
    return EngineConfig(**kw)


def global_batch(seed: int, n: int = 6) -> TokenBatch:
    """``n`` right-padded sequences of lengths 4..SEQ with a response mask and advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    lens = torch.randint(4, SEQ + 1, (n,), generator=g)
    pos = torch.arange(SEQ)[None, :]
    attn = (pos < lens[:, None]).long()
    prompt = torch.randint(1, 3, (n,), generator=g)
    loss_mask = ((pos >= prompt[:, None]) & (attn == 1)).long()
    adv = torch.randn(n, generator=g)
    return TokenBatch(ids * attn, attn, loss_mask, {"advantages": adv})


def shard(batch: TokenBatch, rank: int, world: int) -> TokenBatch:
    """Rows ``rank::world`` (this rank's share of the global batch)."""
    return batch.select(list(range(rank, batch.batch_size, world)))


def pg_loss(
    outputs: TokenOutputs, batch: TokenBatch, ctx: LossContext
) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    """Policy-gradient-like token-mean loss (``ops.aggregate_loss`` "token-mean"), plus the token means
    of the log-probs and of the entropy as metrics (contributions: sums of ``x / N``)."""
    assert outputs.log_probs is not None
    mask = batch.loss_mask.to(outputs.log_probs.dtype)
    adv = batch.extras["advantages"].to(outputs.log_probs.dtype)[:, None]
    per_token = -adv * outputs.log_probs + 0.1 * outputs.log_probs**2
    n = max(ctx.global_loss_tokens, 1)
    metrics: dict[str, torch.Tensor] = {"logp_sum": (outputs.log_probs * mask).sum().detach() / n}
    if outputs.entropy is not None:
        metrics["entropy"] = (outputs.entropy * mask).sum().detach() / n
    return aggregate_loss(per_token, batch.loss_mask, "token-mean", ctx), metrics


def value_loss(
    outputs: TokenOutputs, batch: TokenBatch, ctx: LossContext
) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    """Token-mean squared error of values against the advantages (as returns)."""
    assert outputs.values is not None
    ret = batch.extras["advantages"].to(outputs.values.dtype)[:, None]
    return aggregate_loss((outputs.values - ret) ** 2, batch.loss_mask, "token-mean", ctx), {}


def reference_model(
    hf_config: Any, seed: int, lora: LoraConfig | None = None, kind: str = "causal_lm"
) -> Any:
    """The single-process model the engine must equal: same seed, transformers' own init, float64."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "value":
            hf_config.num_labels = 1
            model = AutoModelForTokenClassification.from_config(hf_config, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        if lora is not None:
            from peft import LoraConfig as PLC
            from peft import get_peft_model

            model = get_peft_model(
                model,
                PLC(
                    r=lora.rank,
                    lora_alpha=lora.alpha,
                    lora_dropout=0.0,
                    target_modules=list(lora.target_modules),
                    bias="none",
                ),
            )
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.set_attn_implementation("eager")
    moe = any(
        getattr(inner.config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")
    )
    if moe and hasattr(inner, "set_experts_implementation"):
        inner.set_experts_implementation("eager")  # grouped_mm has no float64
    return model.double()


def reference_outputs(
    model: Any, batch: TokenBatch, kind: str = "causal_lm", mask_keys: bool = True
) -> TokenOutputs:
    """Padded HF forward in float64: per-token log-probs (aligned to the scored token) and entropy,
    or values. ``mask_keys=False`` runs without the attention mask, which is exact for right-padded
    batches (causal: real tokens never see the padding after them) and avoids transformers 5's float64
    sliding-window padding mask, which gives NaN."""
    pos = (batch.attention_mask.cumsum(1) - 1).clamp(min=0)
    mask = batch.attention_mask if mask_keys else None
    out = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=pos)
    mask = batch.attention_mask.to(torch.float64)
    if kind == "value":
        return TokenOutputs(None, None, out.logits.squeeze(-1) * mask)
    lsm = torch.log_softmax(out.logits.to(torch.float64), dim=-1)
    lp = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    lp[:, 1:] = lsm[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ent = torch.zeros_like(lp)
    ent[:, 1:] = -(lsm[:, :-1].exp() * lsm[:, :-1]).sum(-1)
    return TokenOutputs(lp * mask, ent * mask, None)


def hf_names(model: Any) -> dict[str, torch.nn.Parameter]:
    """Parameters of a (peft) reference model under their Hugging Face names."""
    out = {}
    for n, p in model.named_parameters():
        n = n.removeprefix("base_model.model.").replace(".base_layer.", ".")
        out[n] = p
    return out


def reference_step(
    model: Any,
    batch: TokenBatch,
    cfg: EngineConfig,
    loss_fn: Any = pg_loss,
    kind: str = "causal_lm",
    mask_keys: bool = True,
) -> tuple[float, float, dict[str, torch.Tensor]]:
    """One full-batch float64 step: token-mean loss, backward, global-norm clip, AdamW.
    Returns ``(loss, grad_norm, merged HF-named weights after the step)``. ``mask_keys``: see
    :func:`reference_outputs`."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    out = reference_outputs(model, batch, kind, mask_keys)
    loss, _ = loss_fn(out, batch, LossContext.single(batch.loss_mask))
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or math.inf))
    opt.step()
    return float(loss.detach()), norm, merged_weights(model)


@torch.no_grad()
def merged_weights(model: Any) -> dict[str, torch.Tensor]:
    """HF-named weights with LoRA adapters merged (``W + scaling * B @ A``), adapters dropped."""
    named = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    scalings = {
        n: m.scaling for n, m in model.named_modules() if hasattr(m, "scaling") and hasattr(m, "lora_A")
    }
    for n, p in named.items():
        if "lora_" in n:
            continue
        w = p.detach().clone()
        if ".base_layer." in n:
            prefix = n.split(".base_layer.")[0]
            a, b = named[f"{prefix}.lora_A.default.weight"], named[f"{prefix}.lora_B.default.weight"]
            w = w + scalings[prefix]["default"] * (b @ a)
        out[n.removeprefix("base_model.model.").replace(".base_layer.", ".")] = w
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor, else ``t`` itself (the fsdp2 engine's world-size-1 path,
    ``options.single_device``, holds plain tensors)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it), else ``t`` itself (the fsdp2
    engine's world-size-1 path, ``options.single_device``, holds plain tensors)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def max_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Largest absolute difference over common keys (inf when the key sets differ)."""
    if set(a) != set(b):
        return math.inf
    return max(float((a[k].double().cpu() - b[k].double().cpu()).abs().max()) for k in a)
