"""Settings of ``underlay demo`` and the tiny Hugging Face model configs it trains."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from underlay.interfaces import ConfigError

__all__ = ["MODEL_SIZES", "DemoConfig", "tiny_hf_config"]

MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "heads": 4, "kv_heads": 2},
    "small": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "heads": 8,
        "kv_heads": 4,
    },
}
"""Qwen3-shaped sizes (head_dim 16, untied embeddings)."""


def _kind(name: str, value: object, kind: type) -> None:
    """``ConfigError`` unless ``value`` is a ``kind`` (an int is a float too, a bool is neither; a
    float must be finite)."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        what = "a finite number" if kind is float else f"a {kind.__name__}"
        raise ConfigError(f"demo {name}={value!r}: must be {what}")


@dataclass(frozen=True)
class DemoConfig:
    """What one ``underlay demo`` run does.

        ``steps`` GRPO steps (>= 2: the last one is redone after a checkpoint reload to prove resume);
        each step samples ``responses_per_prompt`` responses (>= 2, so group advantages are defined) for
        ``prompts_per_step`` prompts split over ``world_size`` processes (must divide evenly), at most
        ``max_new_tokens`` tokens each at ``temperature``. ``profile_step`` is the step whose torch-profiler
        trace is written (``None``: step 1, or 0 with fewer than 3 steps). Outputs go under ``out_dir``;
    the task's dataset file (``dataset_rows`` rows of the echo task) is written to ``out_dir/data``.
    """

    steps: int = 24
    model_size: Literal["tiny", "small"] = "tiny"
    out_dir: str = "underlay_out"
    seed: int = 0
    world_size: int = 2
    prompts_per_step: int = 8
    responses_per_prompt: int = 8
    max_new_tokens: int = 2
    temperature: float = 1.0
    lr: float = 1e-2
    clip_eps: float = 0.2
    micro_batch_max_tokens: int = 256
    profile_step: int | None = None
    progress: bool = True
    dataset_rows: int = 512

    def __post_init__(self) -> None:
        for name in ("steps", "seed", "world_size", "prompts_per_step", "responses_per_prompt"):
            _kind(name, getattr(self, name), int)
        for name in ("max_new_tokens", "micro_batch_max_tokens", "dataset_rows"):
            _kind(name, getattr(self, name), int)
        for name in ("temperature", "lr", "clip_eps"):
            _kind(name, getattr(self, name), float)
        _kind("progress", self.progress, bool)
        _kind("out_dir", self.out_dir, str)
        _kind("model_size", self.model_size, str)
        if self.profile_step is not None:
            _kind("profile_step", self.profile_step, int)
        if not self.out_dir.strip():
            raise ConfigError("demo out_dir='': give a directory path")
        if self.steps < 2:
            raise ConfigError(
                f"demo --steps={self.steps}: need >= 2 (the last step is redone after a checkpoint reload)"
            )
        if self.model_size not in MODEL_SIZES:
            raise ConfigError(f"demo --model-size={self.model_size!r}: use one of {sorted(MODEL_SIZES)}")
        if self.world_size < 1:
            raise ConfigError(f"demo --world-size={self.world_size}: must be >= 1")
        if self.responses_per_prompt < 2:
            raise ConfigError(
                f"demo --responses-per-prompt={self.responses_per_prompt}: need >= 2 for group advantages"
            )
        if self.prompts_per_step < 1:
            raise ConfigError(f"demo --prompts-per-step={self.prompts_per_step}: must be >= 1")
        if self.dataset_rows < self.prompts_per_step:
            raise ConfigError(
                f"demo dataset_rows={self.dataset_rows}: need at least prompts_per_step={self.prompts_per_step}"
            )
        if self.max_new_tokens < 1:
            raise ConfigError(f"demo max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not self.temperature > 0:
            raise ConfigError(f"demo temperature={self.temperature}: must be > 0")
        if not 0 < self.clip_eps < 1:
            raise ConfigError(f"demo clip_eps={self.clip_eps}: must be in (0, 1)")
        if self.profile_step is not None and not 0 <= self.profile_step < self.steps:
            raise ConfigError(f"demo profile_step={self.profile_step}: must be in [0, steps={self.steps})")

    def check_world(self, world_size: int) -> None:
        """Raise ``ConfigError`` unless ``prompts_per_step`` splits evenly over ``world_size`` processes."""
        if self.prompts_per_step % world_size:
            raise ConfigError(
                f"demo --prompts-per-step={self.prompts_per_step} does not split over {world_size} "
                f"processes; use a multiple of {world_size}"
            )

    @property
    def trace_step(self) -> int:
        """The profiled step (see the class docstring)."""
        if self.profile_step is not None:
            return self.profile_step
        return 1 if self.steps >= 3 else 0

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (for the run record)."""
        return asdict(self)


def tiny_hf_config(size: str, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> Any:
    """A ``transformers.Qwen3Config`` (no weights: the engine initialises them randomly) of the
    ``MODEL_SIZES`` entry ``size``, with the tokenizer's vocabulary size and special ids and no dropout.
    Raises ``ConfigError`` for an unknown size."""
    from transformers import Qwen3Config

    if size not in MODEL_SIZES:
        raise ConfigError(f"model size {size!r}: use one of {sorted(MODEL_SIZES)}")
    s = MODEL_SIZES[size]
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_hidden_layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["hidden_size"] // s["heads"],
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
