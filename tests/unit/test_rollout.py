"""Rollout pieces that need no second process: bucket codec, payload rules, sinks, trace and replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from underlay.interfaces import CheckpointError, ConfigError, InvalidInput
from underlay.rollout.codec import ALIGN, pack_into, plan, tensor_digest, unpack
from underlay.rollout.payload import WeightPayload, default_fp8_filter, scale_name
from underlay.rollout.sinks import ModuleSink, StagingSink, peft_param_name
from underlay.rollout.trace import RolloutRecord, RolloutReplay, RolloutTracer, config_key, read_trace


def _entries(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(7, 5, generator=g, dtype=torch.float64)
    q = torch.randn(9, 3, generator=g).to(torch.float8_e4m3fn)
    return [
        ("a", w),
        ("b", torch.randn(11, generator=g).to(torch.bfloat16)),
        ("c", q),
        ("d", torch.randint(-5, 5, (3, 2), generator=g, dtype=torch.int64)),
        ("e", torch.randn((), generator=g)),
        ("f", torch.rand(4, generator=g) > 0.5),
        ("g", w.t()[1:]),  # non-contiguous view
    ]


def test_codec_round_trip_is_bit_exact() -> None:
    entries = _entries(1)
    metas, size = plan(entries)
    assert all(m.offset % ALIGN == 0 for m in metas)
    buf = torch.empty(size, dtype=torch.uint8)
    pack_into(buf, entries, metas)
    out = unpack(buf, metas)
    for (n1, t1), (n2, t2) in zip(entries, out):
        assert n1 == n2 and t1.dtype == t2.dtype and t1.shape == t2.shape
        assert torch.equal(t1.reshape(-1).view(torch.uint8), t2.reshape(-1).view(torch.uint8))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_codec_pack_equals_tensor_by_tensor_copies() -> None:
    """``pack_into`` (one multi-tensor copy) writes exactly the bytes of a copy per tensor at its
    planned offset, and leaves the alignment padding untouched."""
    entries = [*_entries(2), ("empty", torch.zeros(0, 3)), ("big", torch.randn(3000).to(torch.bfloat16))]
    metas, size = plan(entries)
    reference = torch.full((size,), 0xAB, dtype=torch.uint8)
    for (_, t), m in zip(entries, metas):
        raw = raw_bytes(t)
        reference[m.offset : m.offset + raw.numel()] = raw
    packed = torch.full((size,), 0xAB, dtype=torch.uint8)
    pack_into(packed, entries, metas)
    for (name, t), m in zip(entries, metas):
        got = packed[m.offset : m.offset + m.nbytes]
        assert torch.equal(got, reference[m.offset : m.offset + m.nbytes]), name
        back = got.view(t.dtype).view(t.shape)
        assert back.dtype == t.dtype and torch.equal(back.reshape(-1).view(torch.uint8), raw_bytes(t)), name
    assert torch.equal(packed, reference)


def test_tensor_digest_is_equal_exactly_for_bit_equal_tensors() -> None:
    for name, t in _entries(3):
        assert tensor_digest(t) == tensor_digest(t.clone()), name
        assert tensor_digest(t) == tensor_digest(t.contiguous()), name  # layout does not matter
        if t.numel():
            raw = raw_bytes(t).clone()
            raw[-1] ^= 1  # one bit
            assert tensor_digest(raw.view(t.dtype).view(t.shape)) != tensor_digest(t), name
    w = torch.randn(4, 6)
    assert tensor_digest(w) != tensor_digest(w.view(6, 4))  # same bytes, other shape
    assert tensor_digest(w) != tensor_digest(w.view(torch.int32))  # same bytes, other dtype


def test_codec_refuses_duplicates_and_corrupt_entries() -> None:
    with pytest.raises(InvalidInput, match="twice"):
        plan([("a", torch.zeros(2)), ("a", torch.zeros(2))])
    with pytest.raises(InvalidInput, match="dtype"):
        plan([("z", torch.zeros(2, dtype=torch.complex64))])
    metas, _ = plan([("a", torch.randn(4))])
    with pytest.raises(InvalidInput, match="corrupt"):
        unpack(torch.empty(8, dtype=torch.uint8), metas)


def test_payload_validation_and_fp8_names() -> None:
    with pytest.raises(ConfigError):
        WeightPayload("everything")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        WeightPayload("lora", fp8_block=(128, 128))
    with pytest.raises(ConfigError):
        WeightPayload(fp8_block=(0, 128))
    w = torch.randn(4, 4)
    assert default_fp8_filter("model.layers.0.mlp.down_proj.weight", w)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"):
        assert not default_fp8_filter(name, w)
    assert not default_fp8_filter("model.layers.0.self_attn.q_proj.bias", torch.randn(4))
    assert scale_name("x.q_proj.weight") == "x.q_proj.weight_scale_inv"
    assert (
        peft_param_name("base_model.model.m.q_proj.lora_A.weight")
        == "base_model.model.m.q_proj.lora_A.default.weight"
    )


def test_module_sink_commits_all_or_nothing() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = {k: torch.randn_like(v) for k, v in before.items()}
    sink = ModuleSink(model)
    sink.begin(1, {"payload": "full"})
    for k in list(new)[:-1]:
        sink.stage(k, new[k])
    with pytest.raises(InvalidInput, match="did not deliver"):
        sink.commit(1)
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    sink.abort("partial")
    sink.begin(2, {})
    with pytest.raises(InvalidInput, match="does not have"):
        sink.stage("nope", torch.zeros(1))
    with pytest.raises(InvalidInput, match="shape"):
        sink.stage("0.weight", torch.zeros(2, 2))
    with pytest.raises(InvalidInput, match="FP8"):
        sink.begin(3, {"fp8": {"block": [128, 128]}})
    sink.begin(4, {})
    for k, v in new.items():
        sink.stage(k, v)
    sink.commit(4)
    assert all(torch.equal(model.state_dict()[k], new[k]) for k in new)


def test_module_sink_stage_many_equals_stage() -> None:
    """A bucket staged at once (multi-tensor copy; a float64 tensor takes the one-by-one path) commits
    the same bits as ``stage`` per tensor; a bad name refuses the bucket before any copy."""
    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).to(torch.bfloat16))
    model_b = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).to(torch.bfloat16))
    model_b.load_state_dict(model_a.state_dict())
    new = {k: torch.randn(v.shape, dtype=torch.float64).to(v.dtype) for k, v in model_a.state_dict().items()}
    new["0.bias"] = torch.randn(4, dtype=torch.float64)  # cast into the fp32 buffer by stage_many's fallback
    one, many = ModuleSink(model_a), ModuleSink(model_b)
    one.begin(1, {})
    for k, v in new.items():
        one.stage(k, v)
    one.commit(1)
    many.begin(1, {})
    with pytest.raises(InvalidInput, match="does not have"):
        many.stage_many([("0.weight", new["0.weight"]), ("nope", torch.zeros(1))])
    with pytest.raises(InvalidInput, match="did not deliver"):
        many.commit(1)  # nothing of the refused bucket was staged
    many.stage_many(list(new.items()))
    many.commit(1)
    sa, sb = model_a.state_dict(), model_b.state_dict()
    for k in new:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)), k
        assert torch.equal(sb[k], new[k].to(sb[k].dtype)), k


def test_staging_sink_applies_on_commit_only() -> None:
    applied: list[dict[str, torch.Tensor]] = []
    sink = StagingSink(lambda t, h: applied.append(dict(t)))
    sink.begin(1, {"payload": "full"})
    src = torch.randn(3)
    sink.stage("w", src)
    src.add_(1.0)  # the sink holds its own copy
    sink.abort("x")
    assert applied == [] and sink.version is None
    sink.begin(2, {})
    sink.stage("w", src)
    sink.commit(2)
    assert sink.version == 2 and torch.equal(applied[0]["w"], src)


def test_trace_rows_and_sampling(tmp_path: Path) -> None:
    records = [
        RolloutRecord(
            step=3,
            index=i,
            prompt=f"p{i}",
            response=[1, 2, i],
            reward=float(i % 2),
            log_probs=[-0.5, float("-inf")],
            gen_seconds=0.25,
            extra={"answer": i},
        )
        for i in range(200)
    ]
    with RolloutTracer(tmp_path, sample_rate=1.0, rank=0) as tracer:
        assert tracer.record(records[:3]) == 3
    rows = read_trace(tmp_path / "rollouts.rank0.jsonl")
    assert rows[1]["prompt"] == "p1" and rows[1]["response"] == [1, 2, 1] and rows[1]["reward"] == 1.0
    assert rows[0]["log_probs"] == [-0.5, None] and rows[2]["extra"] == {"answer": 2}
    with RolloutTracer(tmp_path / "a", sample_rate=0.25, seed=7, rank=0) as t1:
        n1 = t1.record(records)
    with RolloutTracer(tmp_path / "b", sample_rate=0.25, seed=7, rank=0) as t2:
        n2 = t2.record(list(reversed(records)))
    assert 20 < n1 < 80 and n1 == n2  # a quarter, the same rollouts whatever the order
    got_a = {r["index"] for r in read_trace(tmp_path / "a" / "rollouts.rank0.jsonl")}
    got_b = {r["index"] for r in read_trace(tmp_path / "b" / "rollouts.rank0.jsonl")}
    assert got_a == got_b
    with pytest.raises(ConfigError):
        RolloutTracer(tmp_path, sample_rate=1.5)
    with pytest.raises(ConfigError):
        RolloutTracer(tmp_path, backends=("jsonl", "csv"))


def test_replay_round_trip_and_key_refusal(tmp_path: Path) -> None:
    cfg = {"model": "tiny", "seed": 3, "sampling": {"temperature": 1.0}}
    calls: list[int] = []

    def generate(step: int):  # type: ignore[no-untyped-def]
        def run():  # type: ignore[no-untyped-def]
            calls.append(step)
            g = torch.Generator().manual_seed(step)
            return {
                "ids": torch.randint(0, 100, (4, 6), generator=g),
                "logp": torch.randn(4, 6, generator=g),
            }, {"texts": [f"r{step}-{i}" for i in range(4)]}

        return run

    rec = RolloutReplay(tmp_path, cfg, mode="record", steps=[1, 2], rank=0)
    made = {s: rec(s, generate(s)) for s in range(4)}
    assert calls == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step00000001.rank0.json",
        "step00000001.rank0.safetensors",
        "step00000002.rank0.json",
        "step00000002.rank0.safetensors",
    ]
    calls.clear()
    rep = RolloutReplay(tmp_path, json.loads(json.dumps(cfg)), mode="replay", steps=[1, 2], rank=0)
    for s in (1, 2):
        tensors, meta = rep(s, generate(s))
        assert torch.equal(tensors["ids"], made[s][0]["ids"]) and torch.equal(
            tensors["logp"], made[s][0]["logp"]
        )
        assert meta == made[s][1]
    assert calls == []  # replayed, not generated
    rep(3, generate(3))
    assert calls == [3]
    other = RolloutReplay(tmp_path, {**cfg, "sampling": {"temperature": 0.7}}, mode="replay", rank=0)
    with pytest.raises(ConfigError, match=r"sampling\.temperature"):
        other.load(1)
    with pytest.raises(CheckpointError, match="no rollout dump"):
        rep.load(9)
    assert config_key(cfg) == config_key(json.loads(json.dumps(cfg))) != other.key
    with pytest.raises(ConfigError):
        RolloutReplay(tmp_path, cfg, mode="rewind")  # type: ignore[arg-type]


def test_rollout_imports_stay_light() -> None:
    import subprocess
    import sys

    probe = (
        "import sys, underlay.rollout as r\n"
        "from underlay.rollout import adapters, codec, hf_worker, payload, sinks, trace, transport\n"
        "r.WeightSender, r.HFRolloutWorker, r.RolloutReplay\n"
        "print([m for m in ('transformers', 'peft', 'safetensors', 'vllm', 'sglang') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
