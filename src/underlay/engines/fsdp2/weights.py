"""``FSDP2WeightLoader``: Hugging Face safetensors <-> FSDP2 shards.

Loading splits the file reads across ranks and broadcasts the bytes (``underlay.engines._hf_load``);
export streams the gathered tensors to a writer thread on rank 0 (``underlay.engines._hf_export``)."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from underlay.engines._hf_export import DEFAULT_EXPORT_BUFFER_BYTES, export_owned
from underlay.engines._hf_load import (
    DEFAULT_LOAD_BUCKET_BYTES,
    LoadPlan,
    gather_headers,
    load_rounds,
    plan_load,
    schedule,
)
from underlay.interfaces import CheckpointError, Device, InvalidInput, LoadReport, ParallelEngine
from underlay.parallel.agree import agree, describe
from underlay.parallel.rank import current_rank
from underlay.utils.safe_files import as_path, atomic_directory

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


def load_hf_into(
    engine: ParallelEngine,
    path: str | Path,
    *,
    strict: bool = True,
    bucket_bytes: int = DEFAULT_LOAD_BUCKET_BYTES,
) -> LoadReport:
    """``FSDP2WeightLoader.load_hf`` as a function (the engine calls it while it materialises; it only
    uses the ``ParallelEngine`` protocol: ``weight_map`` and ``copy_full_parameter``).

    Every HF name the map expects is looked up in the file headers (a tied alias stands in for its
    canonical name), names and shapes are all checked before any parameter changes: a shape mismatch
    always raises ``CheckpointError``; with ``strict``, missing names (except those of ``optional``
    rules) and unexpected names (neither expected, tied nor ``ignored``) raise it too. A bad header or
    index found by any rank raises on every rank, before any change.

    Reading is split across ranks (``underlay.engines._hf_load``): each rank validates about
    ``1/world`` of the file headers and reads about ``1/world`` of the tensor bytes (contiguous runs
    in file order, cut between tensors; a single file is split by tensor), once, and the bytes
    reach every rank by broadcast, in rounds of about ``bucket_bytes``; each engine parameter is
    built from its HF tensors (``rule.from_hf``) and copied into the shards while the next round is
    broadcast and the one after is read. Extra memory per rank: about ``2 * bucket_bytes`` (two
    rounds; a single parameter larger than a round's share makes its round larger), one prefetched
    share of a third round and one full parameter.

    ``LoadReport.loaded`` counts HF tensors loaded; ``missing`` lists the expected HF names not found;
    ``bytes_read`` is the tensor bytes this rank read from the files. ``InvalidInput`` for a
    ``bucket_bytes`` that is not an int >= 1. Collective."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise InvalidInput(f"load_hf: bucket_bytes={bucket_bytes!r} must be an int >= 1")
    from underlay.engines.fsdp2.weightmap import match_file_layout

    path = Path(path)
    where = gather_headers(path)  # collective; raises on every rank for a bad file on any
    # fused experts stored either as on the hub or as in memory (Qwen3-VL-MoE): read what the files hold
    wmap = match_file_layout(engine.weight_map, {name: entry.shape for name, entry in where.items()})
    error: BaseException | None = None
    plan: LoadPlan | None = None
    try:
        plan = plan_load(wmap, where, path, strict)
    except CheckpointError as exc:
        error = exc
    # every rank checked the same entries: all go on, or all raise (no rank left in a collective)
    agree(error is None, str(error), what=f"load_hf({path})", error_type=CheckpointError, cause=error)
    assert plan is not None
    rounds = schedule(wmap, plan, _world_size(), bucket_bytes)
    loaded, nbytes = 0, 0
    try:
        for n, b in load_rounds(engine, plan, rounds, path):
            loaded, nbytes = loaded + n, nbytes + b
    except Exception as exc:
        error = exc
    agree(error is None, describe(error), what=f"load_hf({path})", error_type=CheckpointError, cause=error)
    return LoadReport(loaded=loaded, missing=plan.missing, unexpected=plan.unexpected, bytes_read=nbytes)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class FSDP2WeightLoader:
    """Loads safetensors into FSDP2 shards (reads split across ranks) and exports full HF checkpoints
    from rank 0 (written while gathering), driven by the engine's ``weight_map`` through the
    ``ParallelEngine`` protocol.

    ``load_bucket_bytes``: the bytes broadcast per loading round (loading's extra host memory is about
    twice that, see ``load_hf_into``). ``export_buffer_bytes``: gathered tensors rank 0 may hold while its writer
    thread catches up (``0``: rank 0 writes each tensor before gathering the next). Memory: export
    holds one full engine parameter on every rank, and on rank 0 up to ``export_buffer_bytes`` of
    converted tensors (a larger single tensor is admitted alone); never a whole shard.
    """

    def __init__(
        self,
        device: Device | None = None,
        *,
        load_bucket_bytes: int = DEFAULT_LOAD_BUCKET_BYTES,
        export_buffer_bytes: int = DEFAULT_EXPORT_BUFFER_BYTES,
    ) -> None:
        if (
            isinstance(load_bucket_bytes, bool)
            or not isinstance(load_bucket_bytes, int)
            or load_bucket_bytes < 1
        ):
            raise InvalidInput(
                f"FSDP2WeightLoader: load_bucket_bytes={load_bucket_bytes!r} must be an int >= 1"
            )
        if (
            isinstance(export_buffer_bytes, bool)
            or not isinstance(export_buffer_bytes, int)
            or export_buffer_bytes < 0
        ):
            raise InvalidInput(
                f"FSDP2WeightLoader: export_buffer_bytes={export_buffer_bytes!r} must be an int >= 0"
            )
        self._device = device
        self._load_bucket_bytes = load_bucket_bytes
        self._export_buffer_bytes = export_buffer_bytes

    @property
    def name(self) -> str:
        """``"fsdp2"``."""
        return "fsdp2"

    def load_hf(self, engine: ParallelEngine, path: str | Path, *, strict: bool = True) -> LoadReport:
        """Load every HF tensor of ``path`` that ``engine.weight_map`` names into ``engine``'s shards
        (LoRA adapters are not part of HF files and are left alone); see ``load_hf_into``."""
        return load_hf_into(engine, path, strict=strict, bucket_bytes=self._load_bucket_bytes)

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
        and the tokenizer and processor files (``models.PROCESSOR_FILES``) of the source directory when it
        had them. Tensors are gathered one at a time in ``dtype`` (default: the engine's ``param_dtype``)
        and written by a writer thread while the next ones are gathered (``export_buffer_bytes``); LoRA
        models export merged weights. The export is built in a fresh sibling directory and swapped in
        whole (fsynced): ``out_dir`` holds the complete new export or what it held before. Collective;
        returns ``out_dir`` on rank 0, ``None`` elsewhere; ``CheckpointError`` on every rank when rank 0
        fails."""
        from underlay.engines._core import export_hf_atomic

        return export_hf_atomic(
            engine,
            out_dir,
            self.iter_hf_tensors(engine),
            lambda tmp: self._write_config(engine, tmp),
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            buffer_bytes=self._export_buffer_bytes,
        )

    def export_adapters(self, engine: ParallelEngine, out_dir: str | Path) -> Path | None:
        """Rank 0 writes the LoRA adapters alone in peft's format (``adapter_model.safetensors`` +
        ``adapter_config.json``; loadable by ``PeftModel.from_pretrained`` on the base model).
        ``InvalidInput`` when the engine has no LoRA. Collective; ``out_dir`` on rank 0, else ``None``."""
        from safetensors.torch import save_file

        eng = engine
        peft_config = getattr(eng.model, "peft_config", None)
        if not peft_config:
            raise InvalidInput("export_adapters: the engine has no LoRA adapters (ModelConfig.lora is None)")
        out = as_path(out_dir, "export_adapters: out_dir")
        tensors = {n: t.cpu().contiguous() for n, t in eng.named_adapter_tensors()}
        error: BaseException | None = None
        if current_rank() == 0:
            try:
                with atomic_directory(out, replaceable=export_owned) as tmp:
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
