"""``EngineConfig.recompute="auto"`` (the default) on the mcore engine: it builds and trains with
megatron's no-recompute configuration (mcore has no memory policy of its own)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from tests._dist import run_distributed

pytestmark = [pytest.mark.mcore, pytest.mark.distributed]


def build_auto(rank: int, world: int) -> dict[str, Any]:
    from dataclasses import replace

    from tests.mcore import _helpers as M

    cfg = replace(M.engine_config(M.tiny_config("llama")), recompute="auto")
    engine = M.make_engine(cfg)
    res = engine.forward_backward(M.make_batch(0), M.pg_loss)
    step = engine.optimizer_step()
    return {
        "recompute": engine.config.recompute,
        "granularity": engine._tf_config.recompute_granularity,  # megatron's setting as built
        "loss": res.metrics["loss"],
        "norm": step.grad_norm,
        "supports": engine.supports_recompute("auto").available,
    }


def test_recompute_auto_builds_and_trains() -> None:
    (r,) = run_distributed(build_auto, 1, timeout_s=300)
    assert r["recompute"] == "auto" and r["supports"], r
    assert r["granularity"] is None, r  # "auto" -> no recomputation
    assert r["loss"] == r["loss"] and r["norm"] > 0, r  # finite loss, a real gradient
