"""``MCoreWeightLoader``: Hugging Face safetensors <-> megatron-core shards through the weight map.

Loading is the shared reader of every engine (``engines._hf_load.load_hf_files``): names, shapes and
file headers are checked before any parameter changes, each rank reads about ``1/world`` of the bytes
and broadcasts them, and each engine parameter is written into this rank's TP/PP/EP shard by
``MCoreEngine.copy_full_parameter``. Export gathers each tensor over TP/EP, broadcasts it from its
pipeline stage, and rank 0 writes shards of at most ``max_shard_bytes`` (``engines._core.export_hf_atomic``).
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from underlay.engines._buckets import check_byte_count
from underlay.engines._hf_export import DEFAULT_EXPORT_BUFFER_BYTES, TOKENIZER_FILES
from underlay.engines._hf_load import DEFAULT_LOAD_BUCKET_BYTES, load_hf_files
from underlay.interfaces import Device, InvalidInput, LoadReport, ParallelEngine

__all__ = ["MCoreWeightLoader"]


def _engine(engine: ParallelEngine) -> Any:
    if getattr(engine, "name", None) != "mcore" or not hasattr(engine, "chunks"):
        raise InvalidInput(
            f"MCoreWeightLoader needs an mcore engine, got {getattr(engine, 'name', type(engine))!r}"
        )
    return engine


class MCoreWeightLoader:
    """HF safetensors <-> an mcore engine's TP/PP/EP shards (fused q/k/v per query group, fused
    gate/up, per-expert names on disk). ``load_bucket_bytes``: the bytes broadcast per loading round
    (``engines._hf_load.load_hf_files``)."""

    def __init__(
        self, device: Device | None = None, *, load_bucket_bytes: int = DEFAULT_LOAD_BUCKET_BYTES
    ) -> None:
        self._device = device
        self._load_bucket_bytes = check_byte_count(load_bucket_bytes, "MCoreWeightLoader: load_bucket_bytes")

    @property
    def name(self) -> str:
        """``"mcore"``."""
        return "mcore"

    def load_hf(self, engine: ParallelEngine, path: str | Path, *, strict: bool = True) -> LoadReport:
        """Load every HF tensor of ``path`` that the engine's weight map names into its shards through
        the shared reader (``engines._hf_load.load_hf_files``, whose docstring is the contract): every
        name, shape and file header is checked before any parameter changes; with ``strict`` missing
        (except optional) or unexpected names raise ``CheckpointError``, a shape mismatch always does.
        Per-expert MoE tensors (``experts.{e}.*``, as ``save_pretrained`` writes them) and buffers the
        map carries (a routing bias) load like parameters. A value model loads a
        ``*ForTokenClassification`` checkpoint (its ``score.*`` head included) or the backbone of a
        causal-LM checkpoint: a missing head is only reported in ``missing`` (those parameters keep
        their values) and ``lm_head.*`` is never unexpected. With bf16/fp16 parameters the optimizer's
        fp32 master copies follow at the next step. Collective."""
        return load_hf_files(_engine(engine), path, strict=strict, bucket_bytes=self._load_bucket_bytes)

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

        eng = _engine(engine)

        def write_config(out: Path) -> None:
            cfg = copy.deepcopy(eng.hf_config)  # the engine's config stays as built
            if dtype is not None:
                cfg.torch_dtype = dtype
            cfg.save_pretrained(str(out))
            src = eng.config.model.path
            if src is not None:
                for f in TOKENIZER_FILES:
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
        """Rank 0 writes the LoRA adapters alone in peft's format (``adapter_model.safetensors`` with
        peft's saved names + ``adapter_config.json``; ``PeftModel.from_pretrained`` loads it on the base
        model, ``LoraConfig.from_adapter`` on either engine). ``InvalidInput`` when the engine has no
        LoRA. Collective; ``out_dir`` on rank 0, else ``None``."""
        from underlay.engines._lora import export_adapter_dir

        peft_config = getattr(engine, "peft_config", None)
        if peft_config is None:
            raise InvalidInput("export_adapters: the engine has no LoRA adapters (ModelConfig.lora is None)")
        return export_adapter_dir(engine, out_dir, peft_config)
