"""Training FLOPs and model FLOPs utilisation (MFU) from a Hugging Face model config.

Convention (so figures compare with published RL-training MFU): one forward+backward over a token costs
``6 * N`` FLOPs, where ``N`` counts every *weight matrix* the token passes through: input embedding,
all attention and MLP projections (for MoE: the router, the ``top_k`` routed experts and the shared
experts) and the output head. A tied head still runs its matmul, so it is counted next to the
embedding. Biases and norms are not counted. The vision tower of Qwen-VL models
(qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe) is counted when ``estimate_flops`` is given the image/video grids: per
patch, the patch embedding and every block's q/k/v/out and MLP matrices; per merged token, the patch
merger (and Qwen3-VL's deepstack mergers); bidirectional attention over each image's patches
(``12 * hidden`` per patch pair per block; Qwen2.5-VL's window blocks only within each window). Attention adds the causal
score/value term: ``6 * heads * head_dim * s**2`` per layer and sequence of length ``s`` (i.e.
``12 * heads * head_dim`` per visible query-key pair, ``s**2 / 2`` pairs under a causal mask); a
sliding-window layer with window ``w < s`` has ``w**2 / 2 + (s - w) * w`` pairs. MLA (deepseek_v3) uses
``qk_nope + qk_rope`` for scores and ``v_head_dim`` for values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from underlay.interfaces import ConfigError, Device, InvalidInput, TokenBatch

__all__ = ["SUPPORTED_MODEL_TYPES", "FlopsCounter"]

_DENSE = (
    "llama",
    "qwen2",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3",
    "qwen3_vl",
    "mistral",
    "gemma2",
    "phi3",
    "glm4",
)
_VL_TEXT = {
    "qwen2_vl_text": "qwen2_vl",
    "qwen2_5_vl_text": "qwen2_5_vl",
    "qwen3_vl_text": "qwen3_vl",
    "qwen3_vl_moe_text": "qwen3_vl_moe",
}
_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
_QWEN_MOE = ("qwen2_moe", "qwen3_moe", "qwen3_vl_moe")
"""Qwen MoE decoders (Qwen3-VL-MoE's text model is a Qwen3-MoE decoder)."""
SUPPORTED_MODEL_TYPES = (
    *_DENSE,
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_vl_moe",
    "mixtral",
    "deepseek_v3",
    "gemma3_text",
    "gpt_oss",
)
_EVERY_LAYER_WINDOW = ("mistral", "mixtral", "phi3")
"""Model types whose ``sliding_window`` (when set) applies to every layer without ``layer_types``."""


class _Cfg:
    """Uniform attribute access over a ``PretrainedConfig`` or a plain dict."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def get(self, key: str, default: Any = None) -> Any:
        if isinstance(self.raw, Mapping):
            value = self.raw.get(key, default)
        else:
            value = getattr(self.raw, key, default)
        return default if value is None else value

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError(f"FlopsCounter: the config has no {key!r}; it is needed to count FLOPs")
        return value


@dataclass(frozen=True)
class _Layer:
    """Per-layer figures: matrix parameters a token passes through and the attention shape."""

    params: float
    heads: int
    qk_dim: int
    v_dim: int
    window: int | None


def _text_config(hf_config: Any) -> tuple[_Cfg, str]:
    cfg = _Cfg(hf_config)
    model_type = str(cfg.get("model_type", ""))
    text = cfg.get("text_config")
    if model_type in _VL and text is not None:
        cfg = _Cfg(text)
    return cfg, _VL_TEXT.get(model_type, model_type)


def _layer_windows(cfg: _Cfg, model_type: str, layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        if model_type == "gemma3_text":
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        elif model_type == "gpt_oss":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif model_type in _EVERY_LAYER_WINDOW and window:
            types = ["sliding_attention"] * layers
        else:
            types = ["full_attention"] * layers
    if len(types) != layers:
        raise ConfigError(f"FlopsCounter: layer_types has {len(types)} entries for {layers} layers")
    return [int(window) if t == "sliding_attention" and window else None for t in types]


def _mlp(h: int, inter: int) -> float:
    return 3.0 * h * inter  # gate, up, down


def _gqa_attention(cfg: _Cfg, h: int) -> tuple[float, int, int]:
    heads = int(cfg.need("num_attention_heads"))
    kv = int(cfg.get("num_key_value_heads", heads))
    d = int(cfg.get("head_dim", h // heads))
    return float(h * heads * d + 2 * h * kv * d + heads * d * h), heads, d


def _layers(cfg: _Cfg, model_type: str) -> list[_Layer]:
    h = int(cfg.need("hidden_size"))
    n = int(cfg.need("num_hidden_layers"))
    windows = _layer_windows(cfg, model_type, n)
    out: list[_Layer] = []
    if model_type == "deepseek_v3":
        heads = int(cfg.need("num_attention_heads"))
        nope, rope = int(cfg.need("qk_nope_head_dim")), int(cfg.need("qk_rope_head_dim"))
        v_dim, kv_rank = int(cfg.need("v_head_dim")), int(cfg.need("kv_lora_rank"))
        q_rank = cfg.get("q_lora_rank")
        q = h * heads * (nope + rope) if not q_rank else h * q_rank + q_rank * heads * (nope + rope)
        attn = q + h * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * h
        dense_k = int(cfg.get("first_k_dense_replace", 0))
        moe_i, experts = int(cfg.need("moe_intermediate_size")), int(cfg.need("n_routed_experts"))
        top_k, shared = int(cfg.need("num_experts_per_tok")), int(cfg.get("n_shared_experts", 0))
        for i in range(n):
            if i < dense_k:
                mlp = _mlp(h, int(cfg.need("intermediate_size")))
            else:
                mlp = h * experts + (top_k + shared) * _mlp(h, moe_i)
            out.append(_Layer(float(attn) + mlp, heads, nope + rope, v_dim, windows[i]))
        return out
    attn, heads, d = _gqa_attention(cfg, h)
    for i in range(n):
        if model_type in _QWEN_MOE:
            # Qwen3-VL-MoE's text config names it num_local_experts
            experts = int(cfg.get("num_experts") or cfg.need("num_local_experts"))
            step = int(cfg.get("decoder_sparse_step", 1))
            sparse = i not in list(cfg.get("mlp_only_layers", [])) and experts > 0 and (i + 1) % step == 0
            if sparse:
                top_k, moe_i = int(cfg.need("num_experts_per_tok")), int(cfg.need("moe_intermediate_size"))
                mlp = h * experts + top_k * _mlp(h, moe_i)
                shared_i = (
                    int(cfg.get("shared_expert_intermediate_size", 0)) if model_type == "qwen2_moe" else 0
                )
                if shared_i:
                    mlp += _mlp(h, shared_i) + h  # shared expert and its sigmoid gate
            else:
                mlp = _mlp(h, int(cfg.need("intermediate_size")))
        elif model_type == "mixtral":
            experts = int(cfg.need("num_local_experts"))
            top_k = int(cfg.need("num_experts_per_tok"))
            mlp = h * experts + top_k * _mlp(h, int(cfg.need("intermediate_size")))
        elif model_type == "gpt_oss":
            experts = int(cfg.get("num_local_experts", cfg.get("num_experts", 0)))
            if experts < 1:
                raise ConfigError("FlopsCounter: gpt_oss config has no num_local_experts")
            mlp = h * experts + int(cfg.need("num_experts_per_tok")) * _mlp(
                h, int(cfg.need("intermediate_size"))
            )
        else:
            mlp = _mlp(h, int(cfg.need("intermediate_size")))
        out.append(_Layer(attn + mlp, heads, d, d, windows[i]))
    return out


@dataclass(frozen=True)
class _Vision:
    """Figures of a Qwen-VL vision tower: matrix parameters per patch and per merged token, the width
    (attention costs ``12 * hidden`` per patch pair), the blocks and their attention windows."""

    per_patch: float
    per_merged: float
    hidden: int
    depth: int
    merge: int
    full_blocks: frozenset[int] | None  # None: every block attends over the whole image
    window: int  # merged units per window side (window blocks)


def _vision(hf_config: Any, model_type: str) -> _Vision | None:
    raw = _Cfg(hf_config).get("vision_config")
    if model_type not in _VL or raw is None:
        return None
    v = _Cfg(raw)
    d = int(v.get("hidden_size", v.get("embed_dim", 0)))
    if d < 1:
        raise ConfigError("FlopsCounter: the vision_config has no hidden_size")
    depth, m = int(v.need("depth")), int(v.get("spatial_merge_size", 2))
    patch, tp = int(v.need("patch_size")), int(v.get("temporal_patch_size", 2))
    inter = int(v.get("intermediate_size", 0)) or int(d * float(v.get("mlp_ratio", 4)))
    out = int(v.get("out_hidden_size", v.get("hidden_size", d)))
    gated = model_type == "qwen2_5_vl"  # Qwen2.5-VL's vision MLP has gate/up/down; the others fc1/fc2
    block = 4.0 * d * d + (3.0 if gated else 2.0) * d * inter
    patch_embed = float(int(v.get("in_channels", v.get("in_chans", 3))) * tp * patch * patch * d)
    dm = d * m * m
    mergers = (
        1 + len(list(v.get("deepstack_visual_indexes", []) or []))
        if model_type in ("qwen3_vl", "qwen3_vl_moe")
        else 1
    )
    full: frozenset[int] | None = None
    window = 0
    if model_type == "qwen2_5_vl":
        full = frozenset(int(i) for i in v.get("fullatt_block_indexes", []))
        window = max(1, int(v.get("window_size", 112)) // m // patch)
    return _Vision(patch_embed + depth * block, mergers * (dm * dm + dm * out), d, depth, m, full, window)


def _window_sums(n: int, w: int) -> int:
    """Sum of squared window sizes when ``n`` units are cut into windows of ``w`` (the last may be short)."""
    full, rest = divmod(n, w)
    return full * w * w + rest * rest


def _vision_flops(vision: _Vision, grids: torch.Tensor) -> float:
    total = 0.0
    m = vision.merge
    for t, h, w in grids.tolist():
        patches = float(t * h * w)
        total += 6.0 * (vision.per_patch * patches + vision.per_merged * patches / (m * m))
        full_pairs = float(t) * (h * w) ** 2
        window_pairs = full_pairs
        if vision.full_blocks is not None:  # window blocks: attention within each window of a frame
            rows, cols = _window_sums(h // m, vision.window), _window_sums(w // m, vision.window)
            window_pairs = float(t) * m**4 * rows * cols
        for block in range(vision.depth):
            full = vision.full_blocks is None or block in vision.full_blocks
            total += 12.0 * vision.hidden * (full_pairs if full else window_pairs)
    return total


class FlopsCounter:
    """FLOPs of one forward+backward pass of a decoder LM, by the convention in the module docstring.

    ``hf_config``: a ``transformers.PretrainedConfig`` or a dict with the same keys (VL configs: the
    ``text_config`` is used). Supported ``model_type``: see ``SUPPORTED_MODEL_TYPES``. Another model
    type raises ``ConfigError`` unless ``generic=True``, which counts it as a dense GQA decoder from
    the standard keys. A missing key raises ``ConfigError`` naming it.
    """

    def __init__(self, hf_config: Any, generic: bool = False) -> None:
        cfg, model_type = _text_config(hf_config)
        if model_type not in SUPPORTED_MODEL_TYPES:
            if not generic:
                raise ConfigError(
                    f"FlopsCounter: model_type {model_type!r} is not supported (supported: "
                    f"{', '.join(SUPPORTED_MODEL_TYPES)}); pass generic=True for a dense-decoder estimate"
                )
            model_type = "llama"
        self.model_type = model_type
        self._layers = _layers(cfg, model_type)
        h, vocab = int(cfg.need("hidden_size")), int(cfg.need("vocab_size"))
        self.embedding_params = float(vocab * h)
        self.head_params = float(vocab * h)
        self._hf_config = hf_config  # the vision figures are read when grids are given

    def vision_figures(self) -> _Vision | None:
        """The vision tower's figures (matrix parameters per patch and per merged token, width, blocks,
        windows), or ``None`` for a model without one. ``ConfigError`` when its config lacks a key."""
        return _vision(self._hf_config, self.model_type)

    @property
    def params_per_token(self) -> float:
        """``N``: weight-matrix parameters one token passes through (embedding and head included)."""
        return self.embedding_params + self.head_params + sum(layer.params for layer in self._layers)

    def estimate_flops(
        self, seqlens: Sequence[int] | torch.Tensor, vision_grids: torch.Tensor | None = None
    ) -> float:
        """Total FLOPs of one forward+backward over sequences of these lengths (tokens, each >= 0,
        image placeholder tokens included). ``vision_grids`` ``[N, 3]`` (t, h, w in patches: the
        ``image_grid_thw`` and ``video_grid_thw`` rows of the batch) adds the vision tower of a Qwen-VL
        model; ``InvalidInput`` when given for a model without one or not ``[N, 3]``."""
        lens = seqlens.tolist() if isinstance(seqlens, torch.Tensor) else list(seqlens)
        if any(int(s) < 0 for s in lens):
            raise InvalidInput(f"estimate_flops: sequence lengths must be >= 0, got {min(lens)}")
        tokens = float(sum(int(s) for s in lens))
        full_pairs = sum(float(s) * s / 2.0 for s in lens)
        attn = 0.0
        window_pairs: dict[int, float] = {}
        for layer in self._layers:
            if layer.window is None:
                pairs = full_pairs
            else:
                w = layer.window
                if w not in window_pairs:
                    window_pairs[w] = sum(
                        float(s) * s / 2.0 if s <= w else w * w / 2.0 + (float(s) - w) * w for s in lens
                    )
                pairs = window_pairs[w]
            attn += 6.0 * layer.heads * (layer.qk_dim + layer.v_dim) * pairs
        vision = 0.0
        if vision_grids is not None:
            figures = self.vision_figures()
            if figures is None:
                raise InvalidInput(
                    f"estimate_flops: vision_grids given but {self.model_type} has no vision tower"
                )
            if vision_grids.dim() != 2 or vision_grids.shape[-1] != 3:
                raise InvalidInput(
                    f"estimate_flops: vision_grids has shape {tuple(vision_grids.shape)}; expected [N, 3] (t, h, w)"
                )
            vision = _vision_flops(figures, vision_grids)
        return 6.0 * self.params_per_token * tokens + attn + vision

    def batch_flops(self, batch: TokenBatch) -> float:
        """``estimate_flops`` of a ``TokenBatch``: its rows' real tokens (``attention_mask``) and, for a
        vision-language batch, the grids of its images and videos (the vision tower). One host read."""
        seqlens = batch.attention_mask.sum(dim=1).cpu()
        grids = [m.grid_thw.cpu() for m in (batch.images, batch.videos) if m is not None]
        return self.estimate_flops(seqlens, torch.cat(grids) if grids else None)

    def achieved_tflops(
        self, seqlens: Sequence[int] | torch.Tensor, seconds: float, vision_grids: torch.Tensor | None = None
    ) -> float:
        """``estimate_flops(seqlens, vision_grids) / seconds / 1e12``; ``InvalidInput`` unless
        ``seconds > 0``."""
        if not seconds > 0:
            raise InvalidInput(f"achieved_tflops: seconds={seconds} must be > 0 (wall time of the step)")
        return self.estimate_flops(seqlens, vision_grids) / seconds / 1e12

    def mfu(
        self,
        seqlens: Sequence[int] | torch.Tensor,
        seconds: float,
        device: Device,
        dtype: torch.dtype = torch.bfloat16,
        vision_grids: torch.Tensor | None = None,
    ) -> float | None:
        """Achieved FLOP/s of one device divided by ``device.peak_flops(dtype)``.

        ``seqlens`` are the sequences this device processed in ``seconds`` (``vision_grids``: the grids
        of their images and videos, for a vision-language model, see ``estimate_flops``); ``dtype`` is
        the dtype the matmuls ran in (bf16 for mixed-precision training; fp32 for an fp32 CPU run).
        Returns ``None`` when the device's peak is unknown (report MFU as unavailable;
        ``UNDERLAY_PEAK_TFLOPS`` sets it).
        """
        peak = device.peak_flops(dtype)
        if peak is None or peak <= 0:
            return None
        return self.achieved_tflops(seqlens, seconds, vision_grids) * 1e12 / peak
