"""Vision-language RL prompts and SFT conversations for Qwen2-VL / Qwen2.5-VL / Qwen3-VL style models:
raw images and videos (:mod:`underlay.data.media`) into the processor's pixels and the expanded
placeholder tokens, then ``TokenBatch``es with :class:`~underlay.interfaces.VisionInputs`.

A message's content is a string, where ``<image>`` and ``<video>`` mark where the row's images and
videos go (in order), or a list of parts (``{"type": "text", "text": ...}``, ``{"type": "image"}``,
``{"type": "video"}``), as chat templates of these models take them. The chat template renders each
image as one placeholder token (``<|image_pad|>``); :class:`VisionProcessor` replaces the ``k``-th
placeholder by ``t*h*w / merge_size**2`` copies, the number of merged patches of image ``k``, as the
model's own processor does, and refuses a row whose placeholder count differs from its image count.
The expanded tokens are part of ``input_ids``, so the engine's micro-batch token budget counts them.

Images go through the model's image processor (the PIL one needs no torchvision); videos through its
video processor, which in transformers needs ``torchvision`` (``ConfigError`` naming it when missing).
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from underlay.data.datasets import _encode_conversation, _require
from underlay.data.media import load_image, load_video
from underlay.data.tokenizer import ROLES, check_template_kwargs, load_tokenizer, require_chat_template
from underlay.interfaces import ConfigError, InvalidInput, TokenBatch, VisionInputs

__all__ = [
    "VisionProcessor",
    "VisionPromptDataset",
    "VisionSFTDataset",
    "VisionSample",
    "collate_vision",
    "pack_vision",
]

_MARKER = re.compile(r"(<image>|<video>)")


@dataclass(frozen=True)
class _Media:
    pixel_values: torch.Tensor  # [P, D]
    grid_thw: torch.Tensor  # [n, 3]
    second_per_grid: torch.Tensor | None = None  # [n] (videos)


@dataclass(frozen=True)
class VisionSample:
    """One tokenized row: ``input_ids`` with expanded placeholders, ``loss_mask`` (SFT; all zero for
    prompts), the row's images and videos (processor outputs, ``None`` when it has none) and, for
    prompts, the row's other columns in ``fields``."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    images: _Media | None = None
    videos: _Media | None = None
    fields: dict[str, Any] = field(default_factory=dict)


class VisionProcessor:
    """Tokenizer, image processor and (optional) video processor of a Qwen-VL style model, with the
    pixel limits and video sampling used for every row.

    ``min_pixels`` / ``max_pixels``: the image processor resizes each image (and video frame) so its
    pixel count lies in that range, keeping the aspect ratio (``None``: the processor's own limits).
    ``video_fps``, ``video_min_frames``, ``video_max_frames``: frame sampling
    (:func:`underlay.data.media.load_video`; the frame count is a multiple of the temporal patch).
    ``chat_template``: the template that renders messages (default: the tokenizer's).
    """

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        video_processor: Any | None = None,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        video_fps: float = 2.0,
        video_min_frames: int = 2,
        video_max_frames: int = 64,
        image_token: str = "<|image_pad|>",
        video_token: str = "<|video_pad|>",
        chat_template: str | None = None,
        video_unavailable: str | None = None,
        cache_dir: str | Path | None = None,
    ) -> None:
        if min_pixels is not None and max_pixels is not None and not 0 < min_pixels <= max_pixels:
            raise ConfigError(
                f"VisionProcessor: need 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}"
            )
        for name in ("min_pixels", "max_pixels"):
            v = locals()[name]
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"VisionProcessor.{name}={v!r}: an int >= 1 or None")
        self.tokenizer, self.image_processor, self.video_processor = (
            tokenizer,
            image_processor,
            video_processor,
        )
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.video_fps, self.video_min_frames, self.video_max_frames = (
            video_fps,
            video_min_frames,
            video_max_frames,
        )
        self.image_token, self.video_token = image_token, video_token
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.video_unavailable, self.cache_dir = video_unavailable, cache_dir
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        self.temporal_patch = int(getattr(video_processor or image_processor, "temporal_patch_size", 2))
        ids = tokenizer.convert_tokens_to_ids([image_token, video_token])
        unk = getattr(tokenizer, "unk_token_id", None)
        if any(i is None or i == unk for i in ids):
            raise ConfigError(
                f"VisionProcessor: the tokenizer does not know {image_token!r} / {video_token!r} as tokens; "
                "use the model's own tokenizer or name its placeholder tokens"
            )
        self.image_token_id, self.video_token_id = int(ids[0]), int(ids[1])

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> VisionProcessor:
        """Load the parts from a model directory or URL (:func:`underlay.data.tokenizer.load_tokenizer`,
        ``AutoImageProcessor``, ``AutoVideoProcessor`` when it loads: without torchvision videos are
        refused later, naming it). ``kwargs`` as in the constructor. ``ConfigError`` when the directory
        has no image processor."""
        from transformers import AutoImageProcessor

        from underlay.data.files import copy_to_local

        local = copy_to_local(str(path), cache_dir=kwargs.get("cache_dir"))
        tok = load_tokenizer(local)
        try:
            image_proc = AutoImageProcessor.from_pretrained(str(local), local_files_only=True)
        except (OSError, ValueError, ImportError) as exc:
            raise ConfigError(f"VisionProcessor: no loadable image processor in {local} ({exc})") from exc
        video_proc, why = None, None
        try:
            from transformers import AutoVideoProcessor

            video_proc = AutoVideoProcessor.from_pretrained(str(local), local_files_only=True)
        except (ImportError, OSError, ValueError, RuntimeError) as exc:
            first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
            why = f"the video processor of {local} does not load: {first}"
        template = None
        for name in ("chat_template.jinja", "chat_template.json"):
            f = local / name
            if f.is_file():
                text = f.read_text()
                template = json.loads(text)["chat_template"] if name.endswith(".json") else text
                break
        kwargs.setdefault("chat_template", template)
        return cls(tok, image_proc, video_proc, video_unavailable=why, **kwargs)

    # ------------------------------------------------------------------------------- pixels

    def _size(self) -> dict[str, Any]:
        if self.min_pixels is None and self.max_pixels is None:
            return {}
        size = dict(getattr(self.image_processor, "size", {}) or {})
        size = {k: v for k, v in size.items() if k in ("shortest_edge", "longest_edge") and v is not None}
        if self.min_pixels is not None:
            size["shortest_edge"] = self.min_pixels
        if self.max_pixels is not None:
            size["longest_edge"] = self.max_pixels
        return {"size": size}

    def images(self, sources: Sequence[Any], where: str = "row") -> _Media | None:
        """Load and process ``sources`` (one row's images, in placeholder order); ``None`` for none."""
        if not sources:
            return None
        try:
            loaded = [load_image(s, cache_dir=self.cache_dir) for s in sources]
        except InvalidInput as exc:
            raise InvalidInput(f"{where}: {exc}") from exc
        out = self.image_processor(images=loaded, return_tensors="pt", **self._size())
        return _Media(out["pixel_values"].float(), out["image_grid_thw"].long())

    def videos(self, sources: Sequence[Any], where: str = "row") -> _Media | None:
        """Sample, load and process ``sources`` (one row's videos); ``None`` for none. ``ConfigError``
        when the model's video processor is not available (naming why, e.g. torchvision)."""
        if not sources:
            return None
        if self.video_processor is None:
            raise ConfigError(
                f"{where} has videos, but {self.video_unavailable or 'no video processor was given'}; "
                "install torchvision matching torch (transformers' video processors need it)"
            )
        clips = []
        for s in sources:
            try:
                clips.append(
                    load_video(
                        s,
                        fps=self.video_fps,
                        min_frames=self.video_min_frames,
                        max_frames=self.video_max_frames,
                        multiple=self.temporal_patch,
                        cache_dir=self.cache_dir,
                    )
                )
            except InvalidInput as exc:
                raise InvalidInput(f"{where}: {exc}") from exc
        frames = [torch.from_numpy(c.frames).permute(0, 3, 1, 2).contiguous() for c in clips]
        out = self.video_processor(videos=frames, return_tensors="pt", do_sample_frames=False, **self._size())
        sec = torch.tensor([self.temporal_patch / c.fps for c in clips], dtype=torch.float32)
        return _Media(out["pixel_values_videos"].float(), out["video_grid_thw"].long(), sec)

    # ------------------------------------------------------------------------------- text

    def _counts(self, media: _Media | None) -> list[int]:
        if media is None:
            return []
        return [int(t * h * w) // self.merge_size**2 for t, h, w in media.grid_thw.tolist()]

    def expand(self, text: str, images: _Media | None, videos: _Media | None, where: str = "row") -> str:
        """``text`` with its ``k``-th image (video) placeholder repeated as many times as image ``k``
        has merged patches. ``InvalidInput`` naming ``where`` when the text has more placeholders than
        the row has images or videos (fewer are allowed: a prefix of a conversation)."""
        for token, counts, kind in (
            (self.image_token, self._counts(images), "image"),
            (self.video_token, self._counts(videos), "video"),
        ):
            parts = text.split(token)
            if len(parts) - 1 > len(counts):
                raise InvalidInput(
                    f"{where}: the rendered text has {len(parts) - 1} {kind} placeholders but the row has "
                    f"{len(counts)} {kind}s; give one {kind} per <{kind}> marker / {{'type': '{kind}'}} part"
                )
            text = parts[0] + "".join(token * counts[k] + p for k, p in enumerate(parts[1:]))
        return text

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, **kw: Any) -> Any:
        """The chat template applied to ``messages`` (one conversation or a list of them), untokenized."""
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kw,
        )


def _parts(messages: Any, where: str) -> tuple[list[dict[str, Any]], int, int]:
    """Messages with ``<image>``/``<video>`` markers turned into content parts, and the number of image
    and video parts. ``InvalidInput`` naming ``where`` for malformed messages."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidInput(f"{where}: messages must be a non-empty list of {{'role', 'content'}} dicts")
    out, n_img, n_vid = [], 0, 0
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise InvalidInput(f"{where}: message {i} needs a 'role' in {ROLES}")
        content = m.get("content")
        if isinstance(content, str):
            parts: list[dict[str, Any]] = []
            for piece in _MARKER.split(content):
                if piece in ("<image>", "<video>"):
                    parts.append({"type": piece[1:-1]})
                elif piece:
                    parts.append({"type": "text", "text": piece})
        elif isinstance(content, (list, tuple)):
            parts = []
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, Mapping) else None
                if kind not in ("text", "image", "video"):
                    raise InvalidInput(f"{where}: message {i} part {j} needs type 'text', 'image' or 'video'")
                if kind == "text" and not isinstance(p.get("text"), str):
                    raise InvalidInput(f"{where}: message {i} part {j} (text) has no string 'text'")
                parts.append({"type": "text", "text": p["text"]} if kind == "text" else {"type": kind})
        else:
            raise InvalidInput(f"{where}: message {i} content must be a string or a list of parts")
        n_img += sum(p["type"] == "image" for p in parts)
        n_vid += sum(p["type"] == "video" for p in parts)
        out.append({**dict(m), "content": parts})
    return out, n_img, n_vid


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


class _ExpandingTokenizer:
    """What ``underlay.data.datasets._encode_conversation`` needs of a tokenizer (``chat_template``,
    ``apply_chat_template``, batched ``__call__``), rendering with the processor's template and
    expanding one row's placeholders before tokenizing."""

    def __init__(
        self, proc: VisionProcessor, images: _Media | None, videos: _Media | None, where: str
    ) -> None:
        self.proc, self.images, self.videos, self.where = proc, images, videos, where
        self.chat_template = proc.chat_template

    def apply_chat_template(self, conversations: Any, **kw: Any) -> Any:
        kw.pop("tokenize", None)
        gen = bool(kw.pop("add_generation_prompt", False))
        return self.proc.render(conversations, add_generation_prompt=gen, **kw)

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict[str, Any]:
        expanded = [self.proc.expand(t, self.images, self.videos, self.where) for t in texts]
        ids: list[list[int]] = self.proc.tokenizer(expanded, add_special_tokens=add_special_tokens)[
            "input_ids"
        ]
        return {"input_ids": ids}


class _VisionBase(abc.ABC):
    kind = "vision"

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        processor: VisionProcessor,
        *,
        image_key: str,
        video_key: str,
        max_length: int,
        overlong: Literal["filter", "error"],
        lazy: bool,
        template_kwargs: Mapping[str, Any] | None,
    ) -> None:
        if overlong not in ("filter", "error"):
            raise ConfigError(
                f"{type(self).__name__}: overlong={overlong!r}; use 'filter' or 'error' (truncating would "
                "cut image placeholders apart from their pixels)"
            )
        if not isinstance(max_length, int) or max_length < 1:
            raise ConfigError(f"{type(self).__name__}: max_length={max_length!r} must be an int >= 1")
        if lazy and overlong == "filter":
            raise ConfigError(
                f"{type(self).__name__}: lazy=True with overlong='filter' needs the pre-pass; use 'error'"
            )
        require_chat_template(processor, "the VisionProcessor")
        self.rows, self.processor = list(rows), processor
        self.image_key, self.video_key = image_key, video_key
        self.max_length, self.overlong, self.lazy = max_length, overlong, lazy
        self.template_kwargs = check_template_kwargs(
            template_kwargs, f"{type(self).__name__}(template_kwargs=...)"
        )
        self.filtered = 0
        self._index = list(range(len(self.rows)))
        self._items: list[VisionSample] | None = None
        for i, row in enumerate(self.rows):
            self._messages(i, row)  # validation: bad rows are refused before any media is read
        if not lazy:
            items: list[VisionSample] = []
            keep: list[int] = []
            for i, row in enumerate(self.rows):
                s = self._fit(i, self._encode(i, row))
                if s is not None:
                    items.append(s)
                    keep.append(i)
            self._items, self._index = items, keep

    @abc.abstractmethod
    def _messages(self, index: int, row: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int, int]:
        """Row ``index``'s messages as content parts and its image and video placeholder counts,
        without loading its media (``InvalidInput`` naming the row)."""

    @abc.abstractmethod
    def _encode(self, index: int, row: Mapping[str, Any]) -> VisionSample:
        """Load, process and tokenize row ``index``."""

    def _media(
        self, index: int, row: Mapping[str, Any], n_img: int, n_vid: int
    ) -> tuple[_Media | None, _Media | None]:
        where = f"{type(self).__name__} row {index}"
        images, videos = _as_list(row.get(self.image_key)), _as_list(row.get(self.video_key))
        if len(images) != n_img or len(videos) != n_vid:
            raise InvalidInput(
                f"{where}: the messages have {n_img} image and {n_vid} video placeholders, the row has "
                f"{len(images)} images ({self.image_key!r}) and {len(videos)} videos ({self.video_key!r})"
            )
        return self.processor.images(images, where), self.processor.videos(videos, where)

    def _fit(self, index: int, sample: VisionSample) -> VisionSample | None:
        if len(sample.input_ids) <= self.max_length:
            return sample
        if self.overlong == "error":
            raise InvalidInput(
                f"{type(self).__name__} row {index}: {len(sample.input_ids)} tokens (image and video tokens "
                f"included) > max_length={self.max_length}; lower max_pixels / video_max_frames or raise max_length"
            )
        self.filtered += 1
        return None

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> VisionSample:
        if self._items is not None:
            return self._items[i]
        index = self._index[i]
        sample = self._fit(index, self._encode(index, self.rows[index]))
        assert sample is not None  # lazy datasets raise instead of filtering
        return sample


class VisionPromptDataset(_VisionBase):
    """RL prompts with images/videos: column ``prompt_key`` holds messages (``<image>`` markers or
    parts), ``image_key`` / ``video_key`` the row's sources in marker order; the other columns (or
    ``field_keys``) travel in ``sample.fields``. Prompts are rendered with the generation prompt and
    ``system_prompt`` first when given. Overlong rows (image tokens included) are filtered (counted in
    ``filtered``) or refused (``overlong="error"``)."""

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        processor: VisionProcessor,
        *,
        prompt_key: str = "prompt",
        image_key: str = "images",
        video_key: str = "videos",
        field_keys: Sequence[str] | None = None,
        system_prompt: str | None = None,
        max_length: int = 4096,
        overlong: Literal["filter", "error"] = "filter",
        lazy: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.prompt_key, self.system_prompt = prompt_key, system_prompt
        self.field_keys = None if field_keys is None else list(field_keys)
        super().__init__(
            rows,
            processor,
            image_key=image_key,
            video_key=video_key,
            max_length=max_length,
            overlong=overlong,
            lazy=lazy,
            template_kwargs=template_kwargs,
        )

    def _messages(self, index: int, row: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int, int]:
        where = f"VisionPromptDataset row {index}"
        prompt = _require(index, row, self.prompt_key, "VisionPromptDataset")
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if self.system_prompt is not None and not (
            isinstance(msgs, list) and msgs and msgs[0].get("role") == "system"
        ):
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return _parts(msgs, where)

    def _encode(self, index: int, row: Mapping[str, Any]) -> VisionSample:
        msgs, n_img, n_vid = self._messages(index, row)
        images, videos = self._media(index, row, n_img, n_vid)
        where = f"VisionPromptDataset row {index}"
        text = self.processor.render(msgs, add_generation_prompt=True, **self.template_kwargs)
        ids: list[int] = self.processor.tokenizer(
            self.processor.expand(text, images, videos, where), add_special_tokens=False
        )["input_ids"]
        keys = (
            self.field_keys
            if self.field_keys is not None
            else [k for k in row if k not in (self.prompt_key, self.image_key, self.video_key)]
        )
        return VisionSample(tuple(ids), (0,) * len(ids), images, videos, {k: row[k] for k in keys})


class VisionSFTDataset(_VisionBase):
    """Multi-turn conversations with images/videos for SFT: ``messages_key`` holds the messages,
    ``image_key`` / ``video_key`` the sources. The loss covers assistant content and end-of-turn
    tokens (with ``last_turn_only``, the last assistant message's), built from the rendering of each
    conversation prefix as :class:`underlay.data.datasets.SFTDataset` does; the template must be
    turn-consistent (``InvalidInput`` naming the row otherwise)."""

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        processor: VisionProcessor,
        *,
        messages_key: str = "messages",
        image_key: str = "images",
        video_key: str = "videos",
        last_turn_only: bool = False,
        max_length: int = 4096,
        overlong: Literal["filter", "error"] = "filter",
        lazy: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.messages_key, self.last_turn_only = messages_key, last_turn_only
        super().__init__(
            rows,
            processor,
            image_key=image_key,
            video_key=video_key,
            max_length=max_length,
            overlong=overlong,
            lazy=lazy,
            template_kwargs=template_kwargs,
        )

    def _messages(self, index: int, row: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int, int]:
        where = f"VisionSFTDataset row {index}"
        msgs, n_img, n_vid = _parts(_require(index, row, self.messages_key, "VisionSFTDataset"), where)
        if not any(m["role"] == "assistant" for m in msgs):
            raise InvalidInput(f"{where}: no assistant message, nothing to train on")
        return msgs, n_img, n_vid

    def _encode(self, index: int, row: Mapping[str, Any]) -> VisionSample:
        msgs, n_img, n_vid = self._messages(index, row)
        images, videos = self._media(index, row, n_img, n_vid)
        where = f"VisionSFTDataset row {index}"
        tok = _ExpandingTokenizer(self.processor, images, videos, where)
        ids, mask, _ = _encode_conversation(
            tok, msgs, None, where, ("assistant",), self.last_turn_only, self.template_kwargs
        )
        return VisionSample(tuple(ids), tuple(mask), images, videos)


def _cat(media: list[tuple[int, _Media]]) -> VisionInputs | None:
    if not media:
        return None
    rows = torch.cat([torch.full((m.grid_thw.shape[0],), r, dtype=torch.long) for r, m in media])
    sec = [m.second_per_grid for _, m in media]
    return VisionInputs(
        torch.cat([m.pixel_values for _, m in media]),
        torch.cat([m.grid_thw for _, m in media]),
        rows,
        None if any(s is None for s in sec) else torch.cat([s for s in sec if s is not None]),
    )


def collate_vision(samples: Sequence[VisionSample], pad_id: int) -> TokenBatch:
    """Right-padded ``[B, S]`` batch of ``samples`` with their images and videos as ``VisionInputs``
    (rows in batch order); ``extras`` empty. ``InvalidInput`` for no samples."""
    if not samples:
        raise InvalidInput("collate_vision: no samples")
    length = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        attn[i, :n] = 1
        loss[i, :n] = torch.tensor(s.loss_mask)
    images = _cat([(i, s.images) for i, s in enumerate(samples) if s.images is not None])
    videos = _cat([(i, s.videos) for i, s in enumerate(samples) if s.videos is not None])
    return TokenBatch(ids, attn, loss, {}, images, videos)


def pack_vision(samples: Sequence[VisionSample], pad_id: int, max_tokens: int) -> list[TokenBatch]:
    """``samples`` in order, grouped into batches of at most ``max_tokens`` tokens each (image and
    video tokens included: they are in ``input_ids``), each collated by :func:`collate_vision`.
    ``InvalidInput`` when one sample alone exceeds ``max_tokens``."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidInput(f"pack_vision: max_tokens={max_tokens!r} must be an int >= 1")
    groups: list[list[VisionSample]] = []
    used = 0
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        if n > max_tokens:
            raise InvalidInput(f"pack_vision: sample {i} has {n} tokens > max_tokens={max_tokens}")
        if not groups or used + n > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(s)
        used += n
    return [collate_vision(g, pad_id) for g in groups]
