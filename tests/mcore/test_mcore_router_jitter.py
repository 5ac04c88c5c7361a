"""MoE router jitter on the mcore engine: refused only where it would run differently from transformers
(``training_randomness="keep"`` with ``router_jitter_noise`` > 0), accepted with jitter off, where the
converted model computes what the same model without jitter computes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

import torch

from tests.mcore import _helpers as H
from tests.mcore.test_mcore_conformance import fixture_launcher
from underlay.interfaces import ConfigError

pytestmark = [pytest.mark.mcore]


def _mixtral(noise: float) -> Any:
    """The matrix's tiny mixtral (``coverage.tiny_config``) with ``H.VOCAB`` tokens and jitter ``noise``."""
    from underlay.models import coverage

    cfg = coverage.tiny_config("mixtral")
    cfg.vocab_size = H.VOCAB
    cfg.router_jitter_noise = noise
    return cfg


def _config(noise: float, randomness: str) -> Any:
    import dataclasses

    cfg = H.engine_config(_mixtral(noise))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, training_randomness=randomness))


@pytest.mark.parametrize("noise", [0.1, 0.5])
def test_router_jitter_kept_is_refused_by_name(noise: float) -> None:
    """``"keep"`` with jitter on: ``ConfigError`` naming the setting and the way out, before any
    process group or device check (the constructor runs here without the CPU fixture)."""
    from underlay.engines.mcore.engine import MCoreEngine
    from underlay.registry import get_device

    with pytest.raises(ConfigError, match=r"router_jitter_noise=.*training_randomness='keep'.*'off'"):
        MCoreEngine(_config(noise, "keep"), get_device("cpu"))


@pytest.mark.parametrize(("noise", "randomness"), [(0.0, "keep"), (0.1, "off")])
def test_router_jitter_off_passes_the_check(noise: float, randomness: str) -> None:
    from underlay.engines.mcore.config import check_training_randomness

    check_training_randomness(_mixtral(noise), randomness)  # no jitter would run: accepted


def job_jitter_off(rank: int, world: int) -> dict[str, float]:
    """World 1: a mixtral with ``router_jitter_noise=0.5`` and ``training_randomness="off"`` against
    the same model (seed 0) without jitter: the log-probs ``forward_backward`` hands the ``loss_fn``,
    ``infer``'s log-probs and the gradients, as largest absolute differences (must be 0)."""
    from megatron.core import parallel_state as ps

    batch = H.make_batch(4, b=4)
    runs = []
    for noise in (0.5, 0.0):
        eng = H.make_engine(_config(noise, "off"))
        seen: list[torch.Tensor] = []

        def loss_fn(outputs: Any, b: Any, ctx: Any, seen: list[torch.Tensor] = seen) -> Any:
            seen.append(outputs.log_probs.detach().clone())
            return H.pg_loss(outputs, b, ctx)

        eng.forward_backward(batch, loss_fn)
        grads = [p.main_grad.detach().clone() for p in eng.model.parameters()]
        eng.zero_grad()
        runs.append((seen, eng.infer(batch).log_probs, grads))
        del eng
        ps.destroy_model_parallel()
    (seen_j, infer_j, grads_j), (seen_0, infer_0, grads_0) = runs

    def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        assert len(a) == len(b) and a
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    return {
        "train_vs_plain": worst(seen_j, seen_0),
        "infer_vs_plain": float((infer_j - infer_0).abs().max()),
        "grads_vs_plain": worst(grads_j, grads_0),
    }


@pytest.mark.distributed
def test_router_jitter_off_runs_the_model_without_jitter() -> None:
    """Accepted with jitter off, the engine trains the model without jitter, bit for bit."""
    (out,) = fixture_launcher(job_jitter_off, 1)
    assert out == {"train_vs_plain": 0.0, "infer_vs_plain": 0.0, "grads_vs_plain": 0.0}, out
