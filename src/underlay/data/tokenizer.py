"""Loading Hugging Face tokenizers and processors, and chat-template helpers.

Tokenizers come from a local directory or any URL :func:`underlay.data.files.copy_to_local` reads.
:func:`load_tokenizer` applies the fixes RL trainers need (a pad token for models without one; the
generation config's end-of-sequence ids, which may differ from the tokenizer's). The chat helpers
validate messages before rendering, raise ``InvalidInput`` naming the sample and message when a
template fails, and check that a conversation tokenized turn by turn gives the ids of the whole
conversation (a template that breaks this corrupts per-turn loss masks).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from underlay.interfaces import ConfigError, InvalidInput

__all__ = [
    "ROLES",
    "TurnCheck",
    "apply_template",
    "check_template_kwargs",
    "check_turn_consistency",
    "generation_eos_ids",
    "generation_prompt_ids",
    "load_processor",
    "load_tokenizer",
    "render_many",
    "require_chat_template",
    "validate_messages",
    "with_system_prompt",
]

ROLES = ("system", "user", "assistant", "tool")
"""Message roles the helpers accept."""


def _local(path_or_uri: str | Path, cache_dir: str | Path | None) -> Path:
    from underlay.data.files import copy_to_local

    return copy_to_local(str(path_or_uri), cache_dir=cache_dir)


def generation_eos_ids(model_dir: str | Path, tokenizer: Any) -> list[int]:
    """The ids that end a generation: ``generation_config.json``'s ``eos_token_id`` (an int or a list)
    when ``model_dir`` has one, plus the tokenizer's ``eos_token_id``; sorted, without duplicates.
    Models whose generation config names a different eos (chat models ending turns with ``<|im_end|>``
    while the tokenizer's eos is ``<|endoftext|>``) stop on either. Raises ``ConfigError`` when neither
    source defines one."""
    ids: set[int] = set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ConfigError(
            f"{model_dir}: no eos token in the tokenizer or generation_config.json; set eos_token when "
            "saving the tokenizer"
        )
    return sorted(ids)


def load_tokenizer(
    path_or_uri: str | Path,
    *,
    padding_side: str = "left",
    require_template: bool = False,
    cache_dir: str | Path | None = None,
) -> Any:
    """A ``transformers`` tokenizer from a local directory or a remote URL (copied to ``cache_dir``
    first, see :func:`underlay.data.files.copy_to_local`); nothing is downloaded from the hub.

    Fixes applied: a tokenizer without a pad token gets ``pad_token = eos_token`` (or ``unk_token``);
    ``padding_side`` is set (``"left"``: prompts for generation). The generation config's eos ids are
    available from :func:`generation_eos_ids`. Raises ``ConfigError`` when the directory holds no
    loadable tokenizer, when no pad token can be chosen, or, with ``require_template=True``, when the
    tokenizer has no chat template.
    """
    import transformers

    if padding_side not in ("left", "right"):
        raise ConfigError(f"load_tokenizer: padding_side={padding_side!r}; use 'left' or 'right'")
    local = _local(path_or_uri, cache_dir)
    auto: Any = transformers.AutoTokenizer
    try:
        tok: Any = auto.from_pretrained(str(local), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"load_tokenizer({str(path_or_uri)!r}): no loadable tokenizer in {local} ({exc})"
        ) from exc
    if tok.pad_token is None:
        fallback = tok.eos_token if tok.eos_token is not None else tok.unk_token
        if fallback is None:
            raise ConfigError(
                f"load_tokenizer({str(path_or_uri)!r}): the tokenizer has no pad, eos or unk token to pad "
                "with; add a pad token (tokenizer.add_special_tokens({'pad_token': ...})) and resize the model"
            )
        tok.pad_token = fallback
    tok.padding_side = padding_side
    if require_template:
        require_chat_template(tok, str(path_or_uri))
    return tok


def _torchvision_hint() -> str:
    """How to install the torchvision release that matches the installed torch (torchvision 0.N+15
    pairs with torch 2.N; a CPU torch needs the CPU wheel, the PyPI wheels being CUDA builds)."""
    import torch

    version = str(torch.__version__)
    parts = version.split("+")[0].split(".")
    want = f"0.{int(parts[1]) + 15}.*" if len(parts) > 1 and parts[0] == "2" and parts[1].isdigit() else "?"
    cpu = version.endswith("+cpu") or torch.version.cuda is None
    index = " --index-url https://download.pytorch.org/whl/cpu" if cpu else ""
    build = (
        "the CPU build (PyPI's wheels are CUDA builds and do not load on a CPU torch)" if cpu else "its build"
    )
    return (
        f"install torchvision=={want} for torch {version}, {build}: pip install 'torchvision=={want}'{index}; "
        "without it the image processor (transformers.AutoImageProcessor, the PIL one) and load_tokenizer "
        "still load"
    )


def load_processor(path_or_uri: str | Path, *, cache_dir: str | Path | None = None) -> Any:
    """A ``transformers`` processor (``AutoProcessor``) from a local directory or remote URL, for
    models with one (vision-language). A directory with only a tokenizer gives the tokenizer. The
    processor's tokenizer gets the pad fix of :func:`load_tokenizer`.

    Raises ``ConfigError`` when nothing loads, and when the processor needs a package that is not
    installed, naming it: transformers' Qwen-VL processors (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) need
    ``torchvision`` for their video processor, even for image-only use, and the message names the
    torchvision release that matches the installed torch; also when an installed torchvision does not
    load with this torch (a CUDA build on a CPU torch, or another torch release)."""
    import transformers

    local = _local(path_or_uri, cache_dir)
    auto: Any = transformers.AutoProcessor
    try:
        proc: Any = auto.from_pretrained(str(local), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"load_processor({str(path_or_uri)!r}): no loadable processor in {local} ({exc})"
        ) from exc
    except ImportError as exc:  # transformers names the missing package in its message
        first = next((line for line in str(exc).splitlines() if line.strip()), repr(exc))
        hint = _torchvision_hint() if "torchvision" in str(exc).lower() else "install it"
        raise ConfigError(
            f"load_processor({str(path_or_uri)!r}): the processor in {local} needs a package that is "
            f"not installed: {first.strip()}; {hint}"
        ) from exc
    except RuntimeError as exc:
        if "torchvision" not in str(exc).lower():
            raise
        raise ConfigError(
            f"load_processor({str(path_or_uri)!r}): torchvision is installed but does not load with this "
            f"torch ({str(exc).strip().splitlines()[0]}); {_torchvision_hint()}"
        ) from exc
    tok = getattr(proc, "tokenizer", proc)
    if getattr(tok, "pad_token", "") is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return proc


def require_chat_template(tokenizer: Any, name: str = "tokenizer") -> None:
    """Raise ``ConfigError`` naming ``name`` when ``tokenizer`` has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{name} has no chat template, but messages must be rendered with one; use an instruct "
            "model's tokenizer, set tokenizer.chat_template, or feed plain text (apply_chat_template=False)"
        )


def validate_messages(messages: Any, where: str = "sample") -> list[dict[str, Any]]:
    """Check that ``messages`` is a list of dicts each with a known ``role`` (:data:`ROLES`) and a
    string ``content`` (``None`` allowed for an assistant message with ``tool_calls``); returns them
    as plain dicts. Raises ``InvalidInput`` naming ``where`` and the message index."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidInput(
            f"{where}: messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}"
        )
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidInput(
                f"{where}: message {i} is {type(m).__name__}, not a dict with 'role' and 'content'"
            )
        role = m.get("role")
        if role is None:
            raise InvalidInput(f"{where}: message {i} has no 'role' (keys: {sorted(m)})")
        if role not in ROLES:
            raise InvalidInput(f"{where}: message {i} has role {role!r}; use one of {ROLES}")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise InvalidInput(
                f"{where}: message {i} ({role}) content must be a string, got {type(content).__name__}"
            )
        out.append(dict(m))
    return out


def with_system_prompt(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """``messages`` with a system message ``system_prompt`` first, unless it is ``None`` or the
    conversation already starts with a system message."""
    if system_prompt is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


# apply_chat_template's own parameters: a template kwarg of the same name would be swallowed by it
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
    }
)


def check_template_kwargs(
    template_kwargs: Mapping[str, Any] | None, where: str = "template_kwargs"
) -> dict[str, Any]:
    """``template_kwargs`` as a plain dict after validation (``{}`` for ``None``): extra variables for
    the chat template (``{"enable_thinking": False}`` for Qwen3-style templates). Keys must be
    identifiers and not one of ``apply_chat_template``'s own parameters (``tools``,
    ``add_generation_prompt``, ...: those have their own arguments); values must be JSON-serialisable
    (datasets key their on-disk cache by them). Raises ``ConfigError`` naming the bad key or value."""
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, Mapping):
        raise ConfigError(
            f"{where}={template_kwargs!r}: give a mapping of chat-template variables, e.g. {{'enable_thinking': False}}"
        )
    out: dict[str, Any] = {}
    for key, value in template_kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"{where} key {key!r}: template variables are named by identifiers")
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise ConfigError(
                f"{where} key {key!r} is a parameter of apply_chat_template itself, not a template "
                "variable; use the function's own argument (tools=, add_generation_prompt=, ...)"
            )
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{where}[{key!r}]={value!r} is not JSON-serialisable ({exc}); use plain str/int/float/bool/list/dict"
            ) from exc
        out[key] = value
    return out


def apply_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    system_prompt: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    tokenize: bool = False,
    where: str = "sample",
    template_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """Render ``messages`` with the tokenizer's chat template: the text, or with ``tokenize=True``
    the ``list[int]`` of its ids (the template's own special tokens, no extra BOS).

    ``system_prompt`` is prepended as a system message unless the conversation starts with one;
    ``tools`` (JSON-schema dicts) go to the template's ``tools`` variable; ``add_generation_prompt``
    appends the assistant header; ``template_kwargs`` are extra template variables (validated by
    :func:`check_template_kwargs`, e.g. ``{"enable_thinking": False}``). Raises ``ConfigError`` when
    there is no template or a template kwarg is invalid, and ``InvalidInput`` naming ``where`` for bad
    messages or a template that fails to render.
    """
    extra = check_template_kwargs(template_kwargs)
    require_chat_template(tokenizer)
    msgs = with_system_prompt(validate_messages(list(messages), where), system_prompt)
    try:
        text: str = tokenizer.apply_chat_template(
            msgs,
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **extra,
        )
    except Exception as exc:  # jinja2 TemplateError, raise_exception() in templates, KeyError...
        raise InvalidInput(
            f"{where}: the chat template failed to render ({type(exc).__name__}: {exc})"
        ) from exc
    if not tokenize:
        return text
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def render_many(
    tokenizer: Any,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    where: str = "sample",
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[str]:
    """Render already validated conversations in one batched ``apply_chat_template`` call (much
    cheaper per conversation than one call each); ``[]`` for none. Raises like :func:`apply_template`."""
    if not conversations:
        return []
    extra = check_template_kwargs(template_kwargs)
    require_chat_template(tokenizer)
    try:
        out = tokenizer.apply_chat_template(
            [list(c) for c in conversations],
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **extra,
        )
    except Exception as exc:  # see apply_template
        raise InvalidInput(
            f"{where}: the chat template failed to render ({type(exc).__name__}: {exc})"
        ) from exc
    return [str(t) for t in out]


def generation_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]] | None = None,
    *,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The ids ``add_generation_prompt=True`` appends after ``messages`` (default: one user
    message), e.g. ``<|im_start|>assistant\\n`` (with a Qwen3-style template and
    ``template_kwargs={"enable_thinking": False}``, the empty think block too). Raises ``InvalidInput``
    when the rendering with the prompt does not extend the one without (the template rewrites earlier
    text)."""
    msgs = list(messages) if messages is not None else [{"role": "user", "content": "hi"}]
    base = apply_template(tokenizer, msgs, tokenize=True, template_kwargs=template_kwargs)
    full = apply_template(
        tokenizer, msgs, tokenize=True, add_generation_prompt=True, template_kwargs=template_kwargs
    )
    if full[: len(base)] != base:
        raise InvalidInput(
            "the chat template's generation prompt changes the tokens before it; it cannot be split off"
        )
    return list(full[len(base) :])


@dataclass(frozen=True)
class TurnCheck:
    """Result of :func:`check_turn_consistency`: ``ok``, and when not, the first message whose prefix
    tokenization is not a prefix of the whole (``turn``), the first differing token position
    (``position``) and the ids there (``expected`` from the whole, ``got`` from the prefix)."""

    ok: bool
    turn: int = -1
    position: int = -1
    expected: tuple[int, ...] = ()
    got: tuple[int, ...] = ()

    def describe(self) -> str:
        """A one-line explanation."""
        if self.ok:
            return "turn-by-turn tokenization equals whole-conversation tokenization"
        return (
            f"tokenizing the conversation up to message {self.turn} diverges from the whole conversation at "
            f"token {self.position}: whole has {list(self.expected)}, prefix has {list(self.got)}"
        )


def check_turn_consistency(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    system_prompt: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> TurnCheck:
    """Tokenize ``messages[:k+1]`` for every ``k`` and check each is a prefix of the whole
    conversation's ids. Templates that rewrite earlier turns (dropping the reasoning of old assistant
    turns, inserting a date) or tokenizers that merge across turn boundaries fail; per-turn loss masks
    built from prefixes would then be wrong (``template_kwargs`` as in :func:`apply_template`). Returns
    a :class:`TurnCheck` naming where it breaks."""
    msgs = validate_messages(list(messages))
    kw: dict[str, Any] = {"system_prompt": system_prompt, "tools": tools, "template_kwargs": template_kwargs}
    whole = apply_template(tokenizer, msgs, tokenize=True, **kw)
    for k in range(1, len(msgs)):
        part = apply_template(tokenizer, msgs[:k], tokenize=True, **kw)
        n = min(len(part), len(whole))
        pos = next((i for i in range(n) if part[i] != whole[i]), -1)
        if pos < 0 and len(part) > len(whole):
            pos = len(whole)
        if pos >= 0:
            return TurnCheck(False, k - 1, pos, tuple(whole[pos : pos + 4]), tuple(part[pos : pos + 4]))
    return TurnCheck(True)
