"""verl 0.9.1 as the client of the underlay backend on the mcore engine (megatron-core).

The flow of ``test_verl_engine.py`` (verl's ``EngineRegistry``, its batch layout, its ``ppo_loss`` and
``value_loss``) with ``UnderlayEngineConfig(underlay_engine="mcore")``: at 1 rank, and at 2 gloo ranks
with tensor parallelism 2 (``tensor_model_parallel_size=2``: every rank holds half of each projection,
the vocabulary-parallel log-prob and entropy head, one data-parallel rank). Every number is checked
against the same float64 transformers reference as the fsdp2 flow (that module's helpers), at the same
tolerances. In the same ranks, a LoRA actor from verl's ``lora_rank``/``lora_alpha``/``target_modules``
is checked against peft's float64 model (``_check_lora``). megatron-core runs on the CPU under
``tests/mcore/_cpu_fixture.py``, installed inside the spawned ranks only (it rewrites global torch
behaviour; the pytest process never installs it).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("tensordict")
pytest.importorskip("megatron.core")

from tests._dist import run_distributed
from tests.integrations.verl.test_verl_engine import (
    B,
    _actor_config,
    _configs,
    _ref_loss,
    _ref_loss_of,
    _ref_outputs,
    _rows,
    _tiny,
    _verl_batch,
)

pytestmark = [pytest.mark.distributed]

# the actor's main flow runs in the first mode at 1 rank and the second at 2 ranks; every mode is
# checked by gradient at both
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
# LoRA through verl's model fields: column-parallel sites with a part left out (k of q/k/v, gate of
# gate/up) and row-parallel ones (o, down)
LORA_RANK, LORA_ALPHA, LORA_LR = 4, 8, 1e-2
LORA_TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def _critic_config(mode: str) -> Any:
    from verl.workers.config import CriticConfig

    return CriticConfig(
        strategy="fsdp",
        ppo_mini_batch_size=B,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=mode,
        cliprange_value=0.5,
        rollout_n=1,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=64,
    )


def _grads(engine: Any) -> dict[str, torch.Tensor]:
    """The mcore engine's reduced gradients as full float64 tensors by HF name (collective)."""
    from tests.mcore._workers import grad_by_hf_name

    return {n: g.double() for n, g in grad_by_hf_name(engine.underlay).items()}


def _mcore_flow(rank: int, world: int, policy: str, critic: str, ckpt: str, mode: str) -> dict[str, Any]:
    from tests.mcore._cpu_fixture import install

    install()  # this rank only: megatron's CUDA calls run on the CPU

    from verl.utils import tensordict_utils as tu
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss, value_loss

    import underlay.integrations.verl  # noqa: F401  (registers the backend)

    torch.manual_seed(0)
    rows = _rows()
    common = {
        "temperature": 1.0,
        "global_batch_size": B,
        "calculate_entropy": True,
        "use_dynamic_bsz": True,
        "max_token_len_per_gpu": 64,
    }
    mcore = {"underlay_engine": "mcore", "tensor_model_parallel_size": world}
    result: dict[str, Any] = {}

    # -- actor: EngineRegistry.new + initialize, infer_batch, PPO updates through verl's ppo_loss
    actor = EngineRegistry.new(**_configs(policy, "language_model", 1e-2, micro_batch_max_tokens=12, **mcore))
    actor.initialize()
    lay = actor.underlay.layout
    result["engine"] = (actor.underlay.name, lay.tp, lay.dp)
    dp, dp_rank = actor.get_data_parallel_size(), actor.get_data_parallel_rank()
    result["dp"] = (dp, dp_rank, actor.is_mp_src_rank_with_outputs())
    mine = rows[dp_rank::dp]  # this rank's data-parallel shard (the whole batch at tp=2)
    with actor.eval_mode():
        inferred = actor.infer_batch(_verl_batch(mine, **common))
    result["infer"] = [t.double() for t in inferred["model_output"]["log_probs"].unbind()]
    result["infer_entropy"] = [t.double() for t in inferred["model_output"]["entropy"].unbind()]
    loss_fn = functools.partial(ppo_loss, _actor_config(mode))
    with actor.eval_mode():  # forward-only with verl's loss (TrainingWorker.infer_batch's compute_loss)
        scored = actor.infer_batch(_verl_batch(mine, **common), loss_function=loss_fn)
    result["infer_loss"] = sum(scored["loss"])
    with actor.train_mode():
        result["mode_grads"] = {}
        for other in MODES:
            if other == mode:
                continue
            actor.optimizer_zero_grad()
            actor.forward_backward_batch(
                _verl_batch(mine, **common), functools.partial(ppo_loss, _actor_config(other))
            )
            result["mode_grads"][other] = _grads(actor)
        actor.optimizer_zero_grad()
        out = actor.forward_backward_batch(_verl_batch(mine, return_model_output=True, **common), loss_fn)
        trained = out["model_output"]["log_probs"].values()
        expected = inferred["model_output"]["log_probs"].values()
        result["train_outputs"] = bool(torch.allclose(trained, expected, rtol=0, atol=1e-5))
        result["actor_grads"] = _grads(actor)
        result["actor_grad_norm"] = actor.optimizer_step()
    result["actor_loss"] = sum(out["loss"])  # one data-parallel rank: its loss is the global one
    result["metrics_keys"] = sorted(out["metrics"])
    result["weights"] = {n: t.double().clone() for n, t in actor.get_per_tensor_param()[0]}

    # -- critic: an mcore value model through verl's value_loss
    critic_engine = EngineRegistry.new(
        **_configs(critic, "value_model", 1e-3, micro_batch_max_tokens=64, **mcore)
    )
    critic_engine.initialize()
    with critic_engine.eval_mode():
        vals = critic_engine.infer_batch(_verl_batch(mine, **common))["model_output"]["values"]
    result["critic_values"] = [t.double() for t in vals.unbind()]
    with critic_engine.train_mode():
        critic_engine.optimizer_zero_grad()
        cout = critic_engine.forward_backward_batch(
            _verl_batch(mine, **common), functools.partial(value_loss, _critic_config(mode))
        )
        result["critic_grads"] = _grads(critic_engine)
        critic_engine.optimizer_step()
    result["critic_loss"] = sum(cout["loss"])

    # -- offload and onload (verl's BaseEngineCtx calls to() with its device name): outputs unchanged
    before = actor.infer_batch(_verl_batch(mine, **common))["model_output"]["log_probs"].values()
    actor.to("cpu")
    actor.to("cuda")
    after = actor.infer_batch(_verl_batch(mine, **common))["model_output"]["log_probs"].values()
    result["offload_roundtrip"] = bool(torch.equal(before, after))

    # -- save, a further step, load (back to the saved state), continue: identical to the first continuation
    actor.save_checkpoint(ckpt, global_step=1)

    def step() -> tuple[float | None, list[torch.Tensor]]:
        with actor.train_mode():
            o = actor.train_batch(_verl_batch(mine, **common), loss_fn)
        lp = actor.infer_batch(_verl_batch(mine, **common))["model_output"]["log_probs"]
        # verl's train_batch reports grad_norm on the first rank of each model-parallel group only
        norm = o["metrics"].get("grad_norm")
        return None if norm is None else float(norm), [t.double() for t in lp.unbind()]

    first = step()
    actor.load_checkpoint(ckpt)
    again = step()
    result["resume"] = (first, again)
    result["lora"] = _lora_flow(policy, mine, common, loss_fn, mcore)
    td = _verl_batch(mine, **common)
    tu.assign_non_tensor(td, temperature=0.5)
    try:
        actor.infer_batch(td)
        result["temperature_refused"] = False
    except Exception as exc:  # InvalidInput naming the mismatch
        result["temperature_refused"] = "temperature" in str(exc)
    return result


def _lora_flow(
    policy: str,
    mine: list[dict[str, torch.Tensor]],
    common: dict[str, Any],
    loss_fn: Any,
    mcore: dict[str, Any],
) -> dict[str, Any]:
    """LoRA through verl's model fields (``lora_rank``, ``lora_alpha``, ``target_modules``) on the mcore
    engine: the adapters as built, ``infer_batch``, two actor updates through ``ppo_loss`` (the first from
    peft's ``B = 0``, where every ``A`` gradient is zero; the second where both move), ``disable_adapter()``
    and ``get_per_tensor_param`` after them."""
    from verl.workers.engine import EngineRegistry

    from tests.mcore._lora_workers import adapter_grads

    def adapters() -> dict[str, torch.Tensor]:
        return {n: t.double().clone() for n, t in lora.underlay.named_adapter_tensors()}

    def log_probs() -> list[torch.Tensor]:
        lp = lora.infer_batch(_verl_batch(mine, **common))["model_output"]["log_probs"]
        return [t.double() for t in lp.unbind()]

    lora = EngineRegistry.new(
        **_configs(
            policy,
            "language_model",
            LORA_LR,
            lora_rank=LORA_RANK,
            lora_alpha=LORA_ALPHA,
            target_modules=LORA_TARGETS,
            micro_batch_max_tokens=12,
            **mcore,
        )
    )
    lora.initialize()
    out: dict[str, Any] = {"engine": (lora.underlay.name, lora.underlay.layout.tp), "adapters": [adapters()]}
    with lora.eval_mode():
        out["infer"] = log_probs()
    out["loss"], out["grads"], out["norm"] = [], [], []
    for _ in range(2):
        with lora.train_mode():
            lora.optimizer_zero_grad()
            step = lora.forward_backward_batch(_verl_batch(mine, **common), loss_fn)
            out["grads"].append(adapter_grads(lora.underlay))
            out["norm"].append(lora.optimizer_step())
        out["loss"].append(sum(step["loss"]))  # one data-parallel rank: the global loss
        out["adapters"].append(adapters())
    with lora.eval_mode():
        with lora.disable_adapter():
            out["base"] = log_probs()
        out["tuned"] = log_probs()
    out["weights"] = {n: t.double().clone() for n, t in lora.get_per_tensor_param()[0]}
    return out


def _peft_reference(policy: str, adapters: dict[str, torch.Tensor]) -> Any:
    """peft's float64 model of ``policy`` with ``adapters`` (peft's saved names) and the verl LoRA fields."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float64)
    cfg = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS))
    model = get_peft_model(base, cfg).to(torch.float64)
    own = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert {n.replace(".default.", ".") for n in own} == set(adapters)
    with torch.no_grad():
        for n, p in own.items():
            p.copy_(adapters[n.replace(".default.", ".")])
    return model


def _check_lora(res: list[dict[str, Any]], policy: str, full: Any, loss_fn: Any, base_lp: Any) -> None:
    """The LoRA flow of every rank against peft's float64 model at the engine's adapters."""
    for r in (x["lora"] for x in res):
        assert r["engine"][0] == "mcore"
        start = r["adapters"][0]  # peft's init: A random, B zero
        assert all(bool((t == 0).all()) == (".lora_B." in n) for n, t in start.items())
        for i, lp in enumerate(r["infer"]):  # B = 0: the base model
            torch.testing.assert_close(lp, base_lp[i], rtol=0, atol=2e-5)
        for k in range(2):  # update k: loss, adapter gradients and grad norm at the adapters it started from
            ref = _peft_reference(policy, r["adapters"][k])
            loss, grads = _ref_loss_of(ref, full, loss_fn, value=False)
            grads = {n.replace(".default.", "."): g for n, g in grads.items()}
            assert r["loss"][k] == pytest.approx(loss, rel=1e-5, abs=1e-6)
            assert set(r["grads"][k]) == set(grads) == set(start)
            for name, g in grads.items():
                got = r["grads"][k][name]
                torch.testing.assert_close(got, g, rtol=1e-4, atol=2e-6)
                # and to 1e-4 of the tensor's own scale (tests/mcore's LoRA bound): many adapter gradients
                # are below the absolute 2e-6 (q_proj's A about 4e-5 at its largest)
                assert float((got - g).abs().max()) <= 1e-4 * float(g.abs().max())
            norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
            assert r["norm"][k] == pytest.approx(norm, rel=1e-5)
            if k == 0:  # B = 0: no A gradient; AdamW's first step moves B by lr * c g / (|c g| + eps)
                clip = min(1.0, 1.0 / (norm + 1e-6))
                for name, g in grads.items():
                    moved = r["adapters"][1][name] - start[name]
                    if ".lora_A." in name:
                        assert float(g.abs().max()) == 0 and bool((moved == 0).all())
                    else:
                        want = -LORA_LR * clip * g / (clip * g.abs() + 1e-8)
                        torch.testing.assert_close(moved, want, rtol=0, atol=1e-6)
        # after the updates: the adapters on give peft's model at the engine's adapters, off the base
        # model; the streamed weights are peft's merge (W + alpha / r * B @ A) under the HF names
        ref = _peft_reference(policy, r["adapters"][2])
        tuned = _ref_outputs(ref, full, value=False)["log_probs"].unbind()
        for i, (on, off) in enumerate(zip(r["tuned"], r["base"])):
            torch.testing.assert_close(on, tuned[i].detach(), rtol=0, atol=2e-5)
            torch.testing.assert_close(off, base_lp[i], rtol=0, atol=2e-5)
            assert float((on - base_lp[i]).abs().max()) > 1e-3
        merged = dict(ref.merge_and_unload().named_parameters())
        assert set(r["weights"]) == set(merged)
        for name, w in merged.items():
            torch.testing.assert_close(r["weights"][name], w.detach(), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return _tiny(tmp_path_factory.mktemp("verl_mcore_models"))


def _check(world: int, res: list[dict[str, Any]], policy: str, critic: str) -> None:
    """Every rank's results against the float64 transformers reference of verl's formulas."""
    from transformers import AutoModelForCausalLM
    from verl.workers.utils.losses import ppo_loss, value_loss

    mode = MODES[world - 1]
    full = _verl_batch(_rows(), temperature=1.0, global_batch_size=B, calculate_entropy=True)
    for r in res:  # the mcore engine, tp = world, one data-parallel rank holding the whole batch
        assert r["engine"] == ("mcore", world, 1)
        assert r["dp"][:2] == (1, 0)
    assert [r["dp"][2] for r in res] == [True] + [False] * (world - 1)

    # infer_batch: log-probs and entropy in verl's layout
    ref_model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float64)
    ref = _ref_outputs(ref_model, full, value=False)
    ref_lp, ref_ent = ref["log_probs"].unbind(), ref["entropy"].unbind()
    for r in res:
        assert len(r["infer"]) == B
        for i, (lp, ent) in enumerate(zip(r["infer"], r["infer_entropy"])):
            torch.testing.assert_close(lp, ref_lp[i], rtol=0, atol=2e-5)
            torch.testing.assert_close(ent, ref_ent[i], rtol=0, atol=2e-5)

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
        assert r["train_outputs"]  # return_model_output: the training forward's outputs, rows in order

    for other in MODES:  # every loss_agg_mode: the gradient of verl's global-batch loss
        if other == mode:
            continue
        _, mode_grads, _ = _ref_loss(
            policy, full, functools.partial(ppo_loss, _actor_config(other)), value=False
        )
        for r in res:
            assert set(r["mode_grads"][other]) == set(mode_grads)
            for name, g in mode_grads.items():
                torch.testing.assert_close(r["mode_grads"][other][name], g, rtol=1e-4, atol=2e-6)

    # critic: verl's value_loss on the mcore value model
    cref_loss, cref_grads, cref_model = _ref_loss(
        critic, full, functools.partial(value_loss, _critic_config(mode)), value=True
    )
    ref_values = _ref_outputs(cref_model, full, value=True)["values"].unbind()
    for r in res:
        for i, v in enumerate(r["critic_values"]):
            torch.testing.assert_close(v, ref_values[i].detach(), rtol=0, atol=2e-5)
        assert r["critic_loss"] == pytest.approx(cref_loss, rel=1e-5, abs=1e-6)
        assert set(r["critic_grads"]) == set(cref_grads)
        for name, g in cref_grads.items():
            torch.testing.assert_close(r["critic_grads"][name], g, rtol=1e-4, atol=2e-6)

    _check_lora(res, policy, full, functools.partial(ppo_loss, _actor_config(mode)), ref_lp)

    # weights stream with HF names and shapes; resume reproduces the continuation; offload is exact
    for r in res:
        assert {n: tuple(t.shape) for n, t in r["weights"].items()} == {
            n: tuple(p.shape) for n, p in ref_model.named_parameters()
        }
        (norm1, lp1), (norm2, lp2) = r["resume"]
        assert (norm1 is None, norm2 is None) == (not r["dp"][2],) * 2
        if norm1 is not None:
            assert norm2 == pytest.approx(norm1, rel=1e-6)
        for a, b in zip(lp1, lp2):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        assert r["temperature_refused"]
        assert r["offload_roundtrip"]


@pytest.mark.parametrize("world", [1, 2])
def test_verl_flow_on_mcore_matches_float64_reference(
    world: int, models: tuple[str, str], tmp_path: Path
) -> None:
    policy, critic = models
    res = run_distributed(
        _mcore_flow, world, policy, critic, str(tmp_path / "ckpt"), MODES[world - 1], timeout_s=240
    )
    _check(world, res, policy, critic)


def test_model_parallel_sizes_map_to_parallel_config(models: tuple[str, str]) -> None:
    """``UnderlayEngineConfig``'s sizes under verl's ``McoreEngineConfig`` names reach ``ParallelConfig``."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig

    from underlay.integrations.verl import UnderlayEngineConfig, to_underlay_config

    model = HFModelConfig(path=models[0], load_tokenizer=False)
    eng = UnderlayEngineConfig(
        underlay_engine="mcore", tensor_model_parallel_size=2, pipeline_model_parallel_size=4
    )
    cfg, name = to_underlay_config(model, eng, None, CheckpointConfig(), "language_model", 8)
    assert name == "mcore"
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp_replicate, cfg.parallel.ulysses) == (2, 4, 1, 1)
    cfg, name = to_underlay_config(
        model, UnderlayEngineConfig(), None, CheckpointConfig(), "language_model", 8
    )
    assert name is None and (cfg.parallel.tp, cfg.parallel.pp) == (1, 1)
