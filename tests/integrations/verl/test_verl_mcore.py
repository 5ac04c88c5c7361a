"""verl 0.9.1 as the client of the underlay backend on the mcore engine (megatron-core).

The flow of ``test_verl_engine.py`` (verl's ``EngineRegistry``, its batch layout, its ``ppo_loss`` and
``value_loss``) with ``UnderlayEngineConfig(underlay_engine="mcore")``: at 1 rank, and at 2 gloo ranks
with tensor parallelism 2 (``tensor_model_parallel_size=2``: every rank holds half of each projection,
the vocabulary-parallel log-prob and entropy head, one data-parallel rank). Every number is checked
against the same float64 transformers reference as the fsdp2 flow (that module's helpers), at the same
tolerances. megatron-core runs on the CPU under ``tests/mcore/_cpu_fixture.py``, installed inside the
spawned ranks only (it rewrites global torch behaviour; the pytest process never installs it).
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
    _ref_outputs,
    _rows,
    _tiny,
    _verl_batch,
)

pytestmark = [pytest.mark.distributed]

# the actor's main flow runs in the first mode at 1 rank and the second at 2 ranks; every mode is
# checked by gradient at both
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


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
    td = _verl_batch(mine, **common)
    tu.assign_non_tensor(td, temperature=0.5)
    try:
        actor.infer_batch(td)
        result["temperature_refused"] = False
    except Exception as exc:  # InvalidInput naming the mismatch
        result["temperature_refused"] = "temperature" in str(exc)
    return result


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
