"""Value types and configs validate themselves and name the bad value."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from underlay.interfaces import (
    AttentionSpec,
    ConfigError,
    EngineConfig,
    InvalidInput,
    ModelConfig,
    OptimConfig,
    ParallelLayout,
    ProcessGroups,
    ProfilerConfig,
    TokenBatch,
    from_dict,
)


def test_parallel_layout_checks_world_size() -> None:
    lay = ParallelLayout.infer(8, dp_replicate=2, ulysses=2)
    assert (lay.dp_shard, lay.dp, lay.ulysses, lay.mp, lay.edp) == (4, 4, 2, 2, 8)
    with pytest.raises(ConfigError, match="world size 6 is not divisible"):
        ParallelLayout.infer(6, tp=4)
    with pytest.raises(ConfigError, match="ulysses=3 must divide dp_shard=4"):
        ParallelLayout(4, dp_shard=4, ulysses=3)
    with pytest.raises(ConfigError, match="!= world_size 4"):
        ParallelLayout(4, dp_shard=2)
    with pytest.raises(ConfigError, match="tp=0"):
        ParallelLayout(1, tp=0)


def test_parallel_layout_v2_sizes_and_rules() -> None:
    # Megatron shapes: 16 ranks = pp 2 x tp 2 x cp 2 x dp 2; experts ep 4 x etp 1 -> edp 2
    lay = ParallelLayout.infer(16, tp=2, pp=2, vpp=3, cp=2, ep=4, etp=1)
    assert (lay.dp_shard, lay.dp, lay.edp, lay.mp, lay.vpp) == (2, 2, 2, 8, 3)
    assert ParallelLayout.infer(8, tp=2, ep=2).etp == 2  # etp defaults to tp, Megatron-Core's default
    with pytest.raises(ConfigError, match="vpp=2 needs pipeline parallelism"):
        ParallelLayout.infer(4, vpp=2)
    with pytest.raises(ConfigError, match=r"ep\*etp = 4\*2 = 8 must divide dp_shard\*cp\*tp = 2\*1\*2 = 4"):
        ParallelLayout.infer(4, tp=2, ep=4, etp=2)
    with pytest.raises(ConfigError, match="ParallelLayout.vpp=0"):
        ParallelLayout(1, vpp=0)
    with pytest.raises(ConfigError, match="pass a ProcessGroups"):
        ParallelLayout(1, groups={"dp": None})  # type: ignore[arg-type]
    from underlay.interfaces import ParallelConfig

    with pytest.raises(ConfigError, match="ParallelConfig.vpp=2 needs pp > 1"):
        ParallelConfig(vpp=2)
    with pytest.raises(ConfigError, match=r"unknown keys \['sp'\].*'ulysses'"):
        from_dict(ParallelConfig, {"sp": 2})
    assert ParallelConfig(etp=None).etp is None


def test_layout_is_frozen_and_groups_do_not_count() -> None:
    a = ParallelLayout(2, dp_shard=2, groups=ProcessGroups(dp=object()))  # type: ignore[arg-type]
    assert a == ParallelLayout(2, dp_shard=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tp = 2  # type: ignore[misc]


def test_attention_spec_rejects_bad_heads() -> None:
    with pytest.raises(InvalidInput, match="q heads 6 must be a positive multiple of kv heads 4"):
        AttentionSpec(torch.bfloat16, 64, 6, 4, "cuda")


def test_token_batch_validates_and_selects() -> None:
    ids = torch.randint(0, 10, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.long)
    with pytest.raises(InvalidInput, match="loss_mask shape"):
        TokenBatch(ids, mask, mask[:, :4])
    with pytest.raises(InvalidInput, match="extras\\['adv'\\] has batch size"):
        TokenBatch(ids, mask, mask, {"adv": torch.zeros(2)})
    adv = torch.randn(3)
    b = TokenBatch(ids, mask, mask, {"adv": adv}).select([2, 0])
    assert torch.equal(b.input_ids, ids[[2, 0]])
    assert torch.equal(b.extras["adv"], adv[[2, 0]])


def test_configs_from_dict_and_errors() -> None:
    cfg = from_dict(
        EngineConfig,
        {
            "model": {"path": "/m", "lora": {"rank": 4, "target_modules": ["q_proj"]}},
            "optim": {"lr": 1e-5, "betas": [0.9, 0.95]},
        },
    )
    assert cfg.model.lora is not None
    assert cfg.model.lora.target_modules == ("q_proj",)
    assert cfg.optim.betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match=r"unknown keys \['lrr'\]"):
        from_dict(OptimConfig, {"lrr": 1.0})
    with pytest.raises(ConfigError, match="exactly one of path"):
        ModelConfig()
    with pytest.raises(ConfigError, match="warmup_steps=-1"):
        OptimConfig(warmup_steps=-1)
    with pytest.raises(ConfigError, match="min_lr_ratio=1.5"):
        OptimConfig(min_lr_ratio=1.5)
    with pytest.raises(ConfigError, match="needs total_steps"):
        OptimConfig(schedule="cosine")
    with pytest.raises(ConfigError, match="param_dtype='fp8'"):
        EngineConfig(ModelConfig(path="/m"), param_dtype="fp8")


def test_profiler_config_loads_dict_and_omegaconf() -> None:
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf

    a = ProfilerConfig.load({"ranks": [0, 1], "steps": [2, 3], "with_memory": True})
    b = ProfilerConfig.load(OmegaConf.create({"ranks": [0, 1], "steps": [2, 3], "with_memory": True}))
    assert a == b
    assert a.ranks == (0, 1)
    with pytest.raises(ConfigError, match="steps"):
        ProfilerConfig(steps=(-1,))
