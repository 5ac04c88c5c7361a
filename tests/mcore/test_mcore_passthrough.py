"""The validated pass-through of megatron config fields (``MCoreOptions.transformer/optimizer/ddp``)
and the uneven-stage and partial-recompute checks: refusals by name, before any process state."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from tests.mcore._helpers import tiny_config
from underlay.engines.mcore.config import arch_of, check_layout
from underlay.engines.mcore.options import MCoreOptions
from underlay.interfaces import ConfigError, EngineConfig, ModelConfig, ParallelConfig

pytestmark = pytest.mark.mcore


@pytest.mark.parametrize(
    ("options", "recompute", "parallel", "needle"),
    [
        # fields underlay owns, each with where to set it
        (
            {"transformer": {"tensor_model_parallel_size": 2}},
            "none",
            {},
            r"tensor_model_parallel_size.*ParallelConfig",
        ),
        ({"transformer": {"params_dtype": "bf16"}}, "none", {}, r"params_dtype.*EngineConfig.param_dtype"),
        ({"transformer": {"recompute_granularity": "full"}}, "none", {}, r"EngineConfig.recompute"),
        ({"transformer": {"num_layers": 2}}, "none", {}, r"'num_layers'.*set by underlay"),
        ({"optimizer": {"lr": 0.1}}, "none", {}, r"OptimConfig.lr"),
        ({"ddp": {"overlap_grad_reduce": True}}, "none", {}, r"MCoreOptions.overlap_grad_reduce"),
        # names megatron's dataclasses do not have, with the closest ones
        (
            {"transformer": {"recompute_methd": "block"}},
            "full",
            {},
            r"no field 'recompute_methd'.*recompute_method",
        ),
        ({"optimizer": {"adam_beta": 0.9}}, "none", {}, r"OptimizerConfig has no field 'adam_beta'"),
        ({"ddp": {"bucket_sz": 4}}, "none", {}, r"DistributedDataParallelConfig has no field 'bucket_sz'"),
        # partial recompute under the policy that uses it
        ({"transformer": {"recompute_method": "block"}}, "none", {}, r"needs EngineConfig.recompute='full'"),
        (
            {"transformer": {"recompute_modules": ["mlp"]}},
            "full",
            {},
            r"needs EngineConfig.recompute='selective'",
        ),
        ({"transformer": {"recompute_num_layers": 0}}, "full", {}, r"recompute_num_layers'\]=0"),
        ({"transformer": {"recompute_method": "every"}}, "full", {}, r"use 'uniform' or 'block'"),
        ({"overlap_param_gather": True}, "none", {}, r"overlap_param_gather=True needs"),
        ({"transformer": ["x"]}, "none", {}, r"give a mapping"),
    ],
)
def test_passthrough_refused_by_name(
    options: dict[str, Any], recompute: str, parallel: dict[str, int], needle: str
) -> None:
    """Each bad pass-through raises ConfigError naming the field before megatron's state or the
    device is touched (the engine refuses on the CPU without the fixture only after these checks)."""
    from underlay.engines.mcore.engine import MCoreEngine
    from underlay.registry import get_device

    cfg = EngineConfig(
        model=ModelConfig(hf_config=tiny_config("llama")),
        parallel=ParallelConfig(**parallel),  # type: ignore[arg-type]
        recompute=recompute,  # type: ignore[arg-type]
        options=options,
    )
    with pytest.raises(ConfigError, match=needle):
        MCoreEngine(cfg, get_device("cpu"))


@pytest.mark.parametrize(
    ("first", "last", "pp", "vpp", "needle"),
    [
        (1, None, 1, 1, r"need pp > 1"),
        (1, 2, 2, 1, r"leave 1 of the model's 4 layers for 0 other"),
        (1, None, 2, 2, r"not divisible by vpp=2"),
        (4, None, 2, 1, r"leave 0 of the model's 4 layers for 1 other"),
    ],
)
def test_uneven_stages_refused(first: int | None, last: int | None, pp: int, vpp: int, needle: str) -> None:
    """First/last stage layer counts that do not split the 4 layers over the stages are refused."""
    with pytest.raises(ConfigError, match=needle):
        check_layout(
            arch_of(tiny_config("llama")),
            world=2,
            tp=1,
            pp=pp,
            vpp=vpp,
            cp=1,
            ep=1,
            etp=1,
            sequence_parallel=False,
            stage_layers=(first, last),
        )
    # the even split of the same sizes is accepted
    check_layout(
        arch_of(tiny_config("llama")),
        world=2,
        tp=1,
        pp=2,
        vpp=1,
        cp=1,
        ep=1,
        etp=1,
        sequence_parallel=False,
        stage_layers=(1, 3),
    )


def test_megatron_validation_becomes_config_error() -> None:
    """megatron's own ``__post_init__`` refusal of a merged config is a ConfigError naming the passed
    fields (here a first-stage layer count with one pipeline stage)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from underlay.engines.mcore import passthrough

    extra = {"recompute_granularity_x": 1}
    with pytest.raises(ConfigError, match="no field"):
        passthrough.merge("transformer", TransformerConfig, {}, extra)
    base = dict(num_layers=2, hidden_size=8, num_attention_heads=2)
    extra2 = {"num_layers_in_first_pipeline_stage": 1}  # pp=1: no middle stage for the other layer
    kwargs = passthrough.merge("transformer", TransformerConfig, base, extra2)
    with pytest.raises(ConfigError, match=r"refuses the transformer config with options transformer=.*first"):
        passthrough.build("transformer", TransformerConfig, kwargs, extra2)


def test_options_keep_a_copy() -> None:
    """The pass-through mappings are copied: changing the caller's dict later changes nothing."""
    fields = {"recompute_method": "block"}
    opts = MCoreOptions(transformer=fields)
    fields["recompute_method"] = "uniform"
    assert opts.transformer == {"recompute_method": "block"}
