"""Chat-template variables (``template_kwargs``) and tools for RL prompts, through the helpers and
the datasets: rendered text against a hand-written expectation, dataset ids against the helper's,
cache keys, and every refusal."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from underlay.data.datasets import RLPromptDataset, SFTDataset
from underlay.data.tokenizer import apply_template, check_template_kwargs, generation_prompt_ids
from underlay.demo.tokenizer import train_chat_tokenizer
from underlay.interfaces import ConfigError, InvalidInput

# a Qwen3-style template: an `enable_thinking` switch and a tools block
TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "say cat"}]


@pytest.fixture(scope="module")
def tok() -> Any:
    t = train_chat_tokenizer(["say cat", "call the tool", "weather echo", "cat dog"] * 3, vocab_size=80)
    t.chat_template = TEMPLATE
    return t


def test_template_kwargs_and_tools_render_as_written(tok: Any) -> None:
    assert apply_template(tok, USER, add_generation_prompt=True) == "<|user|>say cat<|end|><|assistant|>"
    off = apply_template(tok, USER, add_generation_prompt=True, template_kwargs={"enable_thinking": False})
    assert off == "<|user|>say cat<|end|><|assistant|><think></think>"
    on = apply_template(tok, USER, add_generation_prompt=True, template_kwargs={"enable_thinking": True})
    assert on == "<|user|>say cat<|end|><|assistant|>"
    with_tools = apply_template(tok, USER, tools=[WEATHER, ECHO], template_kwargs={"enable_thinking": False})
    assert with_tools == "<|system|>tools: weather echo<|end|><|user|>say cat<|end|>"
    head = generation_prompt_ids(tok, template_kwargs={"enable_thinking": False})
    assert len(head) > len(generation_prompt_ids(tok))


def test_rl_prompts_take_template_kwargs_and_tools_per_dataset_and_per_row(tok: Any, tmp_path: Path) -> None:
    rows = [
        {"prompt": USER, "answer": "cat"},
        {"prompt": [{"role": "user", "content": "call the tool"}], "answer": "x", "tools": [ECHO]},
        {"prompt": [{"role": "user", "content": "cat dog"}], "answer": "y", "tools": None},
    ]
    kw = {"enable_thinking": False}
    ds = RLPromptDataset(rows, tok, tools=[WEATHER], tools_key="tools", template_kwargs=kw, max_length=512)
    expected_tools = [[WEATHER], [ECHO], [WEATHER]]
    for i, row in enumerate(rows):
        ids = apply_template(
            tok,
            row["prompt"],
            tools=expected_tools[i],
            add_generation_prompt=True,
            tokenize=True,
            template_kwargs=kw,
        )
        assert list(ds[i].input_ids) == ids, i
    # the batched pre-pass (no per-row tools) gives the ids of one-by-one rendering
    plain = [{k: v for k, v in r.items() if k != "tools"} for r in rows]
    batched = RLPromptDataset(plain, tok, tools=[WEATHER], template_kwargs=kw, max_length=512)
    lazy = RLPromptDataset(
        plain, tok, tools=[WEATHER], template_kwargs=kw, max_length=512, lazy=True, overlong="error"
    )
    assert [batched[i].input_ids for i in range(3)] == [lazy[i].input_ids for i in range(3)]
    assert batched[0].input_ids == ds[0].input_ids
    # the on-disk cache is keyed by the template variables and tools: no stale ids across settings
    cache = tmp_path / "cache"
    a = RLPromptDataset(plain, tok, template_kwargs=kw, max_length=512, cache_dir=cache)
    b = RLPromptDataset(
        plain, tok, template_kwargs={"enable_thinking": True}, max_length=512, cache_dir=cache
    )
    c = RLPromptDataset(plain, tok, tools=[ECHO], template_kwargs=kw, max_length=512, cache_dir=cache)
    assert a[0].input_ids != b[0].input_ids and a[0].input_ids != c[0].input_ids
    assert list(b[0].input_ids) == apply_template(tok, USER, add_generation_prompt=True, tokenize=True)


def test_sft_template_kwargs_reach_every_prefix(tok: Any) -> None:
    t = copy.deepcopy(tok)
    # a template whose assistant turns carry a marker only when a variable is set
    t.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' and tag %}[{{ tag }}]{% endif %}"
        "{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    conv = [*USER, {"role": "assistant", "content": "cat"}]
    plain = SFTDataset([{"messages": conv}], t, template_kwargs={"tag": ""})
    tagged = SFTDataset([{"messages": conv}], t, template_kwargs={"tag": "dog"})
    ids = apply_template(t, conv, tokenize=True, template_kwargs={"tag": "dog"})
    assert list(tagged[0].input_ids) == ids and len(ids) > len(plain[0].input_ids)
    # the loss covers the assistant body (the tag included) and its end marker, not the header
    masked = [i for i, m in zip(tagged[0].input_ids, tagged[0].loss_mask) if m]
    head = apply_template(t, USER, add_generation_prompt=True, tokenize=True, template_kwargs={"tag": "dog"})
    assert ids[: len(head)] == head and masked == ids[len(head) :]
    assert "dog" in t.decode(masked)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"tools": []}, "parameter of apply_chat_template"),
        ({"add_generation_prompt": True}, "parameter of apply_chat_template"),
        ({"not an identifier": 1}, "identifiers"),
        ({"when": object()}, "JSON-serialisable"),
        (["enable_thinking"], "mapping"),
    ],
)
def test_bad_template_kwargs_are_refused_by_name(tok: Any, bad: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_template_kwargs(bad)
    with pytest.raises(ConfigError, match=match):
        RLPromptDataset([{"prompt": USER}], tok, template_kwargs=bad)
    with pytest.raises(ConfigError, match=match):
        apply_template(tok, USER, template_kwargs=bad)


def test_bad_tools_are_refused_naming_the_row(tok: Any) -> None:
    with pytest.raises(InvalidInput, match="tools must be a list"):
        RLPromptDataset([{"prompt": USER}], tok, tools=WEATHER)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="row 1 column 'tools'"):
        RLPromptDataset([{"prompt": USER}, {"prompt": USER, "tools": ["weather"]}], tok, tools_key="tools")
