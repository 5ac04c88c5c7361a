"""Actor, reference and critic engines on Ray: colocated on one worker group, or in separate groups.

One PPO-style step per iteration on a tiny random Llama (no downloads):

1. the reference engine computes reference log-probs of a batch (``infer``);
2. the critic computes values (``infer``);
3. the actor takes a step on a loss with a KL term to the reference log-probs (``forward_backward``);
4. the critic takes a step towards the rewards.

``--mode colocated``: the three roles are built on the same ranks (one placement group, one process per
rank, three engines in it) and take turns on the device with ``WorkerGroup.colocated(role)``, which
offloads the other roles before onloading the active one. ``--mode separate``: each role has a group of
its own (the actor on ``--world-size`` ranks, reference and critic on one rank each) and all stay on
their devices. Both give the same numbers; the colocated run needs one set of devices instead of three.

Run: ``python examples/ray_roles.py --mode colocated --world-size 2`` (starts a local Ray, or joins
``RAY_ADDRESS``). On accelerators the groups reserve the device's Ray resource (``GPU``/``NPU``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

import torch

from underlay.interfaces import (
    EngineConfig,
    LossContext,
    Metric,
    ModelConfig,
    OptimConfig,
    TokenBatch,
    TokenOutputs,
)
from underlay.ops import aggregate_loss

VOCAB, SEQ = 96, 10


def actor_loss(
    outputs: TokenOutputs, batch: TokenBatch, ctx: LossContext
) -> tuple[torch.Tensor, Mapping[str, torch.Tensor | Metric]]:
    """Token mean of ``-advantage * logp + 0.05 * (logp - ref_logp)^2`` over the global batch, with the
    token-mean KL (a contribution, summed) and the largest KL term (a max) as metrics."""
    assert outputs.log_probs is not None
    adv = batch.extras["advantages"].to(outputs.log_probs.dtype)[:, None]
    kl = (outputs.log_probs - batch.extras["ref_log_probs"].to(outputs.log_probs.dtype)) ** 2
    per_token = -adv * outputs.log_probs + 0.05 * kl
    kl_mean = aggregate_loss(kl.detach(), batch.loss_mask, "token-mean", ctx)
    kl_max = Metric(torch.where(batch.loss_mask != 0, kl.detach(), 0.0).max(), "max")  # kl >= 0
    return aggregate_loss(per_token, batch.loss_mask, "token-mean", ctx), {"kl": kl_mean, "kl_max": kl_max}


def critic_loss(
    outputs: TokenOutputs, batch: TokenBatch, ctx: LossContext
) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    """Token mean of ``(value - reward)^2`` over the global batch."""
    assert outputs.values is not None
    ret = batch.extras["rewards"].to(outputs.values.dtype)[:, None]
    return aggregate_loss((outputs.values - ret) ** 2, batch.loss_mask, "token-mean", ctx), {}


def configs(seed: int = 0) -> dict[str, EngineConfig]:
    """fp32 engine configs of the three roles (tiny Llama, random init; the critic is a value model)."""
    from transformers import LlamaConfig

    hf = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    # the value head of LlamaForTokenClassification applies dropout (0.1 unless configured) in training,
    # which draws from each rank's RNG; without it a step does not depend on how the batch is split
    critic_hf = LlamaConfig(**{**hf.to_dict(), "classifier_dropout": 0.0})
    common: dict[str, Any] = dict(
        optim=OptimConfig(lr=1e-3, eps=1e-6, grad_clip=1.0),
        micro_batch_max_tokens=24,
        param_dtype="float32",
        reduce_dtype="float32",
    )
    return {
        "actor": EngineConfig(model=ModelConfig(hf_config=hf, seed=seed), **common),
        "reference": EngineConfig(model=ModelConfig(hf_config=hf, seed=seed), **common),
        "critic": EngineConfig(model=ModelConfig(hf_config=critic_hf, seed=seed + 1, kind="value"), **common),
    }


def make_batch(seed: int, n: int = 7) -> TokenBatch:
    """``n`` right-padded sequences with a response mask, advantages and rewards (``n`` need not divide
    the data-parallel size)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    lens = torch.randint(4, SEQ + 1, (n,), generator=g)
    pos = torch.arange(SEQ)[None, :]
    attn = (pos < lens[:, None]).long()
    loss_mask = ((pos >= 2) & (attn == 1)).long()
    extras = {"advantages": torch.randn(n, generator=g), "rewards": torch.rand(n, generator=g)}
    return TokenBatch(ids * attn, attn, loss_mask, extras)


def _step(roles: Mapping[str, Any], batch: TokenBatch, turn: Any) -> dict[str, float]:
    """One iteration; ``turn(role)`` is a context manager yielding the role's ``EngineGroup``."""
    with turn("reference") as ref:
        ref_lp = ref.infer(batch).log_probs
    with turn("critic") as critic:
        values = critic.infer(batch).values
    batch = TokenBatch(
        batch.input_ids, batch.attention_mask, batch.loss_mask, {**batch.extras, "ref_log_probs": ref_lp}
    )
    with turn("actor") as actor:
        res = actor.forward_backward(batch, actor_loss)
        opt = actor.optimizer_step()
    with turn("critic") as critic:
        cres = critic.forward_backward(batch, critic_loss)
        copt = critic.optimizer_step()
    mask = batch.loss_mask.bool()
    return {
        "actor_loss": res.metrics["loss"],
        "actor_kl": res.metrics["kl"],
        "actor_grad_norm": opt.grad_norm,
        "critic_loss": cres.metrics["loss"],
        "critic_grad_norm": copt.grad_norm,
        "ref_logp_sum": float(ref_lp[mask].sum()),
        "value_sum": float(values[mask].sum()),
    }


def run(
    mode: str = "colocated", world_size: int = 2, steps: int = 2, device: str | None = None
) -> dict[str, Any]:
    """Run ``steps`` iterations in ``mode`` (``"colocated"`` or ``"separate"``); returns per-step metrics
    and, for colocated runs, rank 0's engine-call log ``(role, method, roles resident)``. Ray must be
    running or startable (``underlay.launch.ray.ensure_ray``)."""
    import ray.cloudpickle

    from underlay.launch.ray import WorkerGroup, ensure_ray

    # the loss functions travel by value, so the ranks need not import this file
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ensure_ray()
    cfgs = configs()
    history: list[dict[str, float]] = []
    if mode == "colocated":
        with WorkerGroup(world_size, device=device, engines=cfgs, name="roles") as group:
            for step in range(steps):
                history.append(_step(cfgs, make_batch(step), group.colocated))
            log = group.call_log(0)
        return {"mode": mode, "history": history, "call_log": log}
    if mode != "separate":
        raise ValueError(f"mode={mode!r}: use 'colocated' or 'separate'")
    sizes = {"actor": world_size, "reference": 1, "critic": 1}
    groups = {r: WorkerGroup(sizes[r], device=device, engines={r: cfgs[r]}, name=r) for r in cfgs}
    try:
        from contextlib import nullcontext

        for step in range(steps):
            history.append(_step(cfgs, make_batch(step), lambda r: nullcontext(groups[r].engine(r))))
    finally:
        for g in groups.values():
            g.shutdown()
    return {"mode": mode, "history": history}


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--mode``, ``--world-size``, ``--steps``; prints the metrics as JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("colocated", "separate"), default="colocated")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args(argv)
    print(json.dumps(run(a.mode, a.world_size, a.steps), indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
