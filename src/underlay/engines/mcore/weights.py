"""``MCoreWeightLoader``: Hugging Face safetensors <-> megatron-core shards through the weight map.

Loading streams: each rank opens the safetensors files lazily and reads only the HF tensors its own
parameters are built from, one engine parameter at a time (memory bounded by the largest fused
parameter's inputs). Export gathers each tensor over TP/EP, broadcasts it from its pipeline stage, and
rank 0 writes shards of at most ``max_shard_bytes``.
"""

from __future__ import annotations

import copy
import fnmatch
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from underlay.interfaces import CheckpointError, Device, InvalidInput, LoadReport, ParallelEngine

__all__ = ["MCoreWeightLoader", "SafetensorsReader"]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


class SafetensorsReader:
    """Lazy reader over every ``*.safetensors`` file of a directory: ``get(name)`` returns one full
    tensor (cpu) or ``None``; ``names`` lists what the files hold. Use as a context manager."""

    def __init__(self, path: Path) -> None:
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path} has no *.safetensors files; give a Hugging Face model directory")
        from safetensors import safe_open

        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, Any] = {}
        for h in self._handles:
            for k in h.keys():  # type: ignore[no-untyped-call]  # noqa: SIM118 (handles are not iterable)
                self._where[k] = h
        self.bytes_read = 0

    @property
    def names(self) -> set[str]:
        """Every tensor name in the files."""
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The stored shape of ``name`` from the file header (no tensor data read), or ``None``."""
        h = self._where.get(name)
        if h is None:
            return None
        return tuple(int(x) for x in h.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor | None:
        """The full tensor ``name``, or ``None`` when no file holds it."""
        h = self._where.get(name)
        if h is None:
            return None
        t: torch.Tensor = h.get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._handles.clear()
        self._where.clear()


def _engine(engine: ParallelEngine) -> Any:
    if getattr(engine, "name", None) != "mcore" or not hasattr(engine, "load_tensors"):
        raise InvalidInput(
            f"MCoreWeightLoader needs an mcore engine, got {getattr(engine, 'name', type(engine))!r}"
        )
    return engine


class MCoreWeightLoader:
    """HF safetensors <-> an mcore engine's TP/PP/EP shards (fused q/k/v per query group, fused
    gate/up, per-expert names on disk)."""

    def __init__(self, device: Device | None = None) -> None:
        self._device = device

    @property
    def name(self) -> str:
        """``"mcore"``."""
        return "mcore"

    def load_hf(self, engine: ParallelEngine, path: str | Path, *, strict: bool = True) -> LoadReport:
        """Stream ``*.safetensors`` of ``path`` into the engine's shards. With ``strict``, missing or
        unexpected names raise ``CheckpointError`` naming them before any parameter changes; shape
        mismatches always raise. A value model loads a ``*ForTokenClassification`` checkpoint (its
        ``score.*`` head included) or the backbone of a causal-LM checkpoint: a missing head is only
        reported in ``missing`` (the parameters keep their values) and ``lm_head.weight`` is never
        unexpected (the weight map's optional and ignored names). Collective (every rank reads its
        own shards)."""
        eng = _engine(engine)
        from underlay.engines.mcore.weightmap import hf_shapes

        expected = set(hf_shapes(eng.arch))
        wmap = eng.weight_map
        optional = {n for r in wmap.rules if r.optional for n in r.hf_names}
        with SafetensorsReader(Path(path)) as reader:
            names = reader.names
            missing = sorted(expected - names)
            unexpected = sorted(
                n
                for n in names - expected
                if not any(fnmatch.fnmatchcase(n, pat) for pat in (*wmap.ignored, "*rotary_emb.inv_freq"))
            )
            if strict and ((set(missing) - optional) or unexpected):
                raise CheckpointError(
                    f"load_hf {path}: missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} "
                    f"({len(unexpected)}); pass strict=False to load what matches"
                )
            shapes = hf_shapes(eng.arch)
            for n in sorted(expected & names):
                stored = reader.shape(n)
                if stored != shapes[n]:
                    raise CheckpointError(
                        f"{n}: shape mismatch: {stored} in the files != {shapes[n]} of the model config; load a "
                        "checkpoint of this architecture"
                    )
            from underlay.engines.mcore._chunks import unwrap as _unwrap

            eng.load_tensors([_unwrap(c) for c in eng.chunks], reader.get)
            # HF tensors of the files the model consumed (over all ranks: every rank reads its shards)
            loaded = len(expected & names)
            read = reader.bytes_read
        dist.barrier()
        return LoadReport(loaded, tuple(missing), tuple(unexpected), read)

    def iter_hf_tensors(self, engine: ParallelEngine) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors one at a time with HF names (fp32 as stored). Collective."""
        yield from _engine(engine).named_full_tensors()

    def export_hf(
        self,
        engine: ParallelEngine,
        out_dir: str | Path,
        *,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = 5 << 30,
    ) -> Path | None:
        """Write ``config.json``, ``model-XXXXX-of-YYYYY.safetensors`` shards (+ index) in ``dtype``
        (default ``param_dtype``) and the source's tokenizer files from rank 0, loadable by
        ``transformers.from_pretrained``, through the shared writer (``engines._core.export_hf_atomic``):
        built in a fresh sibling directory and swapped in whole, so ``out_dir`` holds the complete new
        export or what it held before. Collective; returns ``out_dir`` on rank 0, ``None`` elsewhere;
        ``CheckpointError`` on every rank when rank 0 fails."""
        from underlay.engines._core import export_hf_atomic
        from underlay.engines._hf_export import DEFAULT_EXPORT_BUFFER_BYTES

        eng = _engine(engine)

        def write_config(out: Path) -> None:
            cfg = copy.deepcopy(eng.hf_config)  # the engine's config stays as built
            if dtype is not None:
                cfg.torch_dtype = dtype
            cfg.save_pretrained(str(out))
            src = eng.config.model.path
            if src is not None:
                for f in _TOKENIZER_FILES:
                    if (Path(src) / f).is_file():
                        shutil.copyfile(Path(src) / f, out / f)

        return export_hf_atomic(
            eng,
            out_dir,
            eng.named_full_tensors(),
            write_config,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            buffer_bytes=DEFAULT_EXPORT_BUFFER_BYTES,
        )

    def export_adapters(self, engine: ParallelEngine, out_dir: str | Path) -> Path | None:
        """The mcore engine has no LoRA adapters: always ``InvalidInput``."""
        raise InvalidInput("export_adapters: the mcore engine has no LoRA adapters (LoRA is fsdp2-only)")
