"""WeightMap and the shared rule constructors: exact float64 round trips, Megatron's fused layouts
(q/k/v grouped per query group, [gate; up] per tensor-parallel rank), experts, resolution."""

from __future__ import annotations

import pytest
import torch

from underlay.engines._weightmap import fuse_gate_up, fuse_qkv, rename, stack_experts
from underlay.interfaces import ConfigError, InvalidInput, RulePattern, WeightMap

NH, NG, D, HID = 8, 2, 4, 16  # 8 query heads in 2 groups of 4, head_dim 4, hidden 16


def _qkv() -> dict[str, torch.Tensor]:
    return {
        "q": torch.randn(NH * D, HID, dtype=torch.float64),
        "k": torch.randn(NG * D, HID, dtype=torch.float64),
        "v": torch.randn(NG * D, HID, dtype=torch.float64),
    }


def test_fuse_qkv_groups_queries_with_their_kv_head_and_round_trips() -> None:
    rule = fuse_qkv("qkv", "q", "k", "v", num_heads=NH, num_kv_heads=NG, head_dim=D)
    hf = _qkv()
    fused = rule.from_hf(hf)
    per = NH // NG
    assert fused.shape == (NG * (per + 2) * D, HID)
    for g in range(NG):  # group g: its 4 query heads, then its k head, then its v head
        base = g * (per + 2) * D
        assert torch.equal(fused[base : base + per * D], hf["q"][g * per * D : (g + 1) * per * D])
        assert torch.equal(fused[base + per * D : base + (per + 1) * D], hf["k"][g * D : (g + 1) * D])
        assert torch.equal(fused[base + (per + 1) * D : base + (per + 2) * D], hf["v"][g * D : (g + 1) * D])
    back = rule.to_hf(fused)
    assert all(torch.equal(back[n], hf[n]) for n in hf)
    # negative control: the plain [q; k; v] concatenation is a different tensor
    assert not torch.equal(torch.cat([hf["q"], hf["k"], hf["v"]]), fused)
    # biases ([rows]) follow the same grouping
    bias = {n: t[:, 0].clone() for n, t in hf.items()}
    assert torch.equal(rule.from_hf(bias), fused[:, 0])
    assert rule.hf_shapes(tuple(fused.shape)) == {"q": (NH * D, HID), "k": (NG * D, HID), "v": (NG * D, HID)}


def test_fuse_qkv_tp_splits_whole_query_groups() -> None:
    rule = fuse_qkv("qkv", "q", "k", "v", num_heads=NH, num_kv_heads=NG, head_dim=D)
    hf = _qkv()
    full = rule.from_hf(hf)
    tp, per = 2, NH // NG
    pieces = [rule.tp_shard(full, r, tp) for r in range(tp)]
    for r in range(tp):  # rank r's piece is the fused tensor of its own heads: q heads and kv head of group r
        local = fuse_qkv("qkv", "q", "k", "v", num_heads=NH // tp, num_kv_heads=NG // tp, head_dim=D).from_hf(
            {n: t.chunk(tp)[r] for n, t in hf.items()}
        )
        assert torch.equal(pieces[r], local)
    assert torch.equal(rule.tp_unshard(pieces), full)
    assert per == 4
    with pytest.raises(ConfigError, match="cannot be split over tp=4 ranks without splitting a unit"):
        rule.tp_shard(full, 0, 4)  # 2 query groups cannot go to 4 ranks


def test_fuse_gate_up_is_gate_then_up_per_tp_rank() -> None:
    rule = fuse_gate_up("fc1", "gate", "up")
    gate, up = torch.randn(12, HID, dtype=torch.float64), torch.randn(12, HID, dtype=torch.float64)
    full = rule.from_hf({"gate": gate, "up": up})
    assert torch.equal(full, torch.cat([gate, up]))
    tp = 3
    pieces = [rule.tp_shard(full, r, tp) for r in range(tp)]
    for r in range(tp):
        assert torch.equal(pieces[r], torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
    assert not torch.equal(pieces[0], full.chunk(tp)[0])  # a plain split of [gate; up] differs
    assert torch.equal(rule.tp_unshard(pieces), full)
    back = rule.to_hf(full)
    assert torch.equal(back["gate"], gate) and torch.equal(back["up"], up)


def test_rename_splits_along_its_tp_dim() -> None:
    rule = rename("proj", "o_proj.weight", tp_dim=1)
    w = torch.randn(HID, 12, dtype=torch.float64)
    pieces = [rule.tp_shard(w, r, 2) for r in range(2)]
    assert torch.equal(pieces[1], w[:, 6:]) and torch.equal(rule.tp_unshard(pieces), w)
    assert rule.tp_shard(w, 0, 1) is w
    replicated = rename("norm", "norm.weight")
    assert replicated.tp_shard(w, 1, 2) is w
    with pytest.raises(InvalidInput, match="rank 2 is not in"):
        rule.tp_shard(w, 2, 2)


def test_experts_fused_in_memory_per_expert_on_disk() -> None:
    e, inter = 3, 5
    tmpl = ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight")
    gate_up = stack_experts("experts.gate_up_proj", tmpl, e)
    down = stack_experts("experts.down_proj", ("experts.{e}.down_proj.weight",), e)
    hf = {n.format(e=i): torch.randn(inter, HID, dtype=torch.float64) for i in range(e) for n in tmpl}
    hf_down = {
        f"experts.{i}.down_proj.weight": torch.randn(HID, inter, dtype=torch.float64) for i in range(e)
    }
    fused = gate_up.from_hf(hf)
    assert fused.shape == (e, 2 * inter, HID)  # transformers 5's gate_up_proj [E, 2I, H]
    for i in range(e):
        assert torch.equal(fused[i, :inter], hf[f"experts.{i}.gate_proj.weight"])
        assert torch.equal(fused[i, inter:], hf[f"experts.{i}.up_proj.weight"])
    assert all(torch.equal(gate_up.to_hf(fused)[n], hf[n]) for n in hf)
    stacked = down.from_hf(hf_down)
    assert stacked.shape == (e, HID, inter)
    assert all(torch.equal(down.to_hf(stacked)[n], hf_down[n]) for n in hf_down)
    with pytest.raises(InvalidInput, match="experts.2.up_proj.weight' is missing"):
        gate_up.from_hf({k: v for k, v in hf.items() if k != "experts.2.up_proj.weight"})
    with pytest.raises(ConfigError, match="must each contain"):
        stack_experts("x", ("experts.gate",), 2)


def test_transformers_moe_module_matches_the_expert_rule() -> None:
    """The rule's fused tensor is what transformers builds from a per-expert checkpoint."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=3,
        num_experts_per_tok=2,
    )
    import tempfile

    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        disk = load_file(f"{d}/model.safetensors")
    p = "model.layers.0.mlp.experts"
    rule = stack_experts(f"{p}.gate_up_proj", (p + ".{e}.gate_proj.weight", p + ".{e}.up_proj.weight"), 3)
    mem = dict(model.named_parameters())[f"{p}.gate_up_proj"].detach()
    assert torch.equal(rule.from_hf(disk), mem)


def test_weight_map_resolves_patterns_ties_and_ignores() -> None:
    params = [
        ("emb", (10, 4)),
        ("layers.0.qkv", (NG * (NH // NG + 2) * D, HID)),
        ("layers.0.lora_A.x", (2, 4)),
    ]
    patterns = [
        RulePattern(r".*lora_A.*", skip=True),
        RulePattern(
            r"layers\.(?P<i>\d+)\.qkv",
            lambda m, shape: fuse_qkv(
                m.string,
                f"l{m['i']}.q",
                f"l{m['i']}.k",
                f"l{m['i']}.v",
                num_heads=NH,
                num_kv_heads=NG,
                head_dim=D,
            ),
        ),
        RulePattern(r"emb", lambda m, shape: rename(m.string, "embed.weight")),
    ]
    wmap = WeightMap.resolve(params, patterns, tied={"head.weight": "embed.weight"}, ignored=("extra.*",))
    assert [r.engine_name for r in wmap.rules] == ["emb", "layers.0.qkv"]
    assert wmap.hf_names() == ["embed.weight", "l0.q", "l0.k", "l0.v"]
    assert wmap.rule_for_hf("head.weight") is wmap.rule("emb")
    assert wmap.rules[1].hf_shapes()["l0.k"] == (NG * D, HID)
    assert wmap.is_ignored("extra.bias") and not wmap.is_ignored("embed.weight")
    hf = dict(wmap.to_hf([("emb", torch.ones(10, 4))]))
    assert list(hf) == ["embed.weight"]
    with pytest.raises(ConfigError, match="'other' matches no rule pattern"):
        WeightMap.resolve([("other", (1,))], patterns)
    with pytest.raises(ConfigError, match="claimed by 'a' and 'b'"):
        WeightMap((rename("a", "x"), rename("b", "x")))
    with pytest.raises(InvalidInput, match="no rule for engine parameter 'nope'"):
        wmap.rule("nope")


def _megatron_patterns(cfg: object) -> list[RulePattern]:
    """A Megatron-Core (local spec) naming of a Qwen3 decoder, written with the shared constructors."""
    nh, ng, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim  # type: ignore[attr-defined]
    layer = r"decoder\.layers\.(?P<i>\d+)\."

    def hf(m: object, rest: str) -> str:
        return f"model.layers.{m['i']}.{rest}"  # type: ignore[index]

    return [
        RulePattern(
            r"embedding\.word_embeddings\.weight",
            lambda m, s: rename(m.string, "model.embed_tokens.weight", tp_dim=0),
        ),
        RulePattern(r"output_layer\.weight", lambda m, s: rename(m.string, "lm_head.weight", tp_dim=0)),
        RulePattern(r"decoder\.final_layernorm\.weight", lambda m, s: rename(m.string, "model.norm.weight")),
        RulePattern(
            layer + r"self_attention\.linear_qkv\.weight",
            lambda m, s: fuse_qkv(
                m.string,
                hf(m, "self_attn.q_proj.weight"),
                hf(m, "self_attn.k_proj.weight"),
                hf(m, "self_attn.v_proj.weight"),
                num_heads=nh,
                num_kv_heads=ng,
                head_dim=d,
            ),
        ),
        RulePattern(
            layer + r"self_attention\.linear_proj\.weight",
            lambda m, s: rename(m.string, hf(m, "self_attn.o_proj.weight"), tp_dim=1),
        ),
        RulePattern(
            layer + r"self_attention\.q_layernorm\.weight",
            lambda m, s: rename(m.string, hf(m, "self_attn.q_norm.weight")),
        ),
        RulePattern(
            layer + r"self_attention\.k_layernorm\.weight",
            lambda m, s: rename(m.string, hf(m, "self_attn.k_norm.weight")),
        ),
        RulePattern(
            layer + r"input_layernorm\.weight", lambda m, s: rename(m.string, hf(m, "input_layernorm.weight"))
        ),
        RulePattern(
            layer + r"pre_mlp_layernorm\.weight",
            lambda m, s: rename(m.string, hf(m, "post_attention_layernorm.weight")),
        ),
        RulePattern(
            layer + r"mlp\.linear_fc1\.weight",
            lambda m, s: fuse_gate_up(m.string, hf(m, "mlp.gate_proj.weight"), hf(m, "mlp.up_proj.weight")),
        ),
        RulePattern(
            layer + r"mlp\.linear_fc2\.weight",
            lambda m, s: rename(m.string, hf(m, "mlp.down_proj.weight"), tp_dim=1),
        ),
    ]


def test_a_megatron_core_map_round_trips_a_transformers_model_and_splits_it_for_tp() -> None:
    """The map is expressive enough for Megatron-Core: every HF tensor of a Qwen3 goes into Megatron's
    fused layouts and back exactly, and the TP pieces are what rank r of tp=2 holds."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf_sd = {k: v.double() for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    per, d = 2, 4
    shapes = {
        "embedding.word_embeddings.weight": (32, 16),
        "output_layer.weight": (32, 16),
        "decoder.final_layernorm.weight": (16,),
    }
    for i in range(2):
        p = f"decoder.layers.{i}."
        shapes |= {
            p + "self_attention.linear_qkv.weight": (2 * (per + 2) * d, 16),
            p + "self_attention.linear_proj.weight": (16, 16),
            p + "self_attention.q_layernorm.weight": (d,),
            p + "self_attention.k_layernorm.weight": (d,),
            p + "input_layernorm.weight": (16,),
            p + "pre_mlp_layernorm.weight": (16,),
            p + "mlp.linear_fc1.weight": (48, 16),
            p + "mlp.linear_fc2.weight": (16, 24),
        }
    wmap = WeightMap.resolve(shapes.items(), _megatron_patterns(cfg))
    assert sorted(wmap.hf_names()) == sorted(hf_sd)
    for rule in wmap.rules:
        assert rule.hf_shapes() == {n: tuple(hf_sd[n].shape) for n in rule.hf_names}
    full = {r.engine_name: r.from_hf(hf_sd) for r in wmap.rules}
    assert dict(wmap.to_hf(full.items())).keys() == hf_sd.keys()
    assert all(torch.equal(t, hf_sd[n]) for n, t in wmap.to_hf(full.items()))
    # tp=2: rank 1's linear_qkv holds query group 1 whole, fc1 holds [gate_1; up_1], fc2 the second column half
    qkv = wmap.rule("decoder.layers.0.self_attention.linear_qkv.weight")
    q, k = hf_sd["model.layers.0.self_attn.q_proj.weight"], hf_sd["model.layers.0.self_attn.k_proj.weight"]
    piece = qkv.tp_shard(full[qkv.engine_name], 1, 2)
    assert torch.equal(piece[: per * d], q[per * d :]) and torch.equal(piece[per * d : (per + 1) * d], k[d:])
    fc1 = wmap.rule("decoder.layers.0.mlp.linear_fc1.weight")
    gate, up = hf_sd["model.layers.0.mlp.gate_proj.weight"], hf_sd["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1.tp_shard(full[fc1.engine_name], 1, 2), torch.cat([gate[12:], up[12:]]))
    fc2 = wmap.rule("decoder.layers.0.mlp.linear_fc2.weight")
    down = hf_sd["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(fc2.tp_shard(full[fc2.engine_name], 1, 2), down[:, 12:])
