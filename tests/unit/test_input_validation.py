"""Issue 18 item 7: every config value, environment value and public argument is validated where it
enters, with the fix in the message, before any state changes. Each case reproduces a bad input that
was once accepted."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import underlay
from underlay import registry
from underlay.interfaces import (
    ConfigError,
    EngineConfig,
    InvalidInput,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PluginError,
)

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


def _model() -> ModelConfig:
    return ModelConfig(hf_config=object())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": math.nan}, "lr=nan"),
        ({"lr": math.inf}, "lr=inf"),
        ({"lr": -1e-3}, "lr=-0.001"),
        ({"lr": True}, "lr=True"),
        ({"betas": (1.0, 0.999)}, r"betas\[0\]=1.0"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]=-0.1"),
        ({"betas": (0.9, math.nan)}, r"betas\[1\]=nan"),
        ({"betas": (0.9,)}, "two numbers"),
        ({"eps": -1e-8}, "eps=-1e-08"),
        ({"eps": math.inf}, "eps=inf"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1"),
        ({"grad_clip": math.nan}, "grad_clip"),
        ({"grad_clip": -math.inf}, "grad_clip"),
        ({"warmup_steps": 1.5}, "warmup_steps=1.5"),
        ({"schedule": "cosine", "total_steps": 10.5}, "total_steps=10.5"),
        ({"min_lr_ratio": math.nan}, "min_lr_ratio=nan"),
    ],
)
def test_optim_config_refuses_non_finite_and_out_of_range(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        OptimConfig(**kwargs)


def test_optim_config_accepts_the_boundaries() -> None:
    OptimConfig(lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0, grad_clip=None)
    OptimConfig(grad_clip=0.0)  # 0 disables clipping, as documented


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batch_max_tokens": 1.5}, "micro_batch_max_tokens=1.5"),
        ({"micro_batch_max_tokens": True}, "micro_batch_max_tokens=True"),
        ({"temperature": math.inf}, "temperature=inf"),
        ({"temperature": math.nan}, "temperature=nan"),
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"cpu_offload": "yes"}, "cpu_offload='yes'"),
    ],
)
def test_engine_config_refuses_bad_values(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model=_model(), **kwargs)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ParallelConfig(tp=True), "tp=True"),
        (lambda: ParallelConfig(ulysses=2.0), "ulysses=2.0"),
        (lambda: LoraConfig(rank=2.5), "rank=2.5"),
        (lambda: LoraConfig(alpha=math.nan), "alpha=nan"),
        (lambda: LoraConfig(dropout=math.nan), "dropout=nan"),
        (lambda: ModelConfig(hf_config=object(), seed=-1), "seed=-1"),
        (lambda: ModelConfig(hf_config=object(), attention=""), "attention=''"),
        (lambda: ModelConfig(hf_config=object(), tiled_mlp_tiles=0), "tiled_mlp_tiles=0"),
    ],
)
def test_other_configs_refuse_bad_values(build: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build()


def test_explicit_auto_conflicts_with_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # DESIGN.md: explicit argument and environment both given and different -> error, also for "auto"
    monkeypatch.setenv("UNDERLAY_DEVICE", "npu")
    with pytest.raises(ConfigError, match="'auto' by argument but 'npu'"):
        registry.resolve("device", "auto")
    monkeypatch.setenv("UNDERLAY_DEVICE", "auto")
    assert registry.resolve("device", "cpu").name == "cpu"  # an env "auto" requests nothing
    monkeypatch.setenv("UNDERLAY_DEVICE", "cpu")
    assert registry.resolve("device", "cpu").name == "cpu"


def test_plugin_error_is_raised_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("UNDERLAY_PLUGINS", "brokenplugin")
    registry.reset()
    try:
        for _ in range(3):
            with pytest.raises(PluginError, match="brokenplugin"):
                underlay.get_device()
    finally:
        monkeypatch.delenv("UNDERLAY_PLUGINS")
        registry.reset()


def test_bad_attention_env_fails_when_the_model_is_prepared(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from underlay.interfaces import UnknownBackend
    from underlay.models import prepare_model

    cfg = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    monkeypatch.setenv("UNDERLAY_ATTENTION", "bogus")
    registry.reset()
    with pytest.raises(UnknownBackend, match="bogus"):
        prepare_model(model)


def test_planner_refuses_fractional_lengths() -> None:
    from underlay.ops import balanced_partitions, plan_micro_batches

    with pytest.raises(InvalidInput, match="1.5 is not a whole number"):
        plan_micro_batches([3, 1.5], 8)  # type: ignore[list-item]
    with pytest.raises(InvalidInput, match="not a whole number"):
        balanced_partitions(torch.tensor([2.0, 2.5]), 2)
    assert sum(len(m) for m in plan_micro_batches(torch.tensor([3.0, 2.0]), 8)) == 2  # whole floats pass


def test_clip_refuses_nan_bounds() -> None:
    from underlay.ops import clip_by_value

    x = torch.randn(8)
    with pytest.raises(InvalidInput, match="low bound is NaN"):
        clip_by_value(x, math.nan, 1.0)
    with pytest.raises(InvalidInput, match="high bound is NaN"):
        clip_by_value(x, torch.zeros(8), torch.full((8,), math.nan))
    out = clip_by_value(x, -math.inf, 0.0)  # an infinite bound is no bound
    assert torch.equal(out, x.clamp(max=0.0))


def test_tracking_reserves_step_and_time(tmp_path: Path) -> None:
    from underlay.tracking import Tracking

    with Tracking(["jsonl"], out_dir=tmp_path) as tr:
        path = tr.jsonl_path
        for name in ("step", "time"):
            with pytest.raises(InvalidInput, match=f"{name!r} is reserved"):
                tr.log({name: 99.0, "loss": 1.0}, step=3)
        tr.log({"loss": 1.0}, step=3)
    rows = [json.loads(line) for line in io.StringIO(path.read_text())]
    assert [r["step"] for r in rows] == [3]


@pytest.mark.parametrize(
    ("env", "value", "match"),
    [
        ("UNDERLAY_PEAK_TFLOPS", "nan", "finite number > 0"),
        ("UNDERLAY_PEAK_TFLOPS", "inf", "finite number > 0"),
        ("LOCAL_RANK", "-1", "LOCAL_RANK=-1"),
        ("MASTER_PORT", "70000", "MASTER_PORT=70000"),
        ("WORLD_SIZE", "0", "WORLD_SIZE=0"),
    ],
)
def test_environment_values_are_validated(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, match: str
) -> None:
    from underlay.parallel.distributed import read_env
    from underlay.utils.hardware import peak_flops_from_env

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError, match=match):
        peak_flops_from_env() if env == "UNDERLAY_PEAK_TFLOPS" else read_env()


def test_compile_backend_env_is_checked_at_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from underlay.engines._inductor import compile_backend

    monkeypatch.setenv("UNDERLAY_COMPILE_BACKEND", "bogus")
    with pytest.raises(ConfigError, match="UNDERLAY_COMPILE_BACKEND='bogus'"):
        compile_backend()
    monkeypatch.setenv("UNDERLAY_COMPILE_BACKEND", "eager")
    assert compile_backend() == "eager"


def test_schedule_and_profiler_counts() -> None:
    from underlay.interfaces import ProfilerConfig

    with pytest.raises(ConfigError, match="warmup_steps=20 exceeds total_steps=10"):
        OptimConfig(schedule="cosine", warmup_steps=20, total_steps=10)
    with pytest.raises(ConfigError, match="warmup=True"):
        ProfilerConfig(warmup=True)
    with pytest.raises(ConfigError, match=r"steps\[...\]=1.0"):
        ProfilerConfig(steps=(1.0,))  # type: ignore[arg-type]


def test_normalisation_settings_must_be_finite() -> None:
    from underlay.ops import group_mean_std, group_normalize, masked_whiten

    scores = torch.randn(6)
    ids = [0, 0, 1, 1, 2, 3]
    with pytest.raises(InvalidInput, match="eps=nan"):
        group_normalize(scores, ids, eps=math.nan)
    with pytest.raises(InvalidInput, match="single_std=inf"):
        group_normalize(scores, ids, single_std=math.inf)
    assert torch.isnan(group_mean_std(scores, ids, single_mean=math.nan)[0][-1])  # a documented marker
    with pytest.raises(InvalidInput, match="eps=nan"):
        masked_whiten(torch.randn(2, 3), torch.ones(2, 3), eps=math.nan)
    assert torch.isfinite(group_normalize(scores, ids)).all()
