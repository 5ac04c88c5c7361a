"""Tokenizer loading and chat-template helpers; RL, SFT and preference datasets; collators."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from underlay.data.collate import (
    collate_packed,
    collate_padded,
    collate_pairs,
    collate_prompts,
    from_tensordict,
    to_tensordict,
)
from underlay.data.datasets import PreferenceDataset, RLPromptDataset, SFTDataset, read_records
from underlay.data.tokenizer import (
    apply_template,
    check_turn_consistency,
    generation_eos_ids,
    generation_prompt_ids,
    load_processor,
    load_tokenizer,
)
from underlay.demo.tokenizer import train_chat_tokenizer
from underlay.interfaces import ConfigError, InvalidInput, TokenBatch

CORPUS = ["say cat", "say dog", "hello there", "call the tool", "weather is sunny", "echo", "cat dog"] * 3

CONV = [
    {"role": "system", "content": "echo"},
    {"role": "user", "content": "say cat"},
    {"role": "assistant", "content": "cat"},
    {"role": "user", "content": "call the tool"},
    {"role": "assistant", "content": "weather"},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "weather is sunny"},
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return train_chat_tokenizer(CORPUS, vocab_size=80)


def _save(tok: Any, path: Path, **gen: Any) -> Path:
    tok.save_pretrained(str(path))
    if gen:
        (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def test_load_tokenizer_pad_fix_eos_and_template_errors(tok: Any, tmp_path: Path) -> None:
    d = _save(tok, tmp_path / "t", eos_token_id=[2, 5])
    loaded = load_tokenizer(d, require_template=True)
    assert loaded.padding_side == "left" and loaded("say cat")["input_ids"] == tok("say cat")["input_ids"]
    assert generation_eos_ids(d, loaded) == [2, 5]  # the generation config's extra eos is kept
    # a tokenizer without a pad token gets the eos as pad
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token", None)
    cfg_path.write_text(json.dumps(cfg))
    special = d / "special_tokens_map.json"
    if special.exists():
        sm = json.loads(special.read_text())
        sm.pop("pad_token", None)
        special.write_text(json.dumps(sm))
    nopad = load_tokenizer(d)
    assert nopad.pad_token == "<|end|>" and nopad.pad_token_id == 2
    # no template but one is required
    cfg["chat_template"] = None
    cfg_path.write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="no chat template"):
        load_tokenizer(d, require_template=True)
    with pytest.raises(InvalidInput, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    assert load_processor(_save(tok, tmp_path / "p"))("say cat")["input_ids"] == tok("say cat")["input_ids"]


def test_load_tokenizer_from_memory_url(tok: Any, tmp_path: Path) -> None:
    import fsspec

    from underlay.data.files import upload_dir

    local = _save(tok, tmp_path / "hf")
    upload_dir(local, "memory://tok/h4")
    fs = fsspec.filesystem("memory")
    assert fs.exists("/tok/h4/tokenizer.json")
    remote = load_tokenizer("memory://tok/h4", cache_dir=tmp_path / "cache")
    assert remote("say dog")["input_ids"] == tok("say dog")["input_ids"]


def test_render_generation_prompt_and_turn_consistency(tok: Any) -> None:
    text = apply_template(tok, CONV[1:3], system_prompt="echo")
    assert text == "<|system|>echo<|end|><|user|>say cat<|end|><|assistant|>cat<|end|>"
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    assert apply_template(tok, CONV[1:2], tools=tools, add_generation_prompt=True).endswith("<|assistant|>")
    assert generation_prompt_ids(tok) == [tok.convert_tokens_to_ids("<|assistant|>")]
    assert check_turn_consistency(tok, CONV).ok
    # a template that rewrites earlier turns (drops old assistant content) breaks it, and says where
    bad = train_chat_tokenizer(CORPUS, vocab_size=80)
    bad.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    )
    res = check_turn_consistency(bad, CONV)
    assert not res.ok and res.turn == 2 and "message 2" in res.describe()
    with pytest.raises(InvalidInput, match="message 1 has no 'role'"):
        apply_template(tok, [{"role": "user", "content": "a"}, {"content": "b"}])
    failing = train_chat_tokenizer(CORPUS, vocab_size=80)
    failing.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidInput, match="roles must alternate"):
        apply_template(failing, CONV[1:3], where="row 7")


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_records_formats(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"say {w}", "ground_truth": w} for w in ("cat", "dog", "sun")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    _write_jsonl(tmp_path / "a.jsonl", rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for src in ("a.parquet", "a.jsonl", "ds"):
        assert read_records(tmp_path / src) == rows
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n[1]\n')
    with pytest.raises(InvalidInput, match="line 2"):
        read_records(tmp_path / "bad.jsonl")
    with pytest.raises(InvalidInput, match="unknown format"):
        read_records(_write_jsonl(tmp_path / "a.csv", rows))


def test_rl_prompts_overlong_policies_and_cache(tok: Any, tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": "say cat"}], "ground_truth": "cat", "id": 0}]
    rows.append({"prompt": [{"role": "user", "content": "say cat " * 6}], "ground_truth": "cat", "id": 1})
    rows.append({"prompt": "say dog", "ground_truth": "dog", "id": 2})
    short = len(
        apply_template(
            tok, rows[0]["prompt"], system_prompt="echo", add_generation_prompt=True, tokenize=True
        )
    )
    full_long = apply_template(
        tok, rows[1]["prompt"], system_prompt="echo", add_generation_prompt=True, tokenize=True
    )
    assert len(full_long) > short + 2
    kw: dict[str, Any] = {"system_prompt": "echo", "max_length": short + 2, "field_keys": ["ground_truth"]}
    ds = RLPromptDataset(rows, tok, overlong="filter", cache_dir=tmp_path / "c", **kw)
    assert (
        len(ds) == 2
        and ds.report.filtered == 1
        and ds.report.kept == 2
        and ds.report.longest == len(full_long)
    )
    assert ds[0].fields == {"ground_truth": "cat"} and ds[1].fields == {"ground_truth": "dog"}
    cached = RLPromptDataset(rows, tok, overlong="filter", cache_dir=tmp_path / "c", **kw)
    assert list((tmp_path / "c").iterdir()) and [cached[i] for i in range(2)] == [ds[i] for i in range(2)]
    assert cached.report == ds.report
    left = RLPromptDataset(rows, tok, overlong="truncate_left", **kw)
    right = RLPromptDataset(rows, tok, overlong="truncate_right", lazy=True, **kw)
    assert left.report.truncated == 1 and list(left[1].input_ids) == full_long[-(short + 2) :]
    assert list(right[1].input_ids) == full_long[: short + 2] and right.report.truncated == 1
    right[1]  # lazy: a second access re-encodes the row but does not count it again
    assert right.report.truncated == 1
    with pytest.raises(InvalidInput, match="row 1: .* tokens > max_length"):
        RLPromptDataset(rows, tok, overlong="error", **kw)
    with pytest.raises(ConfigError, match="lazy=True with overlong='filter'"):
        RLPromptDataset(rows, tok, overlong="filter", lazy=True, **kw)
    with pytest.raises(InvalidInput, match="every one of 3 samples was filtered"):
        RLPromptDataset(rows, tok, system_prompt="echo", max_length=2)
    with pytest.raises(InvalidInput, match="row 1: missing column 'ground_truth'"):
        RLPromptDataset([rows[0], {"prompt": "say"}], tok, field_keys=["ground_truth"])
    with pytest.raises(InvalidInput, match="row 0 column 'prompt': message 0 has no 'role'"):
        RLPromptDataset([{"prompt": [{"content": "x"}]}], tok)
    pb = collate_prompts([left[0], left[1]], tok.pad_token_id)
    assert pb.batch.attention_mask[0, 0] == 0 and pb.batch.attention_mask[:, -1].all()  # left padded
    assert pb.batch.input_ids[0, -short:].tolist() == list(left[0].input_ids)
    assert int(pb.batch.loss_mask.sum()) == 0 and pb.fields[0]["ground_truth"] == "cat"


def test_sft_masks_cover_assistant_turns_only(tok: Any) -> None:
    ds = SFTDataset([{"messages": CONV}], tok, max_length=256)
    s = ds[0]
    ids = list(s.input_ids)
    assert ids == apply_template(tok, CONV, tokenize=True)
    end = tok.convert_tokens_to_ids("<|end|>")
    trained = [(t, i) for t, i, m in zip(s.turn_ids, ids, s.loss_mask) if m]
    # exactly the content + <|end|> of messages 2, 4, 6; no header, no user/tool/system token
    for k in (2, 4, 6):
        content = tok(CONV[k]["content"], add_special_tokens=False)["input_ids"]
        assert [i for t, i in trained if t == k] == [*content, end]
    assert {t for t, _ in trained} == {2, 4, 6}
    last = SFTDataset([{"messages": CONV}], tok, max_length=256, last_turn_only=True)[0]
    assert {t for t, m in zip(last.turn_ids, last.loss_mask) if m} == {6}
    with pytest.raises(InvalidInput, match="row 0: no assistant message"):
        SFTDataset([{"messages": CONV[:2]}], tok)
    tb = collate_padded([s, last], tok.pad_token_id, pad_to_multiple_of=8)
    assert tb.input_ids.shape[1] % 8 == 0 and tb.extras["turn_ids"][0, len(ids) :].eq(-1).all()
    assert tb.loss_mask[0, : len(ids)].tolist() == list(s.loss_mask)


def test_sft_rejects_turn_inconsistent_template(tok: Any) -> None:
    bad = train_chat_tokenizer(CORPUS, vocab_size=80)
    bad.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    )
    with pytest.raises(InvalidInput, match="row 0: the chat template is not turn-consistent at message 3"):
        SFTDataset([{"messages": CONV}], bad)


def test_preference_pairs(tok: Any) -> None:
    rows = [
        {"prompt": "say cat", "chosen": "cat", "rejected": "dog"},
        {
            "prompt": [{"role": "user", "content": "say dog"}],
            "chosen": "dog",
            "rejected": "cat cat cat cat cat",
        },
    ]
    rows.append({"prompt": "say " + "dog " * 8, "chosen": "dog", "rejected": "cat"})  # both sides overlong
    ds = PreferenceDataset(rows, tok, max_length=9)
    assert len(ds) == 1 and ds.report.filtered == 2 and ds.report.total == 3
    tb = collate_pairs([ds[0]], tok.pad_token_id)
    assert tb.batch_size == 2 and tb.extras["chosen"].tolist() == [1, 0]
    cat, dog = (tok(w, add_special_tokens=False)["input_ids"] for w in ("cat", "dog"))
    end = tok.eos_token_id
    assert tb.input_ids[0][tb.loss_mask[0].bool()].tolist() == [*cat, end]
    assert tb.input_ids[1][tb.loss_mask[1].bool()].tolist() == [*dog, end]
    with pytest.raises(InvalidInput, match="row 0: missing column 'rejected'"):
        PreferenceDataset([{"prompt": "a", "chosen": "b"}], tok)


def test_packed_collator_and_tensordict_roundtrip(tok: Any) -> None:
    convs = [CONV[:3], CONV, CONV[1:3], CONV[:5]]
    samples = [SFTDataset([{"messages": c}], tok, max_length=256)[0] for c in convs]
    cap = max(len(s.input_ids) for s in samples) + 4
    rows = collate_packed(samples, tok.pad_token_id, cap)
    assert len(rows) < len(samples)
    seen = []
    for tb in rows:
        seq = tb.extras["seq_ids"][0]
        for j in range(int(seq.max()) + 1):
            sel = seq == j
            got = tb.input_ids[0][sel].tolist()
            match = next(s for s in samples if list(s.input_ids) == got)
            assert tb.extras["position_ids"][0][sel].tolist() == list(range(len(got)))
            assert tb.loss_mask[0][sel].tolist() == [0, *match.loss_mask[1:]]
            seen.append(got)
    assert sorted(seen) == sorted(list(s.input_ids) for s in samples)
    with pytest.raises(InvalidInput, match="sample 0 has 10 tokens"):
        collate_packed(samples, tok.pad_token_id, 5)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 7), generator=gen)
    batch = TokenBatch(
        ids, torch.ones_like(ids), (ids > 20).long(), {"advantages": torch.randn(3, generator=gen)}
    )
    td = to_tensordict(batch)
    assert td.batch_size == torch.Size([3]) and td["input_ids"] is batch.input_ids
    back = from_tensordict(td[1:])
    assert torch.equal(back.input_ids, ids[1:]) and torch.equal(
        back.extras["advantages"], batch.extras["advantages"][1:]
    )
    with pytest.raises(InvalidInput, match="missing key 'loss_mask'"):
        from_tensordict(td.exclude("loss_mask"))
