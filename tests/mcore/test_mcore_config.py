"""Config conversion, layout validation, the weight map and engine selection (no megatron process)."""

from __future__ import annotations

import pytest
import torch

from tests.mcore._helpers import tiny_config
from underlay.engines.mcore.config import arch_of, check_layout, transformer_config_kwargs
from underlay.engines.mcore.weightmap import Rule, engine_rule, hf_shapes, stage_rules
from underlay.interfaces import ConfigError

pytestmark = pytest.mark.mcore


def _layout(arch, **kw):  # type: ignore[no-untyped-def]
    sizes = dict(world=2, tp=1, pp=1, vpp=1, cp=1, ep=1, sequence_parallel=False)
    sizes.update(kw)
    sizes.setdefault("etp", sizes["tp"])  # megatron's default, as ParallelConfig.etp=None means
    return check_layout(arch, **sizes)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen2_tied", "qwen3", "qwen3_moe"])
def test_arch_of_supported_families(family: str) -> None:
    cfg = tiny_config(family)
    arch = arch_of(cfg)
    kw = transformer_config_kwargs(
        arch, tp=1, pp=1, vpp=1, cp=1, ep=1, etp=1, sequence_parallel=False, params_dtype=torch.float32
    )
    assert kw["num_query_groups"] == 2 and kw["hidden_dropout"] == 0.0
    assert kw["add_qkv_bias"] == family.startswith("qwen2")
    assert kw["qk_layernorm"] == family.startswith("qwen3")
    assert kw["kv_channels"] == (16 if family.startswith("qwen3") else 8)
    assert arch.tied == (family == "qwen2_tied")
    if family == "qwen3_moe":
        assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2
        # renormalised top-k == softmax over the top-k logits; without it, softmax over all experts first
        assert kw["moe_router_pre_softmax"] is (not cfg.norm_topk_prob)


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"hidden_act": "gelu"}, "activation 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}}, "yarn"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unrepresentable_configs_refused(over: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        arch_of(tiny_config("llama", **over))


def test_model_type_refused() -> None:
    from transformers import GPT2Config

    with pytest.raises(ConfigError, match="gpt2"):
        arch_of(GPT2Config())


@pytest.mark.parametrize(
    ("family", "sizes", "needle"),
    [
        ("llama", {"world": 3, "tp": 2}, "world size 3 is not a multiple of tp"),
        ("llama", {"world": 8, "tp": 8}, r"tp=8 must divide the attention heads \(4\)"),
        ("llama", {"world": 3, "pp": 3}, "4 layers are not divisible by pp\\*vpp = 3\\*1"),
        ("llama", {"world": 2, "pp": 2, "vpp": 4}, "not divisible by pp\\*vpp = 2\\*4 = 8"),
        ("llama", {"world": 2, "vpp": 2}, "vpp=2 needs pp > 1"),
        ("qwen3_moe", {"world": 3, "ep": 3}, "ep=3 must divide the number of experts 4"),
        ("qwen3_moe", {"world": 2, "tp": 2}, "requires sequence parallelism"),
        ("llama", {"world": 2, "ep": 2}, "dense model"),
        ("llama", {"world": 2, "sequence_parallel": True}, "needs tp > 1"),
        ("qwen3_moe", {"world": 2, "tp": 1, "etp": 2}, r"etp=2 > tp=1"),
        ("llama", {"world": 2, "tp": 2, "etp": 1}, "etp=1 with tp=2 on a dense model"),
    ],
)
def test_bad_layouts_refused(family: str, sizes: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _layout(arch_of(tiny_config(family)), **sizes)


@pytest.mark.parametrize(
    ("count", "pp", "group", "needle"),
    [
        (1, 2, None, "1 micro-batches with pp=2, vpp=2: .* needs at least 2"),
        (3, 2, None, "last group .* 1 < pp micro-batches"),
        (4, 3, 3, "last group .* 1 < pp"),
        (4, 2, 5, "needs at least 5"),
    ],
)
def test_interleaved_micro_batch_count_refused(count: int, pp: int, group: int | None, needle: str) -> None:
    """Counts megatron's interleaved schedule refuses raise ConfigError naming the count and the fix
    (the engine checks its plan before the schedule runs); accepted counts pass, and vpp=1 is free."""
    from underlay.engines.mcore.config import check_interleaved_count

    with pytest.raises(ConfigError, match=needle):
        check_interleaved_count(count, pp=pp, vpp=2, group_size=group)
    for ok in (2, 4, 6):
        check_interleaved_count(ok, pp=2, vpp=2)
    check_interleaved_count(7, pp=3, vpp=2, group_size=4)  # last group of 3 >= pp
    check_interleaved_count(1, pp=2, vpp=1)


def test_qkv_fusion_is_per_query_group() -> None:
    """The engine's ``linear_qkv`` rule (``engine_rule``, what load and export use): rows grouped per
    query group, TP rank ``r`` holds whole groups, and ``to_hf`` gives back q, k and v."""
    arch = arch_of(tiny_config("llama"))  # 4 query heads, 2 groups
    heads, groups, d = arch.heads, arch.num_query_groups, arch.head_dim
    names = tuple(f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv")
    rule = engine_rule(Rule("decoder.layers.0.self_attention.linear_qkv.weight", names, "qkv", arch), arch)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * d, arch.hidden, generator=g) for n in (heads, groups, groups))
    fused = rule.from_hf(dict(zip(names, (q, k, v))))
    per = heads // groups
    # group 0 = its q heads, then k head 0, then v head 0
    assert torch.equal(fused[: per * d], q[: per * d])
    assert torch.equal(fused[per * d : (per + 1) * d], k[:d])
    assert torch.equal(fused[(per + 1) * d : (per + 2) * d], v[:d])
    assert torch.equal(rule.tp_shard(fused, 1, 2), fused[(per + 2) * d :])  # rank 1: group 1 whole
    back = rule.to_hf(fused)
    assert all(torch.equal(back[n], t) for n, t in zip(names, (q, k, v)))


def test_gate_up_per_rank_and_roundtrip() -> None:
    """``linear_fc1``: TP rank ``r`` holds gate's ``r``-th chunk, then up's; ``to_hf`` inverts."""
    arch = arch_of(tiny_config("llama"))
    names = ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    rule = engine_rule(Rule("decoder.layers.0.mlp.linear_fc1.weight", names, "gate_up", arch), arch)
    gate, up = torch.arange(8.0)[:, None], 100 + torch.arange(8.0)[:, None]
    full = rule.from_hf(dict(zip(names, (gate, up))))
    pieces = [rule.tp_shard(full, r, 2) for r in range(2)]
    assert pieces[1][:, 0].tolist() == [4, 5, 6, 7, 104, 105, 106, 107]
    back = rule.to_hf(rule.tp_unshard(pieces))
    assert torch.equal(back[names[0]], gate) and torch.equal(back[names[1]], up)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_rules_shard_unshard_roundtrip(family: str) -> None:
    """Every rule of a whole model covers each HF tensor once; HF tensors -> engine tensor -> TP
    pieces -> engine tensor -> HF tensors gives back the same values."""
    arch = arch_of(tiny_config(family))
    shapes = hf_shapes(arch)
    rules = stage_rules(
        arch,
        first_layer=0,
        num_layers=arch.num_layers,
        pre_process=True,
        post_process=True,
        local_experts=arch.num_experts,
    )
    covered = {n for r in rules for n in r.hf}
    assert covered == set(shapes)
    g = torch.Generator().manual_seed(1)
    for rule in rules:
        wr = engine_rule(rule, arch)
        hf = {n: torch.randn(shapes[n], generator=g) for n in rule.hf}
        full = wr.from_hf(hf)
        back = wr.to_hf(wr.tp_unshard([wr.tp_shard(full, r, 2) for r in range(2)]))
        assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf), rule.name


def test_registry_refuses_mcore_on_cpu() -> None:
    from underlay.interfaces import BackendUnavailable
    from underlay.registry import probe

    result = probe("engine", "mcore")
    assert not result.available
    assert "accelerator" in result.reason and "_cpu_fixture" in result.hint
    from underlay.interfaces import EngineConfig, ModelConfig
    from underlay.registry import get_engine

    cfg = EngineConfig(model=ModelConfig(hf_config=tiny_config("llama")))
    with pytest.raises(BackendUnavailable, match="accelerator"):
        get_engine(cfg, "mcore")


@pytest.mark.parametrize(
    ("over", "options", "needle"),
    [
        # batched p2p at pp=2 pairs the two directions' transfers by posting order: swapped tensors
        ({"parallel": {"pp": 2, "vpp": 2}}, {"batch_p2p_comm": True}, "batch_p2p_comm=True with pp=2"),
        ({"parallel": {"ulysses": 2}}, {}, "ulysses=2"),
        ({"parallel": {"tp": 2, "etp": 1}}, {}, "etp=1 with tp=2 on a dense model"),
        ({}, {"sequence_parallel": "yes"}, "sequence_parallel='yes'"),
        ({}, {"vpp": 2}, "unknown mcore option"),
        ({}, {"tensor_parallel": 2}, "unknown mcore option"),
        # a value model whose head dropout transformers' rule reads as 1.0 (everything dropped)
        ({"model": {"kind": "value"}, "hf": {"classifier_dropout": 1.0}}, {}, r"value-head dropout 1.0"),
        # LoRA dropout kept in training: its masks would have to agree across TP ranks
        (
            {"model": {"lora": {"rank": 4, "dropout": 0.1}, "training_randomness": "keep"}},
            {},
            r"LoraConfig.dropout=0.1 with training_randomness='keep'",
        ),
    ],
)
def test_engine_refuses_before_any_state(
    over: dict[str, dict[str, object]], options: dict[str, object], needle: str
) -> None:
    """Bad engine configs raise ConfigError before megatron, a process group or the device is touched."""
    from underlay.engines.mcore.engine import MCoreEngine
    from underlay.interfaces import EngineConfig, LoraConfig, ModelConfig, ParallelConfig
    from underlay.registry import get_device

    model: dict[str, object] = {"hf_config": tiny_config("llama", **over.get("hf", {}))}
    model.update(over.get("model", {}))
    if "lora" in model:
        model["lora"] = LoraConfig(**model["lora"])  # type: ignore[arg-type]
    cfg = EngineConfig(
        model=ModelConfig(**model),  # type: ignore[arg-type]
        parallel=ParallelConfig(**over.get("parallel", {})),  # type: ignore[arg-type]
        options=options,
    )
    with pytest.raises(ConfigError, match=needle):
        MCoreEngine(cfg, get_device("cpu"))


def test_engine_on_cpu_without_fixture_is_unavailable() -> None:
    from underlay.engines.mcore.engine import MCoreEngine
    from underlay.interfaces import BackendUnavailable, EngineConfig, ModelConfig
    from underlay.registry import get_device

    cfg = EngineConfig(model=ModelConfig(hf_config=tiny_config("qwen3")))
    with pytest.raises(BackendUnavailable, match="_cpu_fixture"):
        MCoreEngine(cfg, get_device("cpu"))


def test_options_are_registered_and_recompute_is_probed() -> None:
    """``underlay info`` lists MCoreOptions through the registry; every recompute policy is supported."""
    from underlay.engines.mcore.options import MCoreOptions
    from underlay.registry import engine_options

    assert engine_options("mcore") is MCoreOptions
    for policy in ("none", "full", "selective"):
        assert MCoreOptions.supports_recompute(policy).available  # type: ignore[arg-type]
    assert not MCoreOptions.supports_recompute("some").available  # type: ignore[arg-type]
