"""Single-process pieces of the fsdp2 backend: layout validation, sp/head checks, meta building,
decoder-layer discovery, HF naming, signature diffs and the sharded safetensors writer."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dynamo import dynamo_report
from underlay.engines._hf_export import StreamingShardWriter
from underlay.engines.fsdp2 import _build
from underlay.engines.fsdp2.engine import signature_diff
from underlay.engines.fsdp2.parallelize import build_layout, decoder_layers, validate_ulysses
from underlay.interfaces import ConfigError, LoraConfig, ModelConfig, ParallelConfig


def _llama(**over: object) -> object:
    from transformers import LlamaConfig

    kw: dict[str, object] = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    kw.update(over)
    return LlamaConfig(**kw)


def test_layout_fills_dp_shard_and_keeps_ulysses_inside() -> None:
    lay = build_layout(ParallelConfig(ulysses=2), 4)
    assert (lay.dp_replicate, lay.dp_shard, lay.ulysses, lay.dp, lay.mp) == (1, 4, 2, 2, 2)
    hsdp = build_layout(ParallelConfig(dp_replicate=2), 4)
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.dp) == (2, 2, 4)


@pytest.mark.parametrize(
    ("par", "world", "needle"),
    [
        (ParallelConfig(tp=2), 4, "cannot run {'tp': 2}; set them to 1 or select UNDERLAY_ENGINE=mcore"),
        (ParallelConfig(pp=2), 4, "cannot run {'pp': 2}"),
        (ParallelConfig(pp=2, vpp=2), 4, "cannot run {'pp': 2, 'vpp': 2}"),
        (ParallelConfig(ep=2), 4, "cannot run {'ep': 2}"),
        (ParallelConfig(etp=2), 4, "cannot run {'etp': 2}"),
        (ParallelConfig(dp_replicate=2), 3, "not divisible by"),
        (ParallelConfig(ulysses=4), 2, "ulysses=4 must divide dp_shard=2"),
    ],
)
def test_layout_errors_name_the_fix(par: ParallelConfig, world: int, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        build_layout(par, world)


def test_engine_applies_the_one_ulysses_head_rule() -> None:
    validate_ulysses(_llama(), 2)
    validate_ulysses(_llama(hidden_size=24, num_attention_heads=3, num_key_value_heads=1), 1)
    # 4 q heads / 1 kv head over 2 ranks: the kv head is repeated (parallel.ulysses accepts it, so does the engine)
    validate_ulysses(_llama(hidden_size=32, num_attention_heads=4, num_key_value_heads=1), 2)
    with pytest.raises(ConfigError, match=r"ulysses=2 and num_kv_heads=3.*choose ulysses in \[1, 3, 6\]"):
        validate_ulysses(_llama(hidden_size=24, num_attention_heads=6, num_key_value_heads=3), 2)


def test_meta_build_keeps_buffers_and_finds_layers() -> None:
    cfg = _llama()
    model = _build.build_model(ModelConfig(hf_config=cfg), cfg, meta=True)
    assert all(p.device.type == "meta" for p in model.parameters())
    buffers = dict(model.named_buffers())
    assert buffers and all(b.device.type == "cpu" and torch.isfinite(b).all() for b in buffers.values())
    assert [type(m).__name__ for m in decoder_layers(model)] == ["LlamaDecoderLayer"] * 2
    lora = ModelConfig(hf_config=_llama(), lora=LoraConfig(rank=2, target_modules=("q_proj",)))
    peft_model = _build.build_model(lora, lora.hf_config, meta=True)
    assert len(decoder_layers(peft_model)) == 2
    tied_cfg = _llama(tie_word_embeddings=True)
    tied = _build.build_model(ModelConfig(hf_config=tied_cfg), tied_cfg, meta=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight, "meta build must keep the tie"
    with pytest.raises(ConfigError, match="no decoder layers"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_seeded_build_is_deterministic_and_rng_neutral() -> None:
    cfg = _llama()
    mc = ModelConfig(hf_config=cfg, seed=5)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = _build.seeded_state(mc, cfg)
    after = torch.rand(3)
    b = _build.seeded_state(mc, cfg)
    assert torch.equal(after, expected_next), "building from the seed must not move the caller's RNG"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = _build.seeded_state(ModelConfig(hf_config=cfg, seed=6), cfg)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_hf_names_drop_peft_wrapping() -> None:
    assert _build.hf_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert _build.hf_name("model.norm.weight") == "model.norm.weight"


def test_signature_diff_names_what_differs() -> None:
    a = {"architecture": "LlamaConfig", "params": {"w": [4, 4], "v": [2]}}
    assert signature_diff(a, json.loads(json.dumps(a))) == ""
    b = {"architecture": "Qwen2Config", "params": {"w": [4, 8], "u": [2]}}
    text = signature_diff(a, b)
    assert "Qwen2Config" in text and "missing from the checkpoint: ['u']" in text
    assert "does not have: ['v']" in text and "w [4, 4] != [4, 8]" in text


@pytest.mark.parametrize("buffer_bytes", [0, 1 << 20])  # written inline / by the writer thread
def test_shard_writer_flushes_at_the_limit(tmp_path: Path, buffer_bytes: int) -> None:
    from safetensors.torch import load_file

    tensors = {f"t{i}": torch.randn(16, 16) for i in range(5)}  # 1 KiB each
    entries = [(n, tuple(t.shape)) for n, t in tensors.items()]
    writer = StreamingShardWriter(tmp_path, entries, torch.float32, 2100, buffer_bytes)
    try:
        for n, t in tensors.items():
            writer.add(n, t)
        writer.finish()
    finally:
        writer.close()
    files = sorted(tmp_path.glob("*.safetensors"))
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 1024
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        loaded.update(load_file(str(f)))
    assert set(index["weight_map"]) == set(tensors)
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    assert not list(tmp_path.glob("*.tmp"))


def test_unknown_engine_option_is_refused_before_any_work() -> None:
    from transformers import LlamaConfig

    from underlay.backends.cpu.device import CpuDevice
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.interfaces import EngineConfig

    cfg = EngineConfig(ModelConfig(hf_config=LlamaConfig()), options={"reshard_after_foward": False})
    with pytest.raises(ConfigError, match=r"unknown fsdp2 option\(s\) \['reshard_after_foward'\]"):
        FSDP2Engine(cfg, CpuDevice())


class _OpCounter:
    """Counts matmul and elementwise aten ops run while active (a TorchDispatchMode)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = {"mm": 0, "other": 0}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                name = func._schema.name
                counts["mm" if name in ("aten::mm", "aten::addmm", "aten::bmm") else "other"] += 1
                return func(*args, **(kwargs or {}))

        self.counts = counts
        self.mode = Mode()


@pytest.mark.parametrize("mode", ["none", "full"])
def test_activation_checkpointing_modes_keep_gradients_and_differ_in_recomputation(mode: str) -> None:
    from transformers import AutoModelForCausalLM

    from underlay.engines.fsdp2.parallelize import apply_activation_checkpointing

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_llama(), dtype=torch.float64)
    ref = AutoModelForCausalLM.from_config(_llama(), dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    apply_activation_checkpointing(model, mode)
    model.train()
    ref.train()
    ids = torch.randint(0, 64, (2, 12))
    ref(input_ids=ids).logits.square().mean().backward()
    loss = model(input_ids=ids).logits.square().mean()
    counter = _OpCounter()
    with counter.mode:
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)
    # backward of the un-checkpointed reference, measured the same way
    ref.zero_grad()
    base = _OpCounter()
    loss_ref = ref(input_ids=ids).logits.square().mean()
    with base.mode:
        loss_ref.backward()
    if mode == "none":
        assert counter.counts == base.counts
    else:  # the layers' forward matmuls run again
        assert counter.counts["mm"] >= base.counts["mm"] + 10


@pytest.mark.parametrize("value", ["selective", 2])
def test_activation_checkpointing_value_is_validated(value: object) -> None:
    from underlay.interfaces import EngineConfig

    with pytest.raises(ConfigError, match="activation_checkpointing"):
        EngineConfig(model=ModelConfig(hf_config=_llama()), activation_checkpointing=value)  # type: ignore[arg-type]


def test_recompute_policy_and_its_deprecated_alias() -> None:
    from underlay.interfaces import EngineConfig

    model = ModelConfig(hf_config=_llama())
    assert EngineConfig(model).recompute == "auto"
    assert EngineConfig(model, recompute="full").recompute == "full"
    with pytest.warns(DeprecationWarning, match="recompute"):
        assert EngineConfig(model, activation_checkpointing=True).recompute == "full"
    with (
        pytest.warns(DeprecationWarning, match="deprecated"),
        pytest.raises(ConfigError, match="contradicts recompute='full'"),
    ):
        EngineConfig(model, recompute="full", activation_checkpointing=False)
    with pytest.raises(ConfigError, match="recompute='some'"):
        EngineConfig(model, recompute="some")  # type: ignore[arg-type]


def test_selective_recompute_is_refused_with_the_reason() -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.engines.fsdp2.options import FSDP2Options
    from underlay.interfaces import EngineConfig

    assert FSDP2Options.supports_recompute("full").available
    assert "slower" in FSDP2Options.supports_recompute("selective").reason
    with pytest.raises(ConfigError, match="recompute='selective'.*measured slower.*use recompute='full'"):
        FSDP2Engine(EngineConfig(ModelConfig(hf_config=_llama()), recompute="selective"), CpuDevice())


@pytest.mark.parametrize(
    ("mode", "scope", "count"),
    [("none", "layer_parts", 4), ("full", "norm_mlp", 1), ("none", "layer", 1), ("full", "layer", 1)],
)
def test_compiled_layer_parts_keep_gradients(mode: str, scope: str, count: int) -> None:
    from transformers import AutoModelForCausalLM

    from underlay.engines.fsdp2.parallelize import apply_activation_checkpointing, compile_layer_parts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_llama(), dtype=torch.float64)
    ref = AutoModelForCausalLM.from_config(_llama(), dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    apply_activation_checkpointing(model, mode)
    # per layer: the 2 norms and the MLP, plus the attention module for "layer_parts"; or the layer
    # (always under recomputation: the checkpoint goes inside the compiled layer)
    n = compile_layer_parts(model, backend="aot_eager", scope=scope)
    assert n == 2 * count
    for length in (9, 12):  # a second length: dynamic shapes
        ids = torch.randint(0, 64, (1, length))
        model(input_ids=ids).logits.square().mean().backward()
        ref(input_ids=ids).logits.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_bad_compile_option_is_refused_before_any_work() -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.interfaces import EngineConfig

    cfg = EngineConfig(ModelConfig(hf_config=_llama()), options={"compile": "everything"})
    with pytest.raises(ConfigError, match="compile='everything'.*layer_parts"):
        FSDP2Engine(cfg, CpuDevice())
    for bad in (0, 1.5, "0.8", True):
        cfg = EngineConfig(
            ModelConfig(hf_config=_llama()), options={"compile": "layer", "compile_memory_budget": bad}
        )
        with pytest.raises(ConfigError, match=r"compile_memory_budget=.*\(0, 1\]"):
            FSDP2Engine(cfg, CpuDevice())


def test_compile_leaves_the_vision_tower_eager() -> None:
    """Only the text decoder layers of a vision-language model are compiled: a compiled vision block
    recompiles per image count, and its recomputation could then differ from its forward."""
    from tests.unit.models._tiny import tiny_vl_model
    from underlay.engines.fsdp2.parallelize import compile_layer_parts, decoder_layers

    model = tiny_vl_model("qwen2_5_vl")
    text = model.model.language_model.layers
    vision = model.model.visual.blocks
    assert len(decoder_layers(model)) == len(text) + len(vision)
    assert compile_layer_parts(model, backend="aot_eager", scope="layer") == len(text)
    assert all("forward" in vars(layer) for layer in text)
    assert not any("forward" in vars(block) for block in vision)


@pytest.mark.parametrize(("dynamic", "graphs"), [(None, 2), (True, 1)])
def test_recompute_compiles_one_dynamic_graph_per_layer(dynamic: bool | None, graphs: int) -> None:
    """Under recomputation the engine compiles with ``dynamic=True``: one graph (the checkpointed layer)
    serves every length from the first call (by default a first static graph is followed by a dynamic
    one)."""
    from transformers import AutoModelForCausalLM

    from underlay.engines.fsdp2.parallelize import apply_activation_checkpointing, compile_layer_parts

    compiled: list[int] = []

    def counting(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]) -> Any:
        compiled.append(1)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_llama(), dtype=torch.float64)
    apply_activation_checkpointing(model, "full")
    compile_layer_parts(model, backend=counting, scope="layer", dynamic=dynamic)  # type: ignore[arg-type]
    for length in (9, 12, 15):
        ids = torch.randint(0, 64, (1, length))
        model(input_ids=ids).logits.square().mean().backward()
    assert len(compiled) == graphs, dynamo_report()
