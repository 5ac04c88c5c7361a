"""``FSDP2WeightLoader``: Hugging Face safetensors <-> FSDP2 shards, one tensor at a time."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from underlay.interfaces import CheckpointError, Device, InvalidInput, LoadReport, ParallelEngine
from underlay.parallel.rank import current_rank

__all__ = ["TOKENIZER_FILES", "FSDP2WeightLoader", "load_hf_into", "read_hf_index"]

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


def read_hf_index(path: Path) -> tuple[list[Path], dict[str, tuple[Path, tuple[int, ...]]]]:
    """The safetensors files of the local HF directory ``path`` and, for every tensor name in them, the
    file holding it and its shape (headers only, no tensor data). ``CheckpointError`` when ``path`` is
    not a directory or has no ``*.safetensors``."""
    from safetensors import safe_open

    if not path.is_dir():
        raise CheckpointError(f"load_hf: {path} is not a directory; give a local HF model directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"load_hf: no *.safetensors in {path}; convert the weights to safetensors first"
        )
    where: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                shape = tuple(handle.get_slice(key).get_shape())
                where[key] = (f, shape)
    return files, where


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
    from safetensors import safe_open

    wmap = engine.weight_map
    files, where = read_hf_index(Path(path))
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
        f"{hf}: file {where[src][1]} != model {expected[hf]}"
        for hf, src in source.items()
        if where[src][1] != expected[hf]
    ]
    if bad:
        raise CheckpointError(
            f"load_hf({path}): shape mismatch for {len(bad)} tensors, e.g. {bad[:3]}; the weights "
            "belong to another model configuration"
        )
    if strict and (required_missing or unexpected):
        raise CheckpointError(
            f"load_hf({path}): missing {required_missing[:5]} ({len(required_missing)} in all), unexpected "
            f"{list(unexpected[:5])} ({len(unexpected)} in all); fix the model config or pass strict=False"
        )
    loaded, nbytes = 0, 0
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files}
        for rule in wmap.rules:
            if any(hf not in source for hf in rule.hf_names):
                continue
            tensors = {hf: handles[where[source[hf]][0]].get_tensor(source[hf]) for hf in rule.hf_names}
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
            full = rule.from_hf(tensors)
            del tensors
            engine.copy_full_parameter(rule.engine_name, full)
            del full
            loaded += len(rule.hf_names)
    if dist.is_initialized():
        dist.barrier()
    return LoadReport(loaded=loaded, missing=missing, unexpected=unexpected, bytes_read=nbytes)


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
        and the tokenizer files of the source directory when it had them. Tensors are gathered one
        at a time in ``dtype`` (default: the engine's ``param_dtype``); LoRA models export merged
        weights. Collective; returns ``out_dir`` on rank 0, ``None`` elsewhere."""
        eng = engine
        if max_shard_bytes < 1:
            raise InvalidInput(f"export_hf: max_shard_bytes={max_shard_bytes} must be >= 1")
        out = Path(out_dir)
        dtype = dtype or eng.param_dtype
        writer = _ShardWriter(out, max_shard_bytes) if current_rank() == 0 else None
        for name, full in self.iter_hf_tensors(eng):
            if writer is not None:
                writer.add(name, full.to(dtype).cpu())
            del full
        if writer is not None:
            writer.finish()
            self._write_config(eng, out)
        if dist.is_initialized():
            dist.barrier()
        return out if writer is not None else None

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
        if current_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
            peft_config["default"].save_pretrained(str(out))
        if dist.is_initialized():
            dist.barrier()
        return out if current_rank() == 0 else None

    @staticmethod
    def _write_config(eng: ParallelEngine, out: Path) -> None:
        cfg = eng.hf_config
        base = eng.model
        get_base = getattr(base, "get_base_model", None)
        if callable(get_base):
            base = get_base()
        cfg.architectures = [type(base).__name__]
        cfg.save_pretrained(str(out))
        src = eng.config.model.path
        if src is not None:
            for fname in TOKENIZER_FILES:
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
