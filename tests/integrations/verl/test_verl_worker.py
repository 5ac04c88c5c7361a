"""verl's trainer-side worker (``TrainingWorker`` in a local Ray cluster) on the underlay backend, on the CPU.

verl ships no CPU platform; ``underlay.integrations.verl`` registers one through verl's platform plugin
API, selected by ``VERL_PLATFORM=cpu``, and ``VERL_USE_EXTERNAL_MODULES`` makes each Ray worker import the
integration (verl's own hooks; nothing of verl is patched). One GRPO step as verl's trainer runs it:
``infer_batch`` gives the old (and reference) log-probs, verl's ``compute_grpo_outcome_advantage`` the
group-normalised advantages, ``train_mini_batch`` (what ``ActorRolloutRefWorker.update_actor`` calls) one
update through verl's ``ppo_loss``, ``infer_batch`` the new log-probs. Every number equals the same step
driven at the engine level (``EngineRegistry.new`` in a gloo process), and the loss and grad norm equal
verl's formulas in float64.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("ray")

from tests._dist import run_distributed
from tests.integrations.verl import test_verl_engine as T

pytestmark = [pytest.mark.distributed]

GROUP = 3  # responses per prompt (GRPO's rollout.n)
ROOT = Path(__file__).resolve().parents[3]


def _grpo_rows() -> list[dict[str, torch.Tensor]]:
    """T.B rows in T.B // GROUP groups that share a prompt, with verl's GRPO advantages from outcome scores."""
    import numpy as np
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rows = T._rows()
    for i, r in enumerate(rows):
        r["prompt"] = rows[i - i % GROUP]["prompt"]
    rmax = max(len(r["response"]) for r in rows)
    mask = torch.zeros(len(rows), rmax)
    rewards = torch.zeros(len(rows), rmax)
    for i, r in enumerate(rows):
        q = len(r["response"])
        mask[i, :q] = r["response_mask"].float()
        rewards[i, q - 1] = float((i * 5) % 3)  # outcome score on the last token
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array([i // GROUP for i in range(len(rows))]))
    for i, r in enumerate(rows):
        r["advantages"] = adv[i, : len(r["response"])].clone()
    return rows


def _with_log_probs(rows: list[dict[str, torch.Tensor]], log_probs: Any) -> list[dict[str, torch.Tensor]]:
    """Rows whose old and reference log-probs are the policy's (verl's jagged layout: response tokens
    sit at positions ``p - 1 .. p + q - 2`` of row ``p + q``)."""
    out = []
    for r, lp in zip(rows, log_probs.unbind()):
        p, q = len(r["prompt"]), len(r["response"])
        resp = lp[p - 1 : p + q - 1].float().clone()
        out.append({**r, "old_log_probs": resp, "ref_log_prob": resp.clone()})
    return out


def _grpo_config() -> Any:
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=T.B,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode="token-mean",
        clip_ratio=0.2,
        entropy_coeff=0.0,
        use_kl_loss=True,
        kl_loss_coef=0.04,
        kl_loss_type="low_var_kl",
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=64,
        rollout_n=GROUP,
    )


def _common(rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    return {
        "temperature": 1.0,
        "calculate_entropy": False,
        "global_token_num": [len(r["prompt"]) + len(r["response"]) for r in rows],
    }


def _engine_step(rank: int, world: int, policy: str) -> dict[str, Any]:
    """The same GRPO step through ``EngineRegistry.new`` directly (the engine-level flow)."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    import underlay.integrations.verl  # noqa: F401  (registers the backend)

    rows = _grpo_rows()
    engine = EngineRegistry.new(**T._configs(policy, "language_model", 1e-2, micro_batch_max_tokens=64))
    engine.initialize()
    with engine.eval_mode():
        old = engine.infer_batch(T._verl_batch(rows, **_common(rows)))["model_output"]["log_probs"]
    rows = _with_log_probs(rows, old)
    with engine.train_mode():
        out = engine.train_batch(
            T._verl_batch(rows, global_batch_size=T.B, **_common(rows)),
            functools.partial(ppo_loss, _grpo_config()),
        )
        engine.lr_scheduler_step()
    with engine.eval_mode():
        new = engine.infer_batch(T._verl_batch(rows, **_common(rows)))["model_output"]["log_probs"]
    return {"old": old, "new": new, "loss": sum(out["loss"]), "grad_norm": float(out["metrics"]["grad_norm"])}


def _worker_step(policy: str) -> dict[str, Any]:
    """The GRPO step through ``RayWorkerGroup(TrainingWorker)`` with ``strategy="underlay"`` on the CPU."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import TrainingWorkerConfig
    from verl.workers.utils.losses import ppo_loss

    from underlay.integrations.verl.workers import CPUTrainingWorker

    cfg = T._configs(policy, "language_model", 1e-2, micro_batch_max_tokens=64)
    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=cfg["model_config"],
        engine_config=cfg["engine_config"],
        optimizer_config=cfg["optimizer_config"],
        checkpoint_config=cfg["checkpoint_config"],
    )
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {
        "VERL_PLATFORM": "cpu",  # verl's platform override: the CPU platform the integration registers
        "VERL_USE_EXTERNAL_MODULES": "underlay.integrations.verl",  # imported by `import verl` in each worker
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "OMP_NUM_THREADS": "1",
        # Ray starts workers at niceness 15: beside the suite's other lanes the worker would get about a
        # thirtieth of a core (underlay's own WorkerGroup sets this for its ranks; verl's does not)
        "RAY_worker_niceness": "0",
    }
    _ray_init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
        wg = RayWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=RayClassWithInitArgs(ray.remote(CPUTrainingWorker), config=config),
            device_name="cpu",
        )
        wg.reset()
        wg.set_loss_fn(functools.partial(ppo_loss, _grpo_config()))
        rows = _grpo_rows()
        td = T._verl_batch(rows, compute_loss=False, **_common(rows))
        old = tu.get(wg.infer_batch(td).get(), "log_probs")
        rows = _with_log_probs(rows, old)
        td = T._verl_batch(rows, mini_batch_size=T.B, epochs=1, global_batch_size=T.B, **_common(rows))
        metrics = tu.get(wg.train_mini_batch(td).get(), "metrics")
        td = T._verl_batch(rows, compute_loss=False, **_common(rows))
        new = tu.get(wg.infer_batch(td).get(), "log_probs")
        platform = ray.get(wg.workers[0].execute_with_func_generator.remote(_device_of))
    finally:
        ray.shutdown()
    return {"old": old, "new": new, "metrics": metrics, "platform": platform}


def _ray_init(**kwargs: Any) -> None:
    """``ray.init``, tried a second time when the local node does not start in time. ray 2.60 waits a fixed
    30 s for its raylet (``ray/_private/node.py``: ``raylet_start_wait_time_s = 30``, no setting), which a
    loaded 2-core machine can exceed; only that startup error is retried, any other propagates."""
    import ray

    try:
        ray.init(**kwargs)
    except Exception as exc:
        if "timed out during startup" not in str(exc):
            raise
        ray.shutdown()
        ray.init(**kwargs)


def _device_of(worker: Any) -> tuple[str, str, str]:
    from verl.utils.device import get_device_name, get_nccl_backend

    return get_device_name(), get_nccl_backend(), torch.distributed.get_backend()


def test_training_worker_grpo_step_equals_engine_flow(tmp_path: Path) -> None:
    from verl.workers.utils.losses import ppo_loss

    policy, _ = T._tiny(tmp_path)
    got = _worker_step(policy)
    (want,) = run_distributed(_engine_step, 1, policy, timeout_s=240)

    assert got["platform"][:2] == ("cpu", "gloo")
    for a, b in zip(got["old"].unbind(), want["old"].unbind()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    m = got["metrics"]
    (loss,) = m["loss"] if isinstance(m["loss"], list) else [m["loss"]]
    (norm,) = m["grad_norm"] if isinstance(m["grad_norm"], list) else [m["grad_norm"]]
    assert loss == pytest.approx(want["loss"], rel=1e-6, abs=1e-7)
    assert norm == pytest.approx(want["grad_norm"], rel=1e-6)
    for a, b in zip(got["new"].unbind(), want["new"].unbind()):  # the updated weights, through their outputs
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert float((got["new"].values() - got["old"].values()).abs().max()) > 1e-3  # the step moved the policy

    # and verl's GRPO loss in float64 over the whole batch
    rows = _with_log_probs(_grpo_rows(), want["old"])
    full = T._verl_batch(rows, global_batch_size=T.B, **_common(rows))
    ref_loss, ref_grads, _ = T._ref_loss(
        policy, full, functools.partial(ppo_loss, _grpo_config()), value=False
    )
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert norm == pytest.approx(math.sqrt(sum(float((g * g).sum()) for g in ref_grads.values())), rel=1e-5)
