"""Streaming safetensors shards for ``export_hf``: written while the tensors are still being gathered.

The shard layout is fixed before the first tensor arrives: names, shapes and the export dtype come
from the weight map (``WeightRule.hf_shapes``), so every shard's header is known up front. A writer
thread opens each shard, writes its header and then each tensor's bytes as it arrives (straight from
the tensor's memory, no serialised copy), while the caller gathers the next tensors; a byte-bounded
hand-off (``buffer_bytes``) caps the host memory the gathered-but-unwritten tensors hold. With
``buffer_bytes=0`` the caller's thread writes each tensor itself (the sequential order of work; the
files are byte-identical either way).

File format: safetensors (8-byte little-endian header length, a JSON header padded with spaces to a
multiple of 8 bytes, then the tensors' bytes back to back in arrival order, ``data_offsets`` relative
to the end of the header), with ``{"format": "pt"}`` metadata; loadable by ``safetensors`` and
transformers. Shards are written as ``shard-XXXXX.safetensors.tmp`` and renamed by ``finish``.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import torch

from underlay.interfaces import CheckpointError, InvalidInput
from underlay.utils.safe_files import INDEX_FILE, SAFETENSORS_DTYPES

__all__ = [
    "DEFAULT_EXPORT_BUFFER_BYTES",
    "TOKENIZER_FILES",
    "StreamingShardWriter",
    "export_owned",
    "plan_shards",
]

# the tokenizer files of a model directory that every engine's export copies from the source
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)

_EXPORT_SUFFIXES = (".safetensors", ".json", ".model", ".jinja", ".tiktoken")
_EXPORT_NAMES = frozenset({"merges.txt", "vocab.txt", "README.md"})


def export_owned(name: str) -> bool:
    """Whether a file named ``name`` in an export directory is of a kind an export writes (weights,
    configs, tokenizer and processor files, peft's README): such a directory is replaced by the next
    export; any other file (or a subdirectory) makes the export refuse the directory."""
    return name.endswith(_EXPORT_SUFFIXES) or name in _EXPORT_NAMES


DEFAULT_EXPORT_BUFFER_BYTES = 1 << 30
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def plan_shards(
    entries: Sequence[tuple[str, tuple[int, ...]]], itemsize: int, max_shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split ``(name, shape)`` pairs, in order, into shards of at most ``max_shard_bytes`` bytes at
    ``itemsize`` bytes per element (a larger tensor gets a shard of its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = []
    size = 0
    for name, shape in entries:
        nbytes = itemsize * _numel(shape)
        if not shards or (shards[-1] and size + nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _header(shard: Sequence[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> bytes:
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, shape in shard:
        nbytes = _numel(shape) * dtype.itemsize
        meta[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    body = json.dumps(meta, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


class StreamingShardWriter:
    """Writes the tensors of ``entries`` (``(name, shape)`` in the order ``add`` receives them) as
    ``dtype`` safetensors shards of at most ``max_shard_bytes`` into the existing directory ``out``.

    ``add`` checks each tensor against the plan (name, shape, dtype, cpu) and hands it to the writer
    thread, blocking while more than ``buffer_bytes`` are waiting (one tensor is always admitted);
    ``buffer_bytes=0`` writes in the caller's thread. ``finish`` waits for the writes, renames the
    shards to ``model.safetensors`` (one shard) or ``model-XXXXX-of-YYYYY.safetensors`` and writes
    ``model.safetensors.index.json`` (several). A write error is raised by the next ``add`` or by
    ``finish``; ``close`` stops the thread without finishing (the caller deletes ``out``).
    """

    def __init__(
        self,
        out: Path,
        entries: Sequence[tuple[str, tuple[int, ...]]],
        dtype: torch.dtype,
        max_shard_bytes: int,
        buffer_bytes: int = DEFAULT_EXPORT_BUFFER_BYTES,
    ) -> None:
        if dtype not in _DTYPE_NAMES:
            raise InvalidInput(f"export: dtype {dtype} has no safetensors name; use a float dtype")
        if isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int) or buffer_bytes < 0:
            raise InvalidInput(f"export: buffer_bytes={buffer_bytes!r} must be an int >= 0")
        self.out, self.dtype, self.limit = Path(out), dtype, buffer_bytes
        self.shards = plan_shards(entries, dtype.itemsize, max_shard_bytes)
        self.order = [(s, name, shape) for s, shard in enumerate(self.shards) for name, shape in shard]
        self.total = sum(_numel(shape) for _, _, shape in self.order) * dtype.itemsize
        self.next = 0  # index into order of the next add
        self.written = 0  # index into order of the next write
        self.fh: IO[bytes] | None = None
        self.error: BaseException | None = None
        self.pending: deque[torch.Tensor] = deque()
        self.pending_bytes = 0
        self.closed = False
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        if buffer_bytes > 0:
            self.thread = threading.Thread(target=self._run, name="underlay-export-writer", daemon=True)
            self.thread.start()

    def _tmp(self, s: int) -> Path:
        return self.out / f"shard-{s:05d}.safetensors.tmp"

    def _write(self, tensor: torch.Tensor) -> None:
        s, _, _ = self.order[self.written]
        if self.fh is None:
            self.fh = open(self._tmp(s), "wb")  # noqa: SIM115 (closed when the shard is complete)
            self.fh.write(_header(self.shards[s], self.dtype))
        if tensor.numel():
            self.fh.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        self.written += 1
        if self.written == len(self.order) or self.order[self.written][0] != s:
            self.fh.close()
            self.fh = None

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.closed:
                    self.cond.wait()
                if not self.pending:
                    return
                tensor = self.pending[0]
            try:
                if self.error is None:
                    self._write(tensor)
            except BaseException as exc:  # reported by the next add or finish
                self.error = exc
            with self.cond:
                self.pending.popleft()
                self.pending_bytes -= tensor.numel() * tensor.element_size()
                self.cond.notify_all()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue (or write) the next tensor. ``CheckpointError`` when it is not the planned one (name,
        shape, dtype, a cpu tensor) or an earlier write failed."""
        if self.error is not None:
            raise CheckpointError(f"export: writing {self.out} failed ({self.error})") from self.error
        if self.next >= len(self.order):
            raise CheckpointError(f"export: {name!r} arrived after the {len(self.order)} planned tensors")
        _, want, shape = self.order[self.next]
        if name != want or tuple(tensor.shape) != shape or tensor.dtype != self.dtype or tensor.is_cuda:
            raise CheckpointError(
                f"export: got {name!r} {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, the plan "
                f"expects {want!r} {shape} {self.dtype} on the cpu (the weight map's shapes disagree "
                "with the parameters)"
            )
        tensor = tensor.contiguous()
        self.next += 1
        if self.thread is None:
            self._write(tensor)
            return
        nbytes = tensor.numel() * tensor.element_size()
        with self.cond:
            while self.pending and self.pending_bytes + nbytes > self.limit and self.error is None:
                self.cond.wait()
            self.pending.append(tensor)
            self.pending_bytes += nbytes
            self.cond.notify_all()

    def close(self) -> None:
        """Stop the writer thread after the queued writes (idempotent); leaves the files as they are."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()
        if self.fh is not None:
            self.fh.close()
            self.fh = None

    def finish(self) -> None:
        """Wait for every write, then give the shards their final names and write the index.
        ``CheckpointError`` when a write failed or fewer tensors than planned arrived."""
        self.close()
        if self.error is not None:
            raise CheckpointError(f"export: writing {self.out} failed ({self.error})") from self.error
        if self.written != len(self.order):
            raise CheckpointError(
                f"export: {self.written} of {len(self.order)} planned tensors arrived; the export is incomplete"
            )
        n = len(self.shards)
        weight_map: dict[str, str] = {}
        for s, shard in enumerate(self.shards):
            final = "model.safetensors" if n == 1 else f"model-{s + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self._tmp(s), self.out / final)
            weight_map.update({name: final for name, _ in shard})
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2))
