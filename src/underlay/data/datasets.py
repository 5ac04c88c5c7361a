"""RL prompt, multi-turn SFT and preference-pair datasets read from parquet, jsonl or ``datasets`` dirs.

Every dataset validates its records when built (a missing column, a message without a role, a
template that fails: ``InvalidInput`` naming the row and key, before any training), tokenizes either
in a pre-pass (optionally cached on disk, keyed by the data, the tokenizer and the settings) or lazily
on access, and handles sequences longer than ``max_length`` by a named :data:`OverlongPolicy` whose
counts are kept in ``dataset.report`` and never applied silently. Samples become ``TokenBatch``es
through :mod:`underlay.data.collate`.
"""

from __future__ import annotations

import abc
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from underlay.data.tokenizer import (
    apply_template,
    check_template_kwargs,
    render_many,
    validate_messages,
    with_system_prompt,
)
from underlay.interfaces import ConfigError, InvalidInput

__all__ = [
    "OVERLONG_POLICIES",
    "DatasetReport",
    "OverlongPolicy",
    "PairSample",
    "PreferenceDataset",
    "PromptSample",
    "RLPromptDataset",
    "SFTDataset",
    "SFTSample",
    "read_records",
]

log = logging.getLogger(__name__)

OverlongPolicy = Literal["filter", "truncate_left", "truncate_right", "error"]
OVERLONG_POLICIES: tuple[str, ...] = ("filter", "truncate_left", "truncate_right", "error")
_CHUNK = 1024  # rows rendered and tokenized per batched call in the pre-pass


def read_records(path_or_uri: str | Path, *, cache_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Rows of a ``.parquet`` file, a ``.jsonl``/``.json`` (one object per line) file, or a directory
    written by ``datasets.Dataset.save_to_disk`` (or a directory of parquet files), as dicts. Remote
    URLs are copied through :func:`underlay.data.files.copy_to_local`. Raises ``InvalidInput`` for
    an unknown format, a line that is not a JSON object (naming the line) or an empty source."""
    from underlay.data.files import copy_to_local

    local = copy_to_local(str(path_or_uri), cache_dir=cache_dir)
    rows: list[dict[str, Any]]
    if local.is_dir():
        if (local / "dataset_info.json").is_file() or (local / "state.json").is_file():
            import datasets

            ds: Any = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                raise InvalidInput(f"{path_or_uri} holds splits {list(ds)}; pass one split's directory")
            rows = list(ds.to_list())
        else:
            parts = sorted(local.glob("*.parquet"))
            if not parts:
                raise InvalidInput(
                    f"{path_or_uri}: a directory without parquet files or a saved `datasets` dataset"
                )
            rows = [r for p in parts for r in _read_parquet(p)]
    elif local.suffix == ".parquet":
        rows = _read_parquet(local)
    elif local.suffix in (".jsonl", ".json"):
        rows = []
        with open(local, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InvalidInput(f"{path_or_uri} line {n}: not JSON ({exc})") from exc
                if not isinstance(row, dict):
                    raise InvalidInput(f"{path_or_uri} line {n}: a {type(row).__name__}, not a JSON object")
                rows.append(row)
    else:
        raise InvalidInput(
            f"{path_or_uri}: unknown format {local.suffix!r}; use .parquet, .jsonl or a datasets dir"
        )
    if not rows:
        raise InvalidInput(f"{path_or_uri}: no rows")
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    return rows


@dataclass
class DatasetReport:
    """What tokenization did: ``total`` rows read, ``kept``, and how many were ``filtered``,
    ``truncated`` or raised (``error``) by the overlong policy; ``longest`` token count seen."""

    total: int = 0
    kept: int = 0
    filtered: int = 0
    truncated: int = 0
    longest: int = 0

    def describe(self) -> str:
        """One line for logs."""
        return (
            f"{self.kept}/{self.total} samples kept, {self.filtered} filtered and {self.truncated} "
            f"truncated as overlong, longest {self.longest} tokens"
        )


@dataclass(frozen=True)
class PromptSample:
    """A tokenized RL prompt: ``input_ids`` and the row's other ``fields`` (e.g. ground truth)."""

    input_ids: tuple[int, ...]
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SFTSample:
    """A tokenized conversation: ``input_ids``, ``loss_mask`` (1 on assistant tokens that are trained)
    and ``turn_ids`` (index of the message each token belongs to, ``-1`` for template tokens after the
    last message)."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    turn_ids: tuple[int, ...]


@dataclass(frozen=True)
class PairSample:
    """A preference pair: ``chosen`` and ``rejected`` conversations sharing a prompt."""

    chosen: SFTSample
    rejected: SFTSample


def _check_policy(policy: str, max_length: int) -> None:
    if policy not in OVERLONG_POLICIES:
        raise ConfigError(f"overlong={policy!r}: use one of {OVERLONG_POLICIES}")
    if max_length < 1:
        raise ConfigError(f"max_length={max_length}: must be >= 1")


def _fingerprint(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:20]


def _tokenizer_id(tok: Any) -> str:
    core = getattr(tok, "backend_tokenizer", None)
    text = core.to_str() if core is not None else json.dumps(sorted(tok.get_vocab().items()))
    return hashlib.sha256((text + str(getattr(tok, "chat_template", ""))).encode()).hexdigest()[:20]


class _Base(abc.ABC):
    """Shared machinery: validation, overlong policy, pre-pass with cache, lazy access."""

    kind = "base"

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        *,
        max_length: int,
        overlong: OverlongPolicy,
        lazy: bool,
        cache_dir: str | Path | None,
        settings: Mapping[str, Any],
    ) -> None:
        _check_policy(overlong, max_length)
        if lazy and overlong == "filter":
            raise ConfigError(
                "lazy=True with overlong='filter': filtering changes which indices exist, which needs the "
                "pre-pass; use lazy=False or a truncate/error policy"
            )
        if not rows:
            raise InvalidInput(f"{type(self).__name__}: no rows")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.overlong = overlong
        self.lazy = lazy
        self.rows = [dict(r) for r in rows]
        for i, r in enumerate(self.rows):
            self._validate(i, r)
        self.report = DatasetReport(total=len(self.rows))
        self.fingerprint = _fingerprint(
            self.kind, self.rows, _tokenizer_id(tokenizer), max_length, overlong, dict(settings)
        )
        self._items: list[Any] | None = None
        self._counted: set[int] = set()  # rows already counted in the report (lazy access repeats)
        if not lazy:
            self._items = self._prepass(cache_dir)
            if not self._items:
                raise InvalidInput(
                    f"{type(self).__name__}: every one of {len(self.rows)} samples was filtered as longer than "
                    f"max_length={max_length}; raise max_length or use a truncate policy"
                )
            log.info("%s: %s", type(self).__name__, self.report.describe())
        else:
            self.report.kept = len(self.rows)

    @abc.abstractmethod
    def _validate(self, index: int, row: Mapping[str, Any]) -> None:
        """Raise ``InvalidInput`` naming ``index`` and the key when ``row`` cannot be used."""

    @abc.abstractmethod
    def _encode(self, index: int, row: Mapping[str, Any]) -> Any:
        """The item of ``row`` (``None`` when the overlong policy filters it)."""

    def _encode_chunk(self, start: int, rows: list[dict[str, Any]]) -> list[Any]:
        """Encode rows ``start, start + 1, ...`` (subclasses batch the work)."""
        return [self._encode(start + j, r) for j, r in enumerate(rows)]

    def _to_json(self, item: Any) -> Any:
        return item

    def _from_json(self, data: Any) -> Any:
        return data

    # machinery
    def _fit(self, index: int, ids: list[int], *others: list[int]) -> tuple[list[int], ...] | None:
        """Apply the overlong policy to ``ids`` (and parallel per-token lists); ``None`` = filtered."""
        n = len(ids)
        self.report.longest = max(self.report.longest, n)
        if n <= self.max_length:
            return (ids, *others)
        first_time = index not in self._counted
        self._counted.add(index)
        if self.overlong == "error":
            raise InvalidInput(
                f"{type(self).__name__} row {index}: {n} tokens > max_length={self.max_length} (overlong='error'); "
                "raise max_length or choose filter/truncate_left/truncate_right"
            )
        if self.overlong == "filter":
            self.report.filtered += int(first_time)
            return None
        self.report.truncated += int(first_time)
        sl = slice(n - self.max_length, n) if self.overlong == "truncate_left" else slice(0, self.max_length)
        return (ids[sl], *(o[sl] for o in others))

    def _prepass(self, cache_dir: str | Path | None) -> list[Any]:
        cache = Path(cache_dir) / f"{self.kind}-{self.fingerprint}.json" if cache_dir is not None else None
        if cache is not None and cache.is_file():
            data = json.loads(cache.read_text(encoding="utf-8"))
            self.report = DatasetReport(**data["report"])
            return [self._from_json(x) for x in data["items"]]
        items = []
        for start in range(0, len(self.rows), _CHUNK):
            for it in self._encode_chunk(start, self.rows[start : start + _CHUNK]):
                if it is not None:
                    items.append(it)
        self.report.kept = len(items)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f"{cache.name}.{uuid.uuid4().hex}.tmp")
            payload = {"report": self.report.__dict__, "items": [self._to_json(x) for x in items]}
            tmp.write_text(json.dumps(payload), encoding="utf-8")
            os.replace(tmp, cache)
        return items

    def __len__(self) -> int:
        return len(self._items) if self._items is not None else len(self.rows)

    def __getitem__(self, index: int) -> Any:
        if self._items is not None:
            return self._items[index]
        return self._encode(index, self.rows[index])


def _check_tools(tools: Any, where: str) -> list[dict[str, Any]] | None:
    """``tools`` as a list of dicts (``None`` stays ``None``); ``InvalidInput`` naming ``where`` for
    anything but a list of mappings (tool schemas, e.g. ``{"type": "function", "function": {...}}``)."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidInput(f"{where}: tools must be a list of tool-schema dicts, got {type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
            raise InvalidInput(f"{where}: tool {i} is a {type(t).__name__}; give a JSON-schema dict")
        out.append(dict(t))
    return out


def _require(index: int, row: Mapping[str, Any], key: str, kind: str) -> Any:
    if key not in row:
        raise InvalidInput(f"{kind} row {index}: missing column {key!r} (columns: {sorted(row)})")
    return row[key]


class RLPromptDataset(_Base):
    """Prompts for RL rollouts: column ``prompt_key`` holds a message list (rendered with the chat
    template and the generation prompt, ``system_prompt`` prepended when given) or a plain string
    (used as is when the tokenizer has no template or ``apply_chat_template=False``). Every other
    column listed in ``field_keys`` (default: all other columns) is carried in ``sample.fields`` for
    the reward function, e.g. ``ground_truth``. Items are :class:`PromptSample`; overlong prompts
    follow ``overlong`` (``truncate_left`` keeps the end, where the generation prompt is).

    Tool schemas (JSON-schema dicts, rendered into the template's ``tools`` variable) come from
    column ``tools_key`` of a row when it is set and not null, else from ``tools`` (every row);
    ``template_kwargs`` are extra template variables for every row (``{"enable_thinking": False}``),
    validated by :func:`underlay.data.tokenizer.check_template_kwargs`."""

    kind = "rl"

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        field_keys: Sequence[str] | None = None,
        max_length: int = 1024,
        overlong: OverlongPolicy = "filter",
        system_prompt: str | None = None,
        apply_chat_template: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tools_key: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        lazy: bool = False,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.prompt_key, self.system_prompt = prompt_key, system_prompt
        self.apply_chat_template = apply_chat_template
        self.field_keys = None if field_keys is None else list(field_keys)
        self.tools = _check_tools(tools, "RLPromptDataset(tools=...)")
        self.tools_key = tools_key
        self.template_kwargs = check_template_kwargs(template_kwargs, "RLPromptDataset(template_kwargs=...)")
        settings = {
            "prompt_key": prompt_key,
            "fields": self.field_keys,
            "sys": system_prompt,
            "tpl": apply_chat_template,
            "tools": self.tools,
            "tools_key": tools_key,
            "tkw": self.template_kwargs,
        }
        super().__init__(
            rows,
            tokenizer,
            max_length=max_length,
            overlong=overlong,
            lazy=lazy,
            cache_dir=cache_dir,
            settings=settings,
        )

    def _validate(self, index: int, row: Mapping[str, Any]) -> None:
        prompt = _require(index, row, self.prompt_key, "RLPromptDataset")
        for k in self.field_keys or ():
            _require(index, row, k, "RLPromptDataset")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInput(f"RLPromptDataset row {index}: empty {self.prompt_key!r}")
        else:
            validate_messages(prompt, f"RLPromptDataset row {index} column {self.prompt_key!r}")
        if self.tools_key is not None:
            _check_tools(row.get(self.tools_key), f"RLPromptDataset row {index} column {self.tools_key!r}")

    def _row_tools(self, row: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        own = row.get(self.tools_key) if self.tools_key is not None else None
        return list(own) if own is not None else self.tools

    def _plain(self, prompt: Any) -> bool:
        return isinstance(prompt, str) and (
            not self.apply_chat_template or not getattr(self.tokenizer, "chat_template", None)
        )

    def _encode_chunk(self, start: int, rows: list[dict[str, Any]]) -> list[Any]:
        """Render the chunk's templated prompts in one call and tokenize all of it in one call; a
        template failure is re-raised for the first failing row alone (so the error names it)."""
        if self.tools_key is not None and any(r.get(self.tools_key) is not None for r in rows):
            # one batched render takes one tool list: rows with their own tools render one by one
            return [self._encode(start + j, r) for j, r in enumerate(rows)]
        convs, texts = [], []
        for r in rows:
            prompt = r[self.prompt_key]
            if not self._plain(prompt):
                msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                convs.append(with_system_prompt(list(msgs), self.system_prompt))
        try:
            rendered = iter(
                render_many(self.tokenizer, convs, self.tools, True, template_kwargs=self.template_kwargs)
            )
        except InvalidInput:
            return [self._encode(start + j, r) for j, r in enumerate(rows)]
        plain_flags = [self._plain(r[self.prompt_key]) for r in rows]
        texts = [r[self.prompt_key] if p else next(rendered) for r, p in zip(rows, plain_flags)]
        out: list[Any] = []
        plain_ids = (
            iter(
                self.tokenizer([t for t, p in zip(texts, plain_flags) if p], add_special_tokens=True)[
                    "input_ids"
                ]
            )
            if any(plain_flags)
            else iter(())
        )
        tpl_ids = (
            iter(
                self.tokenizer([t for t, p in zip(texts, plain_flags) if not p], add_special_tokens=False)[
                    "input_ids"
                ]
            )
            if not all(plain_flags)
            else iter(())
        )
        for j, (r, p) in enumerate(zip(rows, plain_flags)):
            out.append(self._finish(start + j, r, list(next(plain_ids) if p else next(tpl_ids))))
        return out

    def _encode(self, index: int, row: Mapping[str, Any]) -> PromptSample | None:
        prompt = row[self.prompt_key]
        if self._plain(prompt):
            ids: list[int] = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            ids = apply_template(
                self.tokenizer,
                msgs,
                system_prompt=self.system_prompt,
                tools=self._row_tools(row),
                add_generation_prompt=True,
                tokenize=True,
                where=f"RLPromptDataset row {index}",
                template_kwargs=self.template_kwargs,
            )
        return self._finish(index, row, ids)

    def _finish(self, index: int, row: Mapping[str, Any], ids: list[int]) -> PromptSample | None:
        fitted = self._fit(index, ids)
        if fitted is None:
            return None
        keys = self.field_keys if self.field_keys is not None else [k for k in row if k != self.prompt_key]
        return PromptSample(tuple(fitted[0]), {k: row[k] for k in keys})

    def _to_json(self, item: Any) -> Any:
        return {"ids": list(item.input_ids), "fields": dict(item.fields)}

    def _from_json(self, data: Any) -> Any:
        return PromptSample(tuple(data["ids"]), data["fields"])


def _encode_conversation(
    tokenizer: Any,
    msgs: list[dict[str, Any]],
    tools: Any,
    where: str,
    train_roles: tuple[str, ...],
    last_only: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """ids, loss mask and turn ids of a conversation, built from its prefixes: message ``k``'s tokens
    are those the rendering of ``msgs[:k+1]`` adds to that of ``msgs[:k]``; for trained assistant
    messages the generation-prompt header is excluded from the loss. Raises ``InvalidInput`` when a
    prefix's tokens are not a prefix of the next (the template is not turn-consistent)."""
    last_assistant = max((i for i, m in enumerate(msgs) if m["role"] in train_roles), default=-1)
    trained = [
        m["role"] in train_roles and (not last_only or k == last_assistant) for k, m in enumerate(msgs)
    ]
    # render every prefix (and the generation header before each trained message), then tokenize them
    # in one batched call: the Rust tokenizer's batch path is several times faster than one call each
    heads = [k for k in range(1, len(msgs)) if trained[k]]
    tkw = template_kwargs
    texts = render_many(tokenizer, [msgs[: k + 1] for k in range(len(msgs))], tools, False, where, tkw)
    texts += render_many(tokenizer, [msgs[:k] for k in heads], tools, True, where, tkw)
    encoded: list[list[int]] = tokenizer(texts, add_special_tokens=False)["input_ids"]
    prefixes, head_ids = encoded[: len(msgs)], dict(zip(heads, encoded[len(msgs) :]))
    ids: list[int] = []
    mask: list[int] = []
    turns: list[int] = []
    for k, cur in enumerate(prefixes):
        if cur[: len(ids)] != ids:
            pos = next(
                (i for i in range(min(len(ids), len(cur))) if ids[i] != cur[i]), min(len(ids), len(cur))
            )
            raise InvalidInput(
                f"{where}: the chat template is not turn-consistent at message {k} (token {pos}); per-turn loss "
                "masks would be wrong (see underlay.data.tokenizer.check_turn_consistency)"
            )
        start = body_start = len(ids)
        head = head_ids.get(k)
        if head is not None and cur[: len(head)] == head and len(head) >= start:
            body_start = len(head)
        new = cur[start:]
        ids.extend(new)
        mask.extend(1 if trained[k] and start + j >= body_start else 0 for j in range(len(new)))
        turns.extend([k] * len(new))
    return ids, mask, turns


class SFTDataset(_Base):
    """Multi-turn conversations for supervised fine-tuning: column ``messages_key`` holds the message
    list (system/user/assistant/tool), optional column ``tools_key`` the tool schemas. The loss covers
    the assistant messages' tokens (content and end-of-turn, not the role header); with
    ``last_turn_only=True`` only the final assistant message. Items are :class:`SFTSample`; the
    template must be turn-consistent (``InvalidInput`` naming the row otherwise). ``template_kwargs``
    are extra template variables for every row, as in :class:`RLPromptDataset`."""

    kind = "sft"

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        *,
        messages_key: str = "messages",
        tools_key: str = "tools",
        max_length: int = 2048,
        overlong: OverlongPolicy = "filter",
        last_turn_only: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        lazy: bool = False,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.messages_key, self.tools_key, self.last_turn_only = messages_key, tools_key, last_turn_only
        self.template_kwargs = check_template_kwargs(
            template_kwargs, f"{type(self).__name__}(template_kwargs=...)"
        )
        settings = {"m": messages_key, "t": tools_key, "last": last_turn_only, "tkw": self.template_kwargs}
        super().__init__(
            rows,
            tokenizer,
            max_length=max_length,
            overlong=overlong,
            lazy=lazy,
            cache_dir=cache_dir,
            settings=settings,
        )

    def _validate(self, index: int, row: Mapping[str, Any]) -> None:
        msgs = validate_messages(
            _require(index, row, self.messages_key, "SFTDataset"), f"SFTDataset row {index}"
        )
        if not any(m["role"] == "assistant" for m in msgs):
            raise InvalidInput(f"SFTDataset row {index}: no assistant message, nothing to train on")

    def _conversation(
        self, index: int, msgs: list[dict[str, Any]], tools: Any, where: str
    ) -> SFTSample | None:
        ids, mask, turns = _encode_conversation(
            self.tokenizer, msgs, tools, where, ("assistant",), self.last_turn_only, self.template_kwargs
        )
        fitted = self._fit(index, ids, mask, turns)
        if fitted is None:
            return None
        return SFTSample(tuple(fitted[0]), tuple(fitted[1]), tuple(fitted[2]))

    def _encode(self, index: int, row: Mapping[str, Any]) -> Any:
        msgs = validate_messages(row[self.messages_key], f"SFTDataset row {index}")
        return self._conversation(index, msgs, row.get(self.tools_key), f"SFTDataset row {index}")

    def _to_json(self, item: Any) -> Any:
        return [list(item.input_ids), list(item.loss_mask), list(item.turn_ids)]

    def _from_json(self, data: Any) -> Any:
        return SFTSample(tuple(data[0]), tuple(data[1]), tuple(data[2]))


class PreferenceDataset(SFTDataset):
    """Preference / reward-model pairs: ``prompt_key`` (a string or message list), ``chosen_key`` and
    ``rejected_key`` (a string: the assistant answer, or a message list continuing the prompt). Each
    side is tokenized as a conversation with the loss on its final assistant message; a pair is
    filtered (or the error raised) when either side is overlong. Items are :class:`PairSample`."""

    kind = "pref"

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        max_length: int = 2048,
        overlong: OverlongPolicy = "filter",
        template_kwargs: Mapping[str, Any] | None = None,
        lazy: bool = False,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.keys = (prompt_key, chosen_key, rejected_key)
        super().__init__(
            rows,
            tokenizer,
            messages_key=prompt_key,
            max_length=max_length,
            overlong=overlong,
            last_turn_only=True,
            template_kwargs=template_kwargs,
            lazy=lazy,
            cache_dir=cache_dir,
        )

    def _side(self, index: int, row: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
        prompt = row[self.keys[0]]
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        answer = row[key]
        tail = [{"role": "assistant", "content": answer}] if isinstance(answer, str) else list(answer)
        return validate_messages(msgs + tail, f"PreferenceDataset row {index} column {key!r}")

    def _validate(self, index: int, row: Mapping[str, Any]) -> None:
        for k in self.keys:
            _require(index, row, k, "PreferenceDataset")
        for k in self.keys[1:]:
            if self._side(index, row, k)[-1]["role"] != "assistant":
                raise InvalidInput(
                    f"PreferenceDataset row {index} column {k!r}: must end with an assistant message"
                )

    def _encode(self, index: int, row: Mapping[str, Any]) -> PairSample | None:
        sides = []  # the report counts rows: a pair with both sides overlong counts once
        for k in self.keys[1:]:
            sides.append(
                self._conversation(
                    index, self._side(index, row, k), None, f"PreferenceDataset row {index} {k!r}"
                )
            )
        if sides[0] is None or sides[1] is None:
            return None
        return PairSample(sides[0], sides[1])

    def _to_json(self, item: Any) -> Any:
        return [super()._to_json(item.chosen), super()._to_json(item.rejected)]

    def _from_json(self, data: Any) -> Any:
        return PairSample(super()._from_json(data[0]), super()._from_json(data[1]))
