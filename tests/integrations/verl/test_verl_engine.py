"""verl 0.9.1 as the client of the underlay backend: its EngineRegistry, its losses, its batch layout.

Every number is checked against a float64 transformers reference computed with verl's own formulas
(``ppo_loss``/``value_loss`` of ``verl.workers.utils.losses`` on the whole global batch, which the
engine must reproduce however it splits micro-batches and ranks). Runs in ``.venv-verl``
(``scripts/setup.sh verl``); skips where verl is not installed.
"""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("tensordict")

import torch.multiprocessing as mp

from tests._dist import START_METHOD, run_distributed

if START_METHOD == "forkserver":  # ranks fork from a server that imported verl once (~9 s per import)
    mp.set_forkserver_preload(["underlay.integrations.verl", "verl.workers.utils.losses", "transformers"])

pytestmark = [pytest.mark.distributed]

VOCAB = 48
B = 6  # rows of the global batch


def _tiny(tmp: Path) -> tuple[str, str]:
    """A tiny random Qwen2 policy and its token-classification critic (num_labels=1), saved as HF dirs."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp / "policy")
    ccfg = copy.deepcopy(cfg)
    ccfg.num_labels = 1
    torch.manual_seed(1)
    AutoModelForTokenClassification.from_config(ccfg).save_pretrained(tmp / "critic")
    return str(tmp / "policy"), str(tmp / "critic")


def _rows() -> list[dict[str, torch.Tensor]]:
    """Prompt/response rows of different lengths with verl's RL fields (deterministic)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(B):
        p, r = 2 + i % 3, 3 + (i * 2) % 5
        out.append(
            {
                "prompt": torch.randint(1, VOCAB, (p,), generator=g),
                "response": torch.randint(1, VOCAB, (r,), generator=g),
                "response_mask": (torch.rand(r, generator=g) > 0.15).long(),
                "old_log_probs": -torch.rand(r, generator=g) * 4 - 1.0,
                "ref_log_prob": -torch.rand(r, generator=g) * 4 - 1.0,
                "advantages": torch.randn(r, generator=g),
                "values": torch.randn(r, generator=g),
                "returns": torch.randn(r, generator=g),
            }
        )
    return out


def _verl_batch(rows: list[dict[str, torch.Tensor]], **non_tensor: Any) -> Any:
    """The NO_PADDING TensorDict verl's workers hand an engine (left_right_2_no_padding of padded rows)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    pmax = max(len(r["prompt"]) for r in rows)
    rmax = max(len(r["response"]) for r in rows)
    n = len(rows)
    prompts = torch.zeros(n, pmax, dtype=torch.long)
    responses = torch.zeros(n, rmax, dtype=torch.long)
    attn = torch.zeros(n, pmax + rmax, dtype=torch.long)
    fields = {
        k: torch.zeros(n, rmax) for k in ("old_log_probs", "ref_log_prob", "advantages", "values", "returns")
    }
    rmask = torch.zeros(n, rmax, dtype=torch.long)
    for i, r in enumerate(rows):
        p, q = len(r["prompt"]), len(r["response"])
        prompts[i, pmax - p :] = r["prompt"]  # left-padded prompt, right-padded response (verl's layout)
        responses[i, :q] = r["response"]
        attn[i, pmax - p : pmax + q] = 1
        rmask[i, :q] = r["response_mask"]
        for k in fields:
            fields[k][i, :q] = r[k]
    input_ids = torch.cat([prompts, responses], 1)
    position_ids = (attn.cumsum(1) - 1).clamp(min=0)
    td = tu.get_tensordict(
        {
            "input_ids": input_ids,
            "attention_mask": attn,
            "position_ids": position_ids,
            "prompts": prompts,
            "responses": responses,
            "response_mask": rmask,
            **fields,
        },
    )
    td = left_right_2_no_padding(td)
    for k, v in non_tensor.items():
        tu.assign_non_tensor_data(td, k, v)
    return td


def _configs(
    path: str,
    model_type: str,
    lr: float,
    lora_rank: int = 0,
    lora_alpha: int = 16,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    **engine: Any,
) -> dict[str, Any]:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig

    from underlay.integrations.verl import UnderlayEngineConfig

    model = HFModelConfig(
        path=path,
        load_tokenizer=False,
        enable_gradient_checkpointing=False,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
    )
    eng = UnderlayEngineConfig(mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32"}, **engine)
    optim = FSDPOptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0, total_training_steps=10)
    return {
        "model_type": model_type,
        "backend": "underlay",
        "model_config": model,
        "engine_config": eng,
        "optimizer_config": optim,
        "checkpoint_config": CheckpointConfig(),
    }


def _actor_config(mode: str) -> Any:
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=B,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=mode,
        clip_ratio=0.2,
        clip_ratio_c=3.0,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=64,
        rollout_n=1,
        # a fixed horizon: without it seq-mean-token-sum-norm divides by each micro-batch's padded width
        loss_scale_factor=8 if mode == "seq-mean-token-sum-norm" else None,
    )


# the other aggregation modes, checked by gradient (token-mean and seq-mean-token-mean run the full flow)
OTHER_MODES = ("seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


# ---- float64 reference -------------------------------------------------------------------------


def _ref_outputs(model: torch.nn.Module, td: Any, value: bool) -> dict[str, torch.Tensor]:
    """verl's model_output layout computed row by row in float64 (log-prob of token t+1 at t)."""
    outs: dict[str, list[torch.Tensor]] = {}
    for ids in td["input_ids"].unbind():
        logits = model(input_ids=ids.unsqueeze(0)).logits[0].double()
        if value:
            outs.setdefault("values", []).append(logits.squeeze(-1))
            continue
        logp = torch.log_softmax(logits, -1)
        nxt = torch.roll(ids, -1)
        lp = logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        zero_last = torch.ones_like(lp)
        zero_last[-1] = 0
        outs.setdefault("log_probs", []).append(lp * zero_last)
        outs.setdefault("entropy", []).append(ent * zero_last)
    return {k: torch.nested.as_nested_tensor(v, layout=torch.jagged) for k, v in outs.items()}


def _ref_loss(path: str, td: Any, loss_fn: Any, value: bool) -> tuple[float, dict[str, torch.Tensor], Any]:
    """Loss of the whole batch (dp_size 1) and the float64 gradient by HF parameter name."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForTokenClassification if value else AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float64)
    loss, grads = _ref_loss_of(model, td, loss_fn, value)
    return loss, grads, model


def _ref_loss_of(model: Any, td: Any, loss_fn: Any, value: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """``_ref_loss`` of a built float64 model (a peft model too): the loss and every gradient by name."""
    from verl.utils import tensordict_utils as tu

    td = td.clone()
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(td["loss_mask"].sum()))
    loss, _metrics = loss_fn(model_output=_ref_outputs(model, td, value), data=td, dp_group=None)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads


def _full_grads(engine: Any) -> dict[str, torch.Tensor]:
    """The underlay fsdp2 engine's accumulated gradients, gathered to full tensors by HF name."""
    out = {}
    for name, p in engine.underlay.model.named_parameters():
        g = p.grad
        if g is None:
            continue
        full = g.full_tensor() if hasattr(g, "full_tensor") else g
        out[name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")] = (
            full.detach().double()
        )
    return out


# ---- the flow on every rank --------------------------------------------------------------------


def _flow(rank: int, world: int, policy: str, critic: str, ckpt: str, mode: str) -> dict[str, Any]:
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import CriticConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss, value_loss

    import underlay.integrations.verl  # noqa: F401  (registers the backend)

    torch.manual_seed(0)
    rows = _rows()
    mine = rows[rank::world]  # this rank's data-parallel shard
    common = {
        "temperature": 1.0,
        "global_batch_size": B,
        "calculate_entropy": True,
        "use_dynamic_bsz": True,
        "max_token_len_per_gpu": 64,
    }
    result: dict[str, Any] = {}

    # -- actor: EngineRegistry.new + initialize, infer_batch, one PPO update through verl's ppo_loss
    lr = 1e-2
    actor = EngineRegistry.new(**_configs(policy, "language_model", lr, micro_batch_max_tokens=12))
    actor.initialize()
    td = _verl_batch(mine, **common)
    with actor.eval_mode():
        inferred = actor.infer_batch(td)
    result["infer"] = [t.double() for t in inferred["model_output"]["log_probs"].unbind()]
    result["infer_entropy"] = [t.double() for t in inferred["model_output"]["entropy"].unbind()]
    acfg = _actor_config(mode)
    loss_fn = functools.partial(ppo_loss, acfg)
    # forward-only with verl's loss (TrainingWorker.infer_batch's compute_loss): the global loss
    with actor.eval_mode():
        scored = actor.infer_batch(_verl_batch(mine, **common), loss_function=loss_fn)
    local = torch.tensor([sum(scored["loss"])], dtype=torch.float64)
    torch.distributed.all_reduce(local)
    result["infer_loss"] = float(local) / world
    with actor.train_mode():
        result["mode_grads"] = {}
        for other in OTHER_MODES[world - 1 :: 2]:  # split over the two world sizes
            actor.optimizer_zero_grad()
            actor.forward_backward_batch(
                _verl_batch(mine, **common), functools.partial(ppo_loss, _actor_config(other))
            )
            result["mode_grads"][other] = _full_grads(actor)
        actor.optimizer_zero_grad()
        out = actor.forward_backward_batch(_verl_batch(mine, return_model_output=True, **common), loss_fn)
        trained = out["model_output"]["log_probs"].values()
        expected = inferred["model_output"]["log_probs"].values()
        result["train_outputs"] = bool(torch.allclose(trained, expected, rtol=0, atol=1e-5))
        result["actor_grads"] = _full_grads(actor)
        result["actor_grad_norm"] = actor.optimizer_step()
    local = torch.tensor([sum(out["loss"])], dtype=torch.float64)
    torch.distributed.all_reduce(local)
    result["actor_loss"] = float(local) / world
    result["metrics_keys"] = sorted(out["metrics"])
    result["weights"] = {n: t.double().clone() for n, t in actor.get_per_tensor_param()[0]}

    # -- critic: verl's value_loss
    ccfg = CriticConfig(
        strategy="fsdp",
        ppo_mini_batch_size=B,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=mode,
        cliprange_value=0.5,
        rollout_n=1,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=64,
    )
    critic = EngineRegistry.new(**_configs(critic, "value_model", 1e-3, micro_batch_max_tokens=64))
    critic.initialize()
    with critic.eval_mode():
        vals = critic.infer_batch(_verl_batch(mine, **common))["model_output"]["values"]
    result["critic_values"] = [t.double() for t in vals.unbind()]
    with critic.train_mode():
        critic.optimizer_zero_grad()
        cout = critic.forward_backward_batch(_verl_batch(mine, **common), functools.partial(value_loss, ccfg))
        result["critic_grads"] = _full_grads(critic)
        critic.optimizer_step()
    local = torch.tensor([sum(cout["loss"])], dtype=torch.float64)
    torch.distributed.all_reduce(local)
    result["critic_loss"] = float(local) / world

    # -- offload and onload (verl's BaseEngineCtx calls to() with its device name): outputs unchanged
    before = actor.infer_batch(_verl_batch(mine, **common))["model_output"]["log_probs"].values()
    actor.to("cpu")
    actor.to("cuda")
    after = actor.infer_batch(_verl_batch(mine, **common))["model_output"]["log_probs"].values()
    result["offload_roundtrip"] = bool(torch.equal(before, after))

    # -- save, a further step, load (back to the saved state), continue: identical to the first continuation
    actor.save_checkpoint(ckpt, global_step=1)

    def step() -> float:
        with actor.train_mode():
            o = actor.train_batch(_verl_batch(mine, **common), loss_fn)
        return float(o["metrics"]["grad_norm"])

    first = step()
    actor.load_checkpoint(ckpt)
    again = step()
    result["resume"] = (first, again)
    if world == 1:  # LoRA: verl's reference log-probs come from the same engine with the adapters off
        lora = EngineRegistry.new(
            **_configs(policy, "language_model", 1e-1, lora_rank=4, micro_batch_max_tokens=64)
        )
        lora.initialize()
        with lora.train_mode():
            lora.train_batch(_verl_batch(mine, **common), loss_fn)
        with lora.eval_mode(), lora.disable_adapter():
            base = lora.infer_batch(_verl_batch(mine, **common))["model_output"]["log_probs"]
        tuned = lora.infer_batch(_verl_batch(mine, **common))["model_output"]["log_probs"]
        result["lora_base"] = [t.double() for t in base.unbind()]
        result["lora_tuned"] = [t.double() for t in tuned.unbind()]
    tu.assign_non_tensor(td, temperature=0.5)
    try:
        actor.infer_batch(td)
        result["temperature_refused"] = False
    except Exception as exc:  # InvalidInput naming the mismatch
        result["temperature_refused"] = "temperature" in str(exc)
    return result


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return _tiny(tmp_path_factory.mktemp("verl_models"))


@pytest.mark.parametrize("world", [1, 2])
def test_verl_flow_matches_float64_reference(world: int, models: tuple[str, str], tmp_path: Path) -> None:
    from verl.workers.config import CriticConfig
    from verl.workers.utils.losses import ppo_loss, value_loss

    policy, critic = models
    mode = "token-mean" if world == 1 else "seq-mean-token-mean"
    res = run_distributed(_flow, world, policy, critic, str(tmp_path / "ckpt"), mode, timeout_s=240)
    rows = _rows()
    full = _verl_batch(rows, temperature=1.0, global_batch_size=B, calculate_entropy=True)

    # infer_batch: log-probs and entropy in verl's layout, rows back in each rank's order
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float64)
    ref = _ref_outputs(ref_model, full, value=False)
    ref_lp, ref_ent = ref["log_probs"].unbind(), ref["entropy"].unbind()
    for rank, r in enumerate(res):
        for j, (lp, ent) in enumerate(zip(r["infer"], r["infer_entropy"])):
            i = rank + j * world
            torch.testing.assert_close(lp, ref_lp[i], rtol=0, atol=2e-5)
            torch.testing.assert_close(ent, ref_ent[i], rtol=0, atol=2e-5)

    if world == 1:  # LoRA after a step: adapters off give the base model, on they do not
        for i, (base, tuned) in enumerate(zip(res[0]["lora_base"], res[0]["lora_tuned"])):
            torch.testing.assert_close(base, ref_lp[i], rtol=0, atol=2e-5)
            assert float((tuned - ref_lp[i]).abs().max()) > 1e-3

    # actor: loss and gradient equal to verl's ppo_loss over the global batch in float64
    ref_loss, ref_grads, _ = _ref_loss(
        policy, full, functools.partial(ppo_loss, _actor_config(mode)), value=False
    )
    for r in res:
        assert r["actor_loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert r["infer_loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert set(r["actor_grads"]) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(r["actor_grads"][name], g, rtol=1e-4, atol=2e-6)
        norm = math.sqrt(sum(float((g * g).sum()) for g in ref_grads.values()))
        assert r["actor_grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert {"actor/pg_loss", "actor/entropy_loss", "kl_loss"} <= set(r["metrics_keys"])

    for other in res[0]["mode_grads"]:  # every loss_agg_mode: the gradient of verl's global-batch loss
        _, mode_grads, _ = _ref_loss(
            policy, full, functools.partial(ppo_loss, _actor_config(other)), value=False
        )
        for r in res:
            for name, g in mode_grads.items():
                torch.testing.assert_close(r["mode_grads"][other][name], g, rtol=1e-4, atol=2e-6)

    # critic: verl's value_loss
    ccfg = CriticConfig(
        strategy="fsdp",
        ppo_mini_batch_size=B,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=mode,
        cliprange_value=0.5,
        rollout_n=1,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=64,
    )
    cref_loss, cref_grads, cref_model = _ref_loss(
        critic, full, functools.partial(value_loss, ccfg), value=True
    )
    ref_values = _ref_outputs(cref_model, full, value=True)["values"].unbind()
    for rank, r in enumerate(res):
        for j, v in enumerate(r["critic_values"]):
            torch.testing.assert_close(v, ref_values[rank + j * world].detach(), rtol=0, atol=2e-5)
    for r in res:
        assert r["critic_loss"] == pytest.approx(cref_loss, rel=1e-5, abs=1e-6)
        for name, g in cref_grads.items():
            torch.testing.assert_close(r["critic_grads"][name], g, rtol=1e-4, atol=2e-6)

    # weights stream with HF names; resume reproduces the continuation; a wrong temperature is refused
    for r in res:
        # verl's test_per_tensor_generator property: every HF name, with its HF shape
        assert {n: tuple(t.shape) for n, t in r["weights"].items()} == {
            n: tuple(p.shape) for n, p in ref_model.named_parameters()
        }
        first, again = r["resume"]
        assert again == pytest.approx(first, rel=1e-6)
        assert r["temperature_refused"]
        assert r["offload_roundtrip"]
        assert r["train_outputs"]  # return_model_output: the training forward's outputs, rows in order


def test_config_mapping_and_refusals(models: tuple[str, str]) -> None:
    """verl's configs map field by field; every field underlay cannot honour is named in one ConfigError."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig

    from underlay.integrations.verl import UnderlayEngineConfig, to_underlay_config
    from underlay.interfaces import ConfigError

    policy, _ = models
    model = HFModelConfig(path=policy, load_tokenizer=False)
    optim = FSDPOptimizerConfig(
        lr=3e-6,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        clip_grad=0.5,
        lr_scheduler_type="cosine",
        total_training_steps=100,
        min_lr_ratio=0.1,
        override_optimizer_config={"eps": 1e-6},
    )
    eng = UnderlayEngineConfig(
        fsdp_size=2, ulysses_sequence_parallel_size=2, max_token_len_per_gpu=4096, offload_policy=True
    )
    cfg, name = to_underlay_config(model, eng, optim, CheckpointConfig(), "language_model", 4)
    assert name is None and cfg.model.path == policy and cfg.model.kind == "causal_lm"
    assert (cfg.parallel.dp_replicate, cfg.parallel.ulysses, cfg.micro_batch_max_tokens) == (2, 2, 8192)
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay, cfg.optim.grad_clip) == (
        3e-6,
        (0.9, 0.95),
        0.1,
        0.5,
    )
    assert (cfg.optim.schedule, cfg.optim.warmup_steps, cfg.optim.total_steps, cfg.optim.min_lr_ratio) == (
        "cosine",
        0,
        100,
        0.1,
    )
    assert (cfg.optim.name, cfg.optim.eps, cfg.cpu_offload) == ("adamw", 1e-6, True)
    assert (cfg.param_dtype, cfg.reduce_dtype, cfg.recompute) == ("bfloat16", "float32", "full")

    lora_model = HFModelConfig(
        path=policy, load_tokenizer=False, lora_rank=4, lora_alpha=8, exclude_modules=["o_proj"]
    )
    lcfg, _ = to_underlay_config(lora_model, eng, optim, CheckpointConfig(), "language_model", 4)
    assert lcfg.model.lora is not None
    assert (lcfg.model.lora.rank, lcfg.model.lora.alpha) == (4, 8.0)
    assert (lcfg.model.lora.target_modules, lcfg.model.lora.exclude_modules) == ("all-linear", ("o_proj",))

    bad_eng = UnderlayEngineConfig(pad_to_length=True, wrap_policy={"min_num_params": 1}, model_dtype="bf16")
    bad_optim = FSDPOptimizerConfig(
        lr=1e-6, optimizer_impl="torchao.optim", override_optimizer_config={"lr": 1.0}
    )
    with pytest.raises(ConfigError) as info:
        to_underlay_config(model, bad_eng, bad_optim, CheckpointConfig(async_save=True), "language_model", 1)
    for field in (
        "pad_to_length",
        "wrap_policy",
        "model_dtype",
        "optimizer_impl",
        "override_optimizer_config",
        "async_save",
    ):
        assert field in str(info.value)
    with pytest.raises(ConfigError, match="strategy"):
        UnderlayEngineConfig(strategy="fsdp2")

    # a recipe's actor.strategy=underlay: verl copies it into its FSDP engine config, whose registry
    # lookup then finds this backend (for every device verl may report)
    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine import EngineRegistry

    from underlay.integrations.verl import UnderlayLMEngine, UnderlayValueEngine

    actor = FSDPActorConfig(
        strategy="underlay", rollout_n=1, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1
    )
    assert actor.engine.strategy == "underlay"
    cfg, _ = to_underlay_config(model, actor.engine, optim, CheckpointConfig(), "language_model", 1)
    assert cfg.micro_batch_max_tokens == 16384
    assert EngineRegistry.get_engine_cls("language_model", "underlay") is UnderlayLMEngine
    assert EngineRegistry.get_engine_cls("value_model", "underlay") is UnderlayValueEngine
