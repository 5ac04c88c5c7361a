"""fsdp2 engine options: ``compile_memory_budget`` belongs to the engine that asked for it (an actor and a
critic in one process keep their own), and typed options are validated before any work."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H


def job_two_budgets(rank: int, world: int) -> dict[str, Any]:
    """Two engines with different budgets, called alternately: each engine's layers run (and compile)
    under its own budget; outside the engines the process-wide value is untouched."""
    import torch._functorch.config as functorch_config

    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.engines.fsdp2.options import FSDP2Options
    from underlay.registry import get_device

    os.environ["UNDERLAY_COMPILE_BACKEND"] = "aot_eager"
    default = functorch_config.activation_memory_budget
    seen: dict[str, list[float]] = {"actor": [], "critic": []}
    engines = {}
    for name, budget in (("actor", 0.3), ("critic", 0.7)):
        options: Any = {"compile": "norm_mlp", "compile_memory_budget": budget}
        if name == "critic":  # the dataclass itself is accepted too
            options = FSDP2Options(compile="norm_mlp", compile_memory_budget=budget)
        engine = FSDP2Engine(H.engine_config(H.llama_config(), options=options), get_device("cpu"))
        for layer in engine.model.model.layers:
            layer.register_forward_pre_hook(
                lambda *_, n=name: seen[n].append(functorch_config.activation_memory_budget)
            )
        engines[name] = engine
    after_build = functorch_config.activation_memory_budget
    batch = H.global_batch(5)
    for name in ("actor", "critic", "actor"):
        engines[name].infer(batch)
    engines["critic"].forward_backward(batch, H.pg_loss)
    return {
        "default": default,
        "after_build": after_build,
        "after_calls": functorch_config.activation_memory_budget,
        "actor": sorted(set(seen["actor"])),
        "critic": sorted(set(seen["critic"])),
        "calls": (len(seen["actor"]), len(seen["critic"])),
    }


@pytest.mark.distributed
def test_compile_memory_budget_is_scoped_to_its_engine() -> None:
    (r,) = run_distributed(job_two_budgets, 1, timeout_s=300)
    assert r["actor"] == [0.3] and r["critic"] == [0.7], r
    assert r["calls"][0] > 0 and r["calls"][1] > 0, r
    assert r["after_build"] == r["default"] and r["after_calls"] == r["default"], r


def test_typed_options_are_validated_with_names() -> None:
    from underlay.engines.fsdp2.options import FSDP2Options
    from underlay.interfaces import ConfigError, describe_options, resolve_options
    from underlay.registry import engine_options

    assert engine_options("fsdp2") is FSDP2Options
    fields = {o.name: o for o in describe_options(FSDP2Options)}
    assert list(fields) == [
        "reshard_after_forward",
        "fused_adamw",
        "compile",
        "compile_memory_budget",
        "optimizer_offload",
        "grad_sync",
        "single_device",
        "activation_offload",
        "activation_offload_min_bytes",
    ]
    # every speed/memory option is auto (None) by default and documents what auto means
    for name in list(fields)[:7]:
        assert fields[name].default is None and "auto" in fields[name].doc, fields[name]
    assert "all-gathers" in fields["reshard_after_forward"].doc
    opts = resolve_options(FSDP2Options, {"compile": "layer", "compile_memory_budget": 1}, "fsdp2")
    assert opts == FSDP2Options(compile="layer", compile_memory_budget=1)
    with pytest.raises(ConfigError, match=r"unknown fsdp2 option\(s\) \['fused_adam'\]; fsdp2 accepts \["):
        resolve_options(FSDP2Options, {"fused_adam": True}, "fsdp2")
    with pytest.raises(ConfigError, match="reshard_after_forward='no': fsdp2 expects bool"):
        resolve_options(FSDP2Options, {"reshard_after_forward": "no"}, "fsdp2")
    with pytest.raises(ConfigError, match="grad_sync='always'.*'per_step'"):
        FSDP2Options(grad_sync="always")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="grad_sync=1: fsdp2 expects"):
        resolve_options(FSDP2Options, {"grad_sync": 1}, "fsdp2")
    with pytest.raises(ConfigError, match="compile_memory_budget=2.0.*\\(0, 1\\]"):
        FSDP2Options(compile_memory_budget=2.0)
    for bad in (-1, 0.5, True, "1M"):
        with pytest.raises(ConfigError, match="activation_offload_min_bytes=.*int >= 0"):
            FSDP2Options(activation_offload=True, activation_offload_min_bytes=bad)  # type: ignore[arg-type]
