"""``FSDP2WeightLoader``: Hugging Face safetensors <-> FSDP2 shards, one tensor at a time."""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from underlay.engines.fsdp2 import _build
from underlay.interfaces import CheckpointError, Device, InvalidInput, LoadReport, ParallelEngine
from underlay.parallel.agree import agree, describe
from underlay.parallel.rank import current_rank
from underlay.utils.safe_files import (
    SafetensorsEntry,
    abort_directory,
    atomic_directory,
    begin_directory,
    commit_directory,
    iter_safetensors,
    read_safetensors_dir,
)

__all__ = ["TOKENIZER_FILES", "FSDP2WeightLoader"]

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


def _engine(engine: ParallelEngine) -> Any:
    from underlay.engines.fsdp2.engine import FSDP2Engine

    if not isinstance(engine, FSDP2Engine):
        raise InvalidInput(
            f"FSDP2WeightLoader serves fsdp2 engines, got {type(engine).__name__}; use "
            "underlay.get_weight_loader(engine.name)"
        )
    return engine


class FSDP2WeightLoader:
    """Streams safetensors into FSDP2 shards and exports full HF checkpoints from rank 0.

    Memory: loading holds one full tensor per rank at a time; export holds one tensor on every rank
    and at most one output shard (``max_shard_bytes``) on rank 0.
    """

    def __init__(self, device: Device | None = None) -> None:
        self._device = device

    @property
    def name(self) -> str:
        """``"fsdp2"``."""
        return "fsdp2"

    def load_hf(self, engine: ParallelEngine, path: str | Path, *, strict: bool = True) -> LoadReport:
        """Load every base-model tensor of ``path`` into ``engine``'s shards (LoRA adapters are not
        part of HF files and are left alone). Before any parameter changes, every file header is
        validated (``utils.safe_files.read_safetensors_dir``: the index is followed and a directory
        whose files disagree with it is refused, a truncated file is refused) and every name, shape
        and dtype kind is checked: a shape mismatch or an int/bool tensor for a float parameter always
        raises ``CheckpointError``; missing or unexpected names raise it with ``strict``. Collective
        (each rank reads the files itself)."""
        eng = _engine(engine)
        error: CheckpointError | None = None
        try:
            where, targets, missing, unexpected = self._plan_load(eng, Path(path), strict)
        except CheckpointError as exc:
            error = exc
        # each rank validated the files itself: all go on, or all raise (no rank left in a barrier)
        agree(error is None, str(error), what=f"load_hf({path})", error_type=CheckpointError, cause=error)
        loaded, nbytes = 0, 0
        done: set[int] = set()
        try:
            for key, tensor in iter_safetensors(where, lambda n: n in targets):
                param = targets[key]
                if id(param) in done:
                    continue
                nbytes += tensor.numel() * tensor.element_size()
                _build.copy_into_param(param, tensor, key)
                del tensor
                done.add(id(param))
                loaded += 1
        except CheckpointError as exc:  # a read error after validation (the file changed under us)
            error = exc
        agree(error is None, str(error), what=f"load_hf({path})", error_type=CheckpointError, cause=error)
        return LoadReport(loaded=loaded, missing=missing, unexpected=unexpected, bytes_read=nbytes)

    @staticmethod
    def _plan_load(
        eng: Any, path: Path, strict: bool
    ) -> tuple[dict[str, SafetensorsEntry], dict[str, torch.Tensor], tuple[str, ...], tuple[str, ...]]:
        """Validate ``path`` against ``eng``'s parameters without changing any: the file entries, the
        targets by HF name, and the missing and unexpected names. ``CheckpointError`` otherwise."""
        where = read_safetensors_dir(path)
        targets: dict[str, torch.Tensor] = {}
        for name, param in eng.model.named_parameters(remove_duplicate=False):
            if "lora_" not in name:
                targets[_build.hf_name(name)] = param
        present = {id(targets[n]) for n in where if n in targets}
        uniq = _unique(targets)
        missing = tuple(n for n, p in targets.items() if id(p) not in present and n in uniq)
        unexpected = tuple(sorted(n for n in where if n not in targets))
        bad = [
            f"{n}: file {where[n].shape} != model {tuple(targets[n].shape)}"
            for n in where
            if n in targets and where[n].shape != tuple(targets[n].shape)
        ]
        bad += [
            f"{n}: file dtype {where[n].dtype} for a {targets[n].dtype} parameter"
            for n in where
            if n in targets and targets[n].is_floating_point() and not where[n].dtype.is_floating_point
        ]
        if bad:
            raise CheckpointError(
                f"load_hf({path}): shape mismatch (or int/bool data for a float parameter) in {len(bad)} "
                f"tensors, e.g. {bad[:3]}; the weights "
                "belong to another model configuration"
            )
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"load_hf({path}): missing {list(missing[:5])} ({len(missing)} in all), unexpected "
                f"{list(unexpected[:5])} ({len(unexpected)} in all); fix the model config or pass strict=False"
            )
        return where, targets, missing, unexpected

    def iter_hf_tensors(self, engine: ParallelEngine) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 tensors with HF names (LoRA merged), one at a time. Collective."""
        yield from _engine(engine).named_full_tensors()

    def export_hf(
        self,
        engine: ParallelEngine,
        out_dir: str | Path,
        *,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = 5 << 30,
    ) -> Path | None:
        """Rank 0 writes ``config.json``, ``model-XXXXX-of-YYYYY.safetensors`` shards of at most
        ``max_shard_bytes`` (a larger tensor gets a shard of its own), ``model.safetensors.index.json``
        and the tokenizer files of the source directory when it had them. Tensors are gathered one
        at a time in ``dtype`` (default: the engine's ``param_dtype``); LoRA models export merged
        weights. Collective; returns ``out_dir`` on rank 0, ``None`` elsewhere."""
        eng = _engine(engine)
        if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
            raise InvalidInput(f"export_hf: max_shard_bytes={max_shard_bytes!r} must be an int >= 1")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise InvalidInput(
                f"export_hf: dtype={dtype!r} is not a floating torch dtype; use torch.bfloat16, "
                "torch.float16 or torch.float32 (or None for the engine's param_dtype)"
            )
        out = Path(out_dir)
        dtype = dtype or eng._param_dtype
        # rank 0 builds the export in a fresh sibling directory and swaps it in whole: an earlier
        # export there (other sharding, other files) is replaced, never mixed with the new one
        rank0 = current_rank() == 0
        error: BaseException | None = None
        tmp: Path | None = None
        writer: _ShardWriter | None = None
        if rank0:
            try:
                tmp = begin_directory(out)
                writer = _ShardWriter(tmp, max_shard_bytes)
            except Exception as exc:
                error = exc
        for name, full in eng.named_full_tensors():  # collective: every rank iterates to the end
            if writer is not None and error is None:
                try:
                    writer.add(name, full.to(dtype).cpu())
                except Exception as exc:
                    error = exc
            del full
        if writer is not None and tmp is not None:
            try:
                if error is None:
                    writer.finish()
                    self._write_config(eng, tmp)
                    commit_directory(tmp, out)
            except Exception as exc:
                error = exc
            if error is not None:
                abort_directory(tmp)
        agree(
            error is None, describe(error), what=f"export_hf({out})", error_type=CheckpointError, cause=error
        )
        return out if rank0 else None

    def export_adapters(self, engine: ParallelEngine, out_dir: str | Path) -> Path | None:
        """Rank 0 writes the LoRA adapters alone in peft's format (``adapter_model.safetensors`` +
        ``adapter_config.json``; loadable by ``PeftModel.from_pretrained`` on the base model).
        ``InvalidInput`` when the engine has no LoRA. Collective; ``out_dir`` on rank 0, else ``None``."""
        from safetensors.torch import save_file

        eng = _engine(engine)
        peft_config = getattr(eng.model, "peft_config", None)
        if not peft_config:
            raise InvalidInput("export_adapters: the engine has no LoRA adapters (ModelConfig.lora is None)")
        tensors = {n: t.cpu().contiguous() for n, t in eng.named_adapter_tensors()}
        out = Path(out_dir)
        error: BaseException | None = None
        if current_rank() == 0:
            try:
                with atomic_directory(out) as tmp:
                    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
                    peft_config["default"].save_pretrained(str(tmp))
            except Exception as exc:
                error = exc
        agree(
            error is None,
            describe(error),
            what=f"export_adapters({out})",
            error_type=CheckpointError,
            cause=error,
        )
        return out if current_rank() == 0 else None

    @staticmethod
    def _write_config(eng: Any, out: Path) -> None:
        cfg = eng.hf_config
        base = eng.model
        get_base = getattr(base, "get_base_model", None)
        if callable(get_base):
            base = get_base()
        # fully_shard swaps the class for a generated FSDP<Name> subclass: name the model's own class
        arch = next(c for c in type(base).__mro__ if not c.__module__.startswith("torch."))
        cfg = copy.deepcopy(cfg)  # the engine's config stays as built
        cfg.architectures = [arch.__name__]
        cfg.save_pretrained(str(out))
        src = eng.config.model.path
        if src is not None:
            for fname in TOKENIZER_FILES:
                if (Path(src) / fname).is_file():
                    shutil.copyfile(Path(src) / fname, out / fname)


def _unique(targets: dict[str, torch.Tensor]) -> set[str]:
    """The first name of every distinct parameter (tied aliases count once)."""
    seen: set[int] = set()
    names: set[str] = set()
    for n, p in targets.items():
        if id(p) not in seen:
            seen.add(id(p))
            names.add(n)
    return names


class _ShardWriter:
    """Buffers tensors up to ``max_bytes``, flushes numbered safetensors shards, writes the index."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        out.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        tmp = self.out / f"shard-{len(self.shards):05d}.safetensors.tmp"
        save_file(self.pending, str(tmp), metadata={"format": "pt"})
        self.shards.append((tmp, list(self.pending)))
        self.pending, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        n = len(self.shards)
        weight_map: dict[str, str] = {}
        for i, (tmp, names) in enumerate(self.shards):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, self.out / final)
            weight_map.update({name: final for name in names})
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
