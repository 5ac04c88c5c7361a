"""The architectures the mcore engine converts beyond plain llama/qwen (tiny configs), their perturbed
``save_pretrained`` checkpoints and their float64 Hugging Face references; the per-rank body that
checks one parallel layout over all of them (module level so ``run_distributed`` can pickle it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.mcore import _helpers as H

# Each config exercises one conversion: llama3 RoPE scaling (every frequency band scaled or smoothed:
# original_max_position_embeddings 8 with head_dim 8), linear RoPE scaling (mistral), sliding windows
# shorter than the sequences (all layers: mistral; the layers past max_window_layers: qwen2),
# vocabularies TP=2 does not divide (131, 127: padded rows), tied embeddings with a padded vocabulary,
# mixtral's per-expert w1/w3/w2, qwen2_moe's gated shared expert without top-k renormalisation;
# glm4_moe's dense first layer, partial RoPE, q/k norm, q/k/v bias, shared expert and sigmoid router
# with a (perturbed) routing bias, groups (one of 2 groups of 4 experts per token) and scaled weights;
# deepseek_v3's multi-latent attention (q and kv LoRA ranks, interleaved rotary part, v_head_dim !=
# qk head dim) with glm4_moe's MoE.
_COMMON: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def arch_configs() -> dict[str, Any]:
    """``{name: transformers config}`` of every architecture the test covers."""
    import transformers as tf

    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    return {
        "llama3": tf.LlamaConfig(**{**_COMMON, "vocab_size": 131, "rope_parameters": llama3}),
        "mistral_window": tf.MistralConfig(
            **{**_COMMON, "vocab_size": 128, "sliding_window": 4},
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
        "qwen2_window": tf.Qwen2Config(
            **{**_COMMON, "vocab_size": 131, "tie_word_embeddings": True},
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
        ),
        "mixtral": tf.MixtralConfig(
            **{**_COMMON, "vocab_size": 127, "intermediate_size": 16},
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        "qwen2_moe": tf.Qwen2MoeConfig(
            **{**_COMMON, "vocab_size": 128},
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            norm_topk_prob=False,
        ),
        "glm4_moe": tf.Glm4MoeConfig(
            **{**_COMMON, "vocab_size": 127, "head_dim": 8, "attention_bias": True},
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            use_qk_norm=True,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=16,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
        ),
        "deepseek_v3": tf.DeepseekV3Config(
            **{**_COMMON, "vocab_size": 127, "num_key_value_heads": 4},
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=16,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
        ),
    }


def _hf_model(cfg: Any) -> Any:
    from transformers import AutoModelForCausalLM

    # eager experts: transformers' grouped expert matmul has no float64 kernel
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")


def write_checkpoints(root: Path) -> None:
    """For every architecture: a model whose every parameter is moved off its init value, saved with
    ``save_pretrained`` (fp32) under ``root/<name>``, and ``ref.pt`` there: the float64 model's
    token-aligned log-probs ``[B, S]`` of ``H.make_batch(1)`` and the gradients of the token-mean
    ``H.pg_loss`` by checkpoint name."""
    batch = H.make_batch(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: 30x faster than two threads on a busy 2-core host
    try:
        for name, cfg in arch_configs().items():
            _write_one(root / name, cfg, batch)
    finally:
        torch.set_num_threads(threads)


def _write_one(path: Path, cfg: Any, batch: Any) -> None:
    """One architecture's perturbed checkpoint and float64 reference under ``path``."""
    from underlay.engines.mcore._hf import per_expert_names
    from underlay.engines.mcore.weightmap import checkpoint_names

    torch.manual_seed(0)
    model = _hf_model(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            # routers: scores that vary per token, so that routing (groups, bias) matters
            p.add_((1.0 if n.endswith("mlp.gate.weight") else 0.05) * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # large enough to change the routing
                b.add_(0.1 * torch.randn_like(b))
    model.save_pretrained(str(path))
    model = model.double()
    # one unpadded sequence at a time: with a sliding window, padded query rows of a right-padded
    # batch see no key at all (NaN in eager attention)
    lp = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    for i, n in enumerate(batch.attention_mask.sum(1).tolist()):
        ids = batch.input_ids[i : i + 1, :n]
        logits = model(input_ids=ids).logits[0, :-1]
        lp[i, 1:n] = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    m = batch.loss_mask.double()
    (-(batch.extras["adv"].double()[:, None] * lp * m).sum() / m.sum()).backward()
    grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
    grads = checkpoint_names(cfg.model_type, per_expert_names(grads))
    torch.save({"lp": lp.detach(), "grads": grads}, path / "ref.pt")


def check_layout_all_archs(
    rank: int, world: int, tp: int, pp: int, root: str, device: str = "cpu"
) -> dict[str, dict[str, float]]:
    """At ``tp`` x ``pp`` on ``device`` (``"cpu"``: under the CPU fixture; ``"cuda"``: the real engine,
    one GPU per rank) in one process group (megatron's state torn down between architectures), per
    architecture: an engine built from the checkpoint; its log-probs (``infer``) and every gradient of
    one ``forward_backward`` against the float64 reference (max abs / max relative error); then one
    optimizer step, ``load_hf`` of the checkpoint and ``iter_weights``: the largest difference to the
    checkpoint's tensors (0 = bit-exact) and whether the names are exactly the checkpoint's; or
    ``{"refused": message}`` when building the engine raised ``ConfigError``."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from underlay.engines.mcore.weights import MCoreWeightLoader
    from underlay.interfaces import ConfigError, EngineConfig, ModelConfig, OptimConfig, ParallelConfig

    out: dict[str, dict[str, float]] = {}
    batch = H.make_batch(1)
    for name, hf_cfg in arch_configs().items():
        path = Path(root) / name
        ref = torch.load(path / "ref.pt")
        moe = hf_cfg.model_type in ("mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3")
        cfg = EngineConfig(
            model=ModelConfig(path=str(path), seed=0),
            parallel=ParallelConfig(tp=tp, pp=pp),
            optim=OptimConfig(lr=1e-2, eps=1e-4),
            micro_batch_max_tokens=24,
            param_dtype="float32",
            reduce_dtype="float32",
            with_entropy=True,
            options={"sequence_parallel": True} if moe and tp > 1 else {},
        )
        try:
            if device == "cpu":
                eng = H.make_engine(cfg)
            else:
                from underlay.engines.mcore.engine import MCoreEngine
                from underlay.registry import get_device

                eng = MCoreEngine(cfg, get_device(device))
        except ConfigError as err:  # a layout the engine refuses for this architecture
            out[name] = {"refused": str(err)}
            ps.destroy_model_parallel()
            continue
        lp = eng.infer(batch, with_entropy=True).log_probs.double().cpu()
        eng.forward_backward(batch, H.pg_loss)
        from tests.mcore._workers import grad_by_hf_name

        grads = {n: g.cpu() for n, g in grad_by_hf_name(eng).items()}
        grel = max(
            float((grads[n].double() - g).abs().max() / (g.abs().max() + 1e-6))
            for n, g in ref["grads"].items()
        )

        eng.optimizer_step()
        file = load_file(str(path / "model.safetensors"))
        moved = max(float((t.cpu() - file[n]).abs().max()) for n, t in eng.named_full_tensors())
        MCoreWeightLoader().load_hf(eng, path)
        got = {n: t.float().cpu() for bucket in eng.iter_weights() for n, t in bucket}
        roundtrip = max(float((got[n] - file[n]).abs().max()) for n in file if n in got)
        out[name] = {
            "lp": float((lp - ref["lp"]).abs().max()),
            "grad_rel": grel,
            "grad_names": float(set(ref["grads"]) <= set(grads)),
            "moved": moved,
            "roundtrip": roundtrip,
            "names": float(set(got) == set(file)),
            "vocab_rows": float(eng.arch.vocab_rows),
        }
        del eng
        ps.destroy_model_parallel()
    return out
