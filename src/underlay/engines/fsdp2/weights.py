"""``FSDP2WeightLoader``: Hugging Face safetensors <-> FSDP2 shards, one tensor at a time."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from underlay.interfaces import CheckpointError, Device, InvalidInput, LoadReport, ParallelEngine, WeightMap
from underlay.parallel.agree import agree, describe
from underlay.parallel.rank import current_rank
from underlay.utils.safe_files import (
    SafetensorsEntry,
    abort_directory,
    atomic_directory,
    begin_directory,
    commit_directory,
    read_safetensors_dir,
)

__all__ = ["TOKENIZER_FILES", "FSDP2WeightLoader", "load_hf_into"]

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


def load_hf_into(engine: ParallelEngine, path: str | Path, *, strict: bool = True) -> LoadReport:
    """``FSDP2WeightLoader.load_hf`` as a function (the engine calls it while it materialises; it only
    uses the ``ParallelEngine`` protocol: ``weight_map`` and ``copy_full_parameter``).

    Every HF name the map expects is looked up in the file headers (a tied alias stands in for its
    canonical name), names and shapes are all checked before any parameter changes: a shape mismatch
    always raises ``CheckpointError``; with ``strict``, missing names (except those of ``optional``
    rules) and unexpected names (neither expected, tied nor ``ignored``) raise it too. Then each engine
    parameter is built from its HF tensors (``rule.from_hf``) and copied into the shards, one at a time.
    ``LoadReport.loaded`` counts HF tensors read; ``missing`` lists the expected HF names not found.
    Collective (each rank reads the files itself)."""
    wmap = engine.weight_map
    error: CheckpointError | None = None
    plan: tuple[dict[str, SafetensorsEntry], dict[str, str], tuple[str, ...], tuple[str, ...]] | None = None
    try:
        plan = _plan_load(wmap, Path(path), strict)
    except CheckpointError as exc:
        error = exc
    # each rank validated the files itself: all go on, or all raise (no rank left in a barrier)
    agree(error is None, str(error), what=f"load_hf({path})", error_type=CheckpointError, cause=error)
    assert plan is not None
    where, source, missing, unexpected = plan
    from safetensors import safe_open

    loaded, nbytes = 0, 0
    try:
        with contextlib.ExitStack() as stack:
            files = sorted({where[src].file for src in source.values()})
            handles = {f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files}
            for rule in wmap.rules:
                if any(hf not in source for hf in rule.hf_names):
                    continue
                tensors: dict[str, torch.Tensor] = {}
                for hf in rule.hf_names:
                    entry = where[source[hf]]
                    try:
                        tensors[hf] = handles[entry.file].get_tensor(source[hf])
                    except Exception as exc:  # the file changed after validation
                        raise CheckpointError(f"{entry.file}: cannot read {source[hf]!r} ({exc})") from exc
                nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
                full = rule.from_hf(tensors)
                del tensors
                engine.copy_full_parameter(rule.engine_name, full)
                del full
                loaded += len(rule.hf_names)
    except CheckpointError as exc:
        error = exc
    agree(error is None, str(error), what=f"load_hf({path})", error_type=CheckpointError, cause=error)
    return LoadReport(loaded=loaded, missing=missing, unexpected=unexpected, bytes_read=nbytes)


def _plan_load(
    wmap: WeightMap, path: Path, strict: bool
) -> tuple[dict[str, SafetensorsEntry], dict[str, str], tuple[str, ...], tuple[str, ...]]:
    """Validate the HF directory ``path`` against ``wmap`` without changing any parameter: the file
    entries (``read_safetensors_dir``: index followed, headers and sizes checked), the file name each
    expected HF name is read from (a tied alias stands in for its canonical name), and the missing and
    unexpected names. ``CheckpointError`` for a shape mismatch, int/bool data for a float parameter or,
    with ``strict``, required missing or unexpected names."""
    where = read_safetensors_dir(path)
    expected: dict[str, tuple[int, ...]] = {}
    for rule in wmap.rules:
        expected.update(rule.hf_shapes())
    aliases: dict[str, list[str]] = {}
    for alias, canonical in wmap.tied.items():
        aliases.setdefault(canonical, []).append(alias)
    source: dict[str, str] = {}
    for hf in expected:
        for candidate in (hf, *aliases.get(hf, ())):
            if candidate in where:
                source[hf] = candidate
                break
    missing = tuple(hf for hf in expected if hf not in source)
    required_missing = [hf for hf in missing if not (r := wmap.rule_for_hf(hf)) or not r.optional]
    unexpected = tuple(
        sorted(n for n in where if n not in expected and n not in wmap.tied and not wmap.is_ignored(n))
    )
    bad = [
        f"{hf}: file {where[src].shape} != model {expected[hf]}"
        for hf, src in source.items()
        if where[src].shape != expected[hf]
    ]
    bad += [
        f"{hf}: file dtype {where[src].dtype} for a floating-point parameter"
        for hf, src in source.items()
        if not where[src].dtype.is_floating_point
    ]
    if bad:
        raise CheckpointError(
            f"load_hf({path}): shape mismatch (or int/bool data for a float parameter) in {len(bad)} "
            f"tensors, e.g. {bad[:3]}; the weights belong to another model configuration"
        )
    if strict and (required_missing or unexpected):
        raise CheckpointError(
            f"load_hf({path}): missing {required_missing[:5]} ({len(required_missing)} in all), unexpected "
            f"{list(unexpected[:5])} ({len(unexpected)} in all); fix the model config or pass strict=False"
        )
    return where, source, missing, unexpected


class FSDP2WeightLoader:
    """Streams safetensors into FSDP2 shards and exports full HF checkpoints from rank 0, driven by the
    engine's ``weight_map`` through the ``ParallelEngine`` protocol.

    Memory: loading holds, per rank, the HF tensors of one engine parameter and that parameter's full
    value; export holds one full engine parameter on every rank and at most one output shard
    (``max_shard_bytes``) on rank 0.
    """

    def __init__(self, device: Device | None = None) -> None:
        self._device = device

    @property
    def name(self) -> str:
        """``"fsdp2"``."""
        return "fsdp2"

    def load_hf(self, engine: ParallelEngine, path: str | Path, *, strict: bool = True) -> LoadReport:
        """Load every HF tensor of ``path`` that ``engine.weight_map`` names into ``engine``'s shards
        (LoRA adapters are not part of HF files and are left alone); see ``load_hf_into``."""
        return load_hf_into(engine, path, strict=strict)

    def iter_hf_tensors(self, engine: ParallelEngine) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 tensors with HF names (LoRA merged), one engine parameter at a time, in
        ``weight_map`` order. Collective."""
        yield from engine.weight_map.to_hf(engine.named_full_parameters())

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
        and the tokenizer and processor files (``models.PROCESSOR_FILES``) of the source directory when it had them. Tensors are gathered one
        at a time in ``dtype`` (default: the engine's ``param_dtype``); LoRA models export merged
        weights. Collective; returns ``out_dir`` on rank 0, ``None`` elsewhere."""
        eng = engine
        if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
            raise InvalidInput(f"export_hf: max_shard_bytes={max_shard_bytes!r} must be an int >= 1")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise InvalidInput(
                f"export_hf: dtype={dtype!r} is not a floating torch dtype; use torch.bfloat16, "
                "torch.float16 or torch.float32 (or None for the engine's param_dtype)"
            )
        out = Path(out_dir)
        dtype = dtype or eng.param_dtype
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
        for name, full in self.iter_hf_tensors(eng):  # collective: every rank iterates to the end
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

        eng = engine
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
    def _write_config(eng: ParallelEngine, out: Path) -> None:
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
            from underlay.models.vision import PROCESSOR_FILES

            for fname in TOKENIZER_FILES + PROCESSOR_FILES:
                if (Path(src) / fname).is_file():
                    shutil.copyfile(Path(src) / fname, out / fname)


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
