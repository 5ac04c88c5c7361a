"""``FSDP2WeightLoader``: Hugging Face safetensors <-> FSDP2 shards.

Loading splits the file reads across ranks and broadcasts the bytes (``underlay.engines._hf_load``);
export streams the gathered tensors to a writer thread on rank 0 (``underlay.engines._hf_export``)."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from underlay.engines._buckets import check_byte_count
from underlay.engines._hf_export import DEFAULT_EXPORT_BUFFER_BYTES, TOKENIZER_FILES
from underlay.engines._hf_load import DEFAULT_LOAD_BUCKET_BYTES, load_hf_files
from underlay.interfaces import Device, InvalidInput, LoadReport, ParallelEngine

__all__ = ["TOKENIZER_FILES", "FSDP2WeightLoader", "load_hf_into"]


def load_hf_into(
    engine: ParallelEngine,
    path: str | Path,
    *,
    strict: bool = True,
    bucket_bytes: int = DEFAULT_LOAD_BUCKET_BYTES,
) -> LoadReport:
    """``FSDP2WeightLoader.load_hf`` as a function (the engine calls it while it materialises): the
    shared reader ``engines._hf_load.load_hf_files`` (every name and shape checked before any parameter
    changes, reads split across ranks, rounds of about ``bucket_bytes``; its docstring is the
    contract), with rules switched to the expert layout the files hold (``match_file_layout``)."""
    from underlay.engines.fsdp2.weightmap import match_file_layout

    # fused experts stored either as on the hub or as in memory (Qwen3-VL-MoE): read what the files hold
    return load_hf_files(
        engine, path, strict=strict, bucket_bytes=bucket_bytes, file_layout=match_file_layout
    )


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
        self._device = device
        self._load_bucket_bytes = check_byte_count(load_bucket_bytes, "FSDP2WeightLoader: load_bucket_bytes")
        self._export_buffer_bytes = check_byte_count(
            export_buffer_bytes, "FSDP2WeightLoader: export_buffer_bytes", minimum=0
        )

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
        from underlay.engines._lora import export_adapter_dir

        peft_config = getattr(engine.model, "peft_config", None)
        if not peft_config:
            raise InvalidInput("export_adapters: the engine has no LoRA adapters (ModelConfig.lora is None)")
        return export_adapter_dir(engine, out_dir, peft_config["default"])

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
