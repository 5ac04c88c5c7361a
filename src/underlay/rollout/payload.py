"""What a weight sync sends: full (LoRA-merged) weights, LoRA adapters alone, optionally FP8.

``WeightPayload`` describes it; ``payload_buckets`` turns any ``ParallelEngine`` into the bucket stream
the transport sends (``engine.iter_weights`` for full weights, so every engine works unchanged), and
``payload_header`` is the JSON description the receiver's sink gets in ``begin``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from underlay.interfaces import ConfigError, Fp8Quantizer, InvalidInput, ParallelEngine

__all__ = [
    "AdapterSource",
    "WeightPayload",
    "adapter_config",
    "default_fp8_filter",
    "payload_buckets",
    "payload_header",
    "scale_name",
]

Bucket = list[tuple[str, torch.Tensor]]


@runtime_checkable
class AdapterSource(Protocol):
    """An engine that can stream its LoRA adapters alone (the fsdp2 engine does)."""

    def named_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full adapter tensors with peft's saved names (``base_model.model.<module>.lora_A.weight``),
        one at a time; empty without LoRA. Collective: every rank iterates."""


def default_fp8_filter(name: str, tensor: torch.Tensor) -> bool:
    """Which weights FP8 rollout engines keep in FP8: 2-D linear weights (``*.weight``) of the decoder,
    not embeddings, the output head, norms or a value head."""
    if tensor.dim() != 2 or not tensor.is_floating_point() or not name.endswith(".weight"):
        return False
    return not any(part in name for part in ("embed", "lm_head", "norm", "score", "wte", "wpe"))


def scale_name(weight_name: str) -> str:
    """Name of the block scales of an FP8 weight as FP8 checkpoints and rollout engines expect them:
    ``...q_proj.weight`` -> ``...q_proj.weight_scale_inv`` (``dequantized = fp8 * weight_scale_inv``)."""
    return weight_name + "_scale_inv"


@dataclass(frozen=True)
class WeightPayload:
    """What to send.

    ``kind``: ``"full"`` (every weight in Hugging Face names; LoRA models send the merged weights) or
    ``"lora"`` (the adapters alone, peft's saved names, with the adapter config in the header).
    ``fp8_block``: ``None`` for the engine's ``param_dtype``, or a ``(bm, bk)`` tile: weights selected by
    ``fp8_filter`` travel as ``float8_e4m3fn`` plus float32 ``<name>_scale_inv`` block scales from the
    registered ``Fp8Quantizer`` (``full`` only). Raises ``ConfigError`` for a bad combination.
    """

    kind: Literal["full", "lora"] = "full"
    fp8_block: tuple[int, int] | None = None
    fp8_filter: Callable[[str, torch.Tensor], bool] = default_fp8_filter

    def __post_init__(self) -> None:
        if self.kind not in ("full", "lora"):
            raise ConfigError(f"WeightPayload.kind={self.kind!r}: use 'full' or 'lora'")
        if self.fp8_block is not None:
            if self.kind != "full":
                raise ConfigError(
                    "WeightPayload: fp8_block applies to kind='full' only (adapters stay exact)"
                )
            b = self.fp8_block
            if len(b) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in b):
                raise ConfigError(f"WeightPayload.fp8_block={b!r}: use two positive ints, e.g. (128, 128)")


def adapter_config(engine: ParallelEngine) -> dict[str, Any]:
    """peft's ``adapter_config.json`` for the engine's LoRA (what ``PeftModel.from_pretrained`` and
    vLLM's LoRA loader read). Raises ``InvalidInput`` when the engine has no LoRA."""
    lora = engine.config.model.lora
    if lora is None:
        raise InvalidInput("WeightPayload('lora'): the engine has no LoRA (ModelConfig.lora is None)")
    return {
        "peft_type": "LORA",
        "task_type": None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        # a str (``"all-linear"``, a regex) is peft's own value; never its sorted characters
        "target_modules": lora.target_modules
        if isinstance(lora.target_modules, str)
        else sorted(lora.target_modules),
        "exclude_modules": (
            lora.exclude_modules if isinstance(lora.exclude_modules, str) else sorted(lora.exclude_modules)
        )
        or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": engine.config.model.path,
    }


def payload_header(engine: ParallelEngine, payload: WeightPayload) -> dict[str, Any]:
    """JSON-able description of the sync for the receiver's sink (see ``WeightSink.begin``)."""
    header: dict[str, Any] = {
        "payload": payload.kind,
        "engine": engine.name,
        "fp8": None if payload.fp8_block is None else {"block": list(payload.fp8_block)},
    }
    if payload.kind == "lora":
        header["adapter_config"] = adapter_config(engine)
    return header


def _engine_buckets(engine: ParallelEngine, bucket_bytes: int) -> Iterator[Bucket]:
    """The engine's full-weight buckets (the one place that calls ``iter_weights``)."""
    return engine.iter_weights(bucket_bytes)


def _adapter_buckets(engine: ParallelEngine, bucket_bytes: int) -> Iterator[Bucket]:
    if not isinstance(engine, AdapterSource):
        raise InvalidInput(
            f"WeightPayload('lora'): engine {engine.name!r} cannot stream adapters alone (no "
            "named_adapter_tensors); send WeightPayload('full') for merged weights"
        )
    adapter_config(engine)
    bucket: Bucket = []
    size = 0
    for name, t in engine.named_adapter_tensors():
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def _fp8(bucket: Bucket, quantizer: Fp8Quantizer, payload: WeightPayload) -> Bucket:
    assert payload.fp8_block is not None
    out: Bucket = []
    for name, t in bucket:
        if payload.fp8_filter(name, t):
            q, scales = quantizer.quantize(t, payload.fp8_block)
            out.append((name, q))
            out.append((scale_name(name), scales))
        else:
            out.append((name, t))
    return out


def payload_buckets(
    engine: ParallelEngine,
    payload: WeightPayload,
    bucket_bytes: int,
    quantizer: Fp8Quantizer | None = None,
) -> Iterator[Bucket]:
    """The buckets of one sync (collective: every trainer rank iterates it, as ``iter_weights`` needs).
    FP8 uses ``quantizer`` (default: ``underlay.get_quantizer()``). Raises ``InvalidInput`` for a LoRA
    payload from an engine without adapters and for ``bucket_bytes < 1``."""
    if bucket_bytes < 1:
        raise InvalidInput(f"bucket_bytes={bucket_bytes} must be >= 1")
    if payload.kind == "lora":
        yield from _adapter_buckets(engine, bucket_bytes)
        return
    if payload.fp8_block is None:
        yield from _engine_buckets(engine, bucket_bytes)
        return
    if quantizer is None:
        from underlay.registry import get_quantizer

        quantizer = get_quantizer()
    for bucket in _engine_buckets(engine, bucket_bytes):
        yield _fp8(bucket, quantizer, payload)
