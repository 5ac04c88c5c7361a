"""verl's trainer-side worker (``TrainingWorker`` in a local Ray cluster) on the underlay backend, one GPU.

verl 0.9.1 has no CPU platform (its workers' process group asks for NCCL), so this runs on the GPU host
only, in the verl environment (``scripts/setup.sh verl`` with a CUDA torch): one GRPO-style PPO step of a
tiny model through ``RayWorkerGroup(TrainingWorker).train_batch`` with ``strategy="underlay"``, whose
grad norm equals the float64 reference of ``test_verl_engine`` (fp32 compute), and an
``infer_batch`` whose log-probs equal it before the step.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("ray")

from tests.integrations.verl import test_verl_engine as T

pytestmark = [pytest.mark.gpu]


def test_training_worker_grpo_step_on_underlay(tmp_path: Path) -> None:
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    policy, _ = T._tiny(tmp_path)
    cfg = T._configs(policy, "language_model", 1e-2, micro_batch_max_tokens=64)
    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=cfg["model_config"],
        engine_config=cfg["engine_config"],
        optimizer_config=cfg["optimizer_config"],
        checkpoint_config=cfg["checkpoint_config"],
    )
    ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(Path.cwd())}})
    try:
        pool = RayResourcePool(process_on_nodes=[1])
        wg = RayWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=RayClassWithInitArgs(ray.remote(TrainingWorker), config=config),
        )
        loss_fn = functools.partial(ppo_loss, T._actor_config("token-mean"))
        wg.set_loss_fn(loss_fn=loss_fn)
        wg.reset()
        rows = T._rows()
        common = {"temperature": 1.0, "global_batch_size": T.B, "calculate_entropy": True}
        td = T._verl_batch(
            rows, global_token_num=[len(r["prompt"]) + len(r["response"]) for r in rows], **common
        )
        inferred = wg.infer_batch(td).get()
        log_probs = tu.get(inferred, "log_probs")
        out = wg.train_batch(T._verl_batch(rows, global_token_num=[1] * T.B, **common)).get()
        metrics = tu.get(out, "metrics")
    finally:
        ray.shutdown()

    from transformers import AutoModelForCausalLM

    full = T._verl_batch(rows, **common)
    ref = T._ref_outputs(AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float64), full, value=False)
    for got, want in zip(log_probs.unbind(), ref["log_probs"].unbind()):
        torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=5e-5)
    _, ref_grads, _ = T._ref_loss(policy, full, loss_fn, value=False)
    norm = math.sqrt(sum(float((g * g).sum()) for g in ref_grads.values()))
    got = metrics["grad_norm"]
    got = got[0] if isinstance(got, (list, tuple)) else got
    assert float(got) == pytest.approx(norm, rel=1e-4)
