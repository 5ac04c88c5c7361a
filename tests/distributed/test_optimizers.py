"""Optimizers by name (``OptimConfig(name=..., options=...)``): the fsdp2 engine at 2 ranks steps as
the same ``torch.optim`` optimizer on one float64 model does, and a checkpoint resumes it exactly;
bad names and options are refused before anything is built, on both engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H
from underlay.interfaces import ConfigError, OptimConfig

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CASES: list[tuple[str, dict[str, Any]]] = [
    ("SGD", {"momentum": 0.9, "nesterov": True}),
    ("RMSprop", {"momentum": 0.5, "centered": True}),
    ("Adam", {"amsgrad": True}),
    ("Adagrad", {"lr_decay": 0.01}),
]


def _optim(name: str, options: dict[str, Any]) -> OptimConfig:
    # eps 1e-6 where the optimizer has one: its first steps divide by |g| (sign-like), so gradients
    # near zero would turn float32-vs-float64 rounding into lr-sized differences
    from underlay.interfaces.config import optimizer_class, standard_optimizer_args

    eps = {"eps": 1e-6} if "eps" in standard_optimizer_args(optimizer_class(name)) else {}
    return OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=None, name=name, options=options, **eps)


def _reference(cfg: Any, batches: list[Any]) -> dict[str, torch.Tensor]:
    """The same optimizer class on one float64 model, full batches, token-mean of pg_loss's formula."""
    from underlay.interfaces.config import optimizer_class, standard_optimizer_args

    model = H.reference_model(cfg.model.hf_config, cfg.model.seed)
    o = cfg.optim
    cls = optimizer_class(o.name)
    kw = {k: getattr(o, k) for k in standard_optimizer_args(cls)}
    opt = cls(list(model.parameters()), lr=o.lr, weight_decay=o.weight_decay, **kw, **o.options)
    for batch in batches:
        out = H.reference_outputs(model, batch)
        assert out.log_probs is not None
        mask = batch.loss_mask.double()
        adv = batch.extras["advantages"].double()[:, None]
        per_token = -adv * out.log_probs + 0.1 * out.log_probs**2
        ((per_token * mask).sum() / mask.sum()).backward()
        opt.step()
        opt.zero_grad()
    return H.merged_weights(model)


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    from underlay import registry

    loader = registry.get_weight_loader("fsdp2")
    batches = [H.global_batch(1), H.global_batch(2)]
    out: dict[str, Any] = {}
    for name, options in CASES:
        cfg = H.engine_config(H.llama_config(), optim=_optim(name, options))
        engine = registry.get_engine(cfg)
        ckpt = Path(root) / name
        for i, b in enumerate(batches):
            if i == 1:
                if rank == 0:
                    ckpt.mkdir()
                torch.distributed.barrier()
                engine.save_checkpoint(ckpt)
            engine.forward_backward(H.shard(b, rank, world), H.pg_loss)
            engine.optimizer_step()
        got = {n: t.detach().cpu().clone() for n, t in loader.iter_hf_tensors(engine)}
        resumed = registry.get_engine(cfg)
        resumed.load_checkpoint(ckpt)
        resumed.forward_backward(H.shard(batches[1], rank, world), H.pg_loss)
        resumed.optimizer_step()
        again = {n: t.detach().cpu().clone() for n, t in loader.iter_hf_tensors(resumed)}
        out[f"{name}_resume_exact"] = got.keys() == again.keys() and all(
            torch.equal(got[k], again[k]) for k in got
        )
        out[f"{name}_moved"] = H.max_diff(got, H.merged_weights(H.reference_model(cfg.model.hf_config, 0)))
        if rank == 0:
            out[f"{name}_err"] = H.max_diff(got, _reference(cfg, batches))
    return out


def test_named_optimizers_step_like_torch_and_resume_exactly(tmp_path: Path) -> None:
    r = run_distributed(_job, 2, str(tmp_path))
    for name, _ in CASES:
        assert r[0][f"{name}_moved"] > 1e-4, name  # the steps changed the weights
        assert r[0][f"{name}_err"] < 2e-5, (name, r[0][f"{name}_err"])
        assert r[0][f"{name}_resume_exact"] and r[1][f"{name}_resume_exact"], name


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"name": "LBFGS"}, "closure"),
        ({"name": "Muon"}, "2-D"),
        ({"name": "adamww"}, "not a torch.optim optimizer"),
        ({"name": "SGD", "options": {"betas2": 1}}, "SGD takes no such argument"),
        ({"name": "SGD", "betas": (0.8, 0.9)}, "SGD has no betas"),
        ({"name": "SGD", "options": {"nesterov": True}}, "SGD refuses options"),
        ({"name": "RMSprop", "options": {"lr": 0.1}}, "set by the engine"),
        ({"name": "Adam", "options": {"foreach": True}}, "set by the engine"),
        ({"name": "SGD", "options": [("momentum", 0.9)]}, "mapping"),
    ],
)
def test_bad_optimizer_configs_are_refused_by_name(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        OptimConfig(**kw)


def test_engines_refuse_what_they_cannot_run_before_building() -> None:
    from underlay.engines.fsdp2.engine import _named_optimizer
    from underlay.engines.mcore.engine import _megatron_optimizer

    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ConfigError, match="host-offloaded variant"):
        _named_optimizer(p, _optim("SGD", {"momentum": 0.9}), offload=True)
    assert _megatron_optimizer(OptimConfig()) == ("adam", {})
    assert _megatron_optimizer(_optim("sgd", {"momentum": 0.9})) == ("sgd", {"sgd_momentum": 0.9})
    with pytest.raises(ConfigError, match="takes momentum only"):
        _megatron_optimizer(_optim("SGD", {"momentum": 0.9, "nesterov": True}))
    with pytest.raises(ConfigError, match="megatron-core's optimizers"):
        _megatron_optimizer(_optim("RMSprop", {}))
