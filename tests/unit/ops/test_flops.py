"""FLOPs counter against hand-computed totals for a tiny config of every supported family.

Each expected number is written out as its arithmetic: 6 * N * tokens + attention, with N summed by hand
from the matrix shapes (embedding and head both counted).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from underlay import registry
from underlay.interfaces import ConfigError, InvalidInput
from underlay.ops import FlopsCounter

# h=16, L=2, 4 heads of dim 4, 2 kv heads, I=24, V=100
_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 24,
    "vocab_size": 100,
}
# per layer: q 256 + k 128 + v 128 + o 256 + mlp 3*16*24=1152 = 1920; N = 2*1920 + 2*1600 = 7040
_LLAMA_35 = 6 * 7040 * 8 + 6 * 2 * 4 * 4 * (3**2 + 5**2)


def _qwen3() -> dict[str, Any]:
    return {**_LLAMA, "model_type": "qwen3", "head_dim": 8}


CASES: list[tuple[str, dict[str, Any], list[int], float]] = [
    ("llama", _LLAMA, [3, 5], _LLAMA_35),
    ("qwen2", {**_LLAMA, "model_type": "qwen2"}, [3, 5], _LLAMA_35),
    # head_dim 8 != 16/4: q 512 + k 256 + v 256 + o 512 + mlp 1152 = 2688; N = 5376 + 3200 = 8576
    ("qwen3", _qwen3(), [4], 6 * 8576 * 4 + 6 * 2 * 4 * 8 * 16),
    # window 2 on every layer, s=5: pairs 2**2/2 + 3*2 = 8 -> 12 * 4 * 4 * 8 per layer
    (
        "mistral",
        {**_LLAMA, "model_type": "mistral", "sliding_window": 2},
        [5],
        6 * 7040 * 5 + 2 * 12 * 4 * 4 * 8,
    ),
    (
        "qwen2_vl",
        {"model_type": "qwen2_vl", "text_config": _LLAMA, "vision_config": {"depth": 2}},
        [3, 5],
        _LLAMA_35,
    ),
    ("qwen2_5_vl", {"model_type": "qwen2_5_vl", "text_config": _LLAMA}, [3, 5], _LLAMA_35),
    # attn 4*256 = 1024; layer 0 sparse: router 96 + 2 experts 768 + shared 576 + gate 16 = 1456;
    # layer 1 (mlp_only) dense 3*16*40 = 1920; N = 2480 + 2944 + 3200 = 8624
    (
        "qwen2_moe",
        {
            "model_type": "qwen2_moe",
            "hidden_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 40,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 12,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
            "vocab_size": 100,
        },
        [6],
        6 * 8624 * 6 + 6 * 2 * 4 * 4 * 36,
    ),
    # attn 1536; layer 0 dense 1152 (sparse step 2); layer 1 router 64 + 2*3*16*8 = 832; N = 2688+2368+3200
    (
        "qwen3_moe",
        {
            **_qwen3(),
            "model_type": "qwen3_moe",
            "moe_intermediate_size": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 2,
        },
        [2, 2],
        6 * 8256 * 4 + 6 * 2 * 4 * 8 * 8,
    ),
    # MLA: q_a 16*8 + q_b 8*2*6 = 224, kv_a 16*8 = 128, kv_b 6*2*7 = 84, o 2*3*16 = 96 -> 532;
    # layer 0 dense 960; layers 1-2: router 64 + (2 routed + 1 shared) * 240 = 784; N = 1492 + 2*1316 + 1600
    # attention: 3 * L * heads * (qk 6 + v 3) * s**2
    (
        "deepseek_v3",
        {
            "model_type": "deepseek_v3",
            "hidden_size": 16,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "q_lora_rank": 8,
            "kv_lora_rank": 6,
            "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 2,
            "v_head_dim": 3,
            "intermediate_size": 20,
            "moe_intermediate_size": 5,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "vocab_size": 50,
        },
        [4],
        6 * 5724 * 4 + 3 * 3 * 2 * 9 * 16,
    ),
    # per layer 768 + 1152 = 1920, N = 5760 + 1920 = 7680; s=5: full layer pairs 12.5, window-3 layers
    # pairs 3**2/2 + 2*3 = 10.5; 12 * heads 2 * dim 8 per pair
    (
        "gemma3_text",
        {
            "model_type": "gemma3_text",
            "hidden_size": 16,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "intermediate_size": 24,
            "vocab_size": 60,
            "sliding_window": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
        [5],
        6 * 7680 * 5 + 12 * 2 * 8 * (12.5 + 2 * 10.5),
    ),
    # attn 768; mlp router 64 + 2 experts * 3*16*8 = 832; N = 2*1600 + 2*640 = 4480;
    # default layer types: layer 0 sliding (w=2, s=4: 2 + 2*2 = 6 pairs), layer 1 full (8 pairs)
    (
        "gpt_oss",
        {
            "model_type": "gpt_oss",
            "hidden_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 8,
            "vocab_size": 40,
            "sliding_window": 2,
        },
        [4],
        6 * 4480 * 4 + 12 * 4 * 4 * (6 + 8),
    ),
]


@pytest.mark.parametrize(("family", "config", "seqlens", "expected"), CASES, ids=[c[0] for c in CASES])
def test_hand_computed(family: str, config: dict[str, Any], seqlens: list[int], expected: float) -> None:
    counter = FlopsCounter(config)
    assert counter.estimate_flops(seqlens) == pytest.approx(expected, rel=1e-12)
    assert counter.estimate_flops(torch.tensor(seqlens)) == pytest.approx(expected, rel=1e-12)


def test_transformers_configs() -> None:
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(**{k: v for k, v in _LLAMA.items() if k != "model_type"})
    assert FlopsCounter(llama).estimate_flops([3, 5]) == pytest.approx(_LLAMA_35)
    text = {k: v for k, v in _LLAMA.items() if k != "model_type"}
    vl = transformers.Qwen2VLConfig(text_config=text)
    assert FlopsCounter(vl).estimate_flops([3, 5]) == pytest.approx(_LLAMA_35)


def test_unknown_and_missing() -> None:
    with pytest.raises(ConfigError, match="generic=True"):
        FlopsCounter({**_LLAMA, "model_type": "mystery"})
    generic = FlopsCounter({**_LLAMA, "model_type": "mystery"}, generic=True)
    assert generic.estimate_flops([3, 5]) == pytest.approx(_LLAMA_35)
    with pytest.raises(ConfigError, match="intermediate_size"):
        FlopsCounter({k: v for k, v in _LLAMA.items() if k != "intermediate_size"})
    with pytest.raises(InvalidInput, match=">= 0"):
        FlopsCounter(_LLAMA).estimate_flops([3, -1])


def test_tflops_and_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = FlopsCounter(_LLAMA)
    assert counter.achieved_tflops([3, 5], 2.0) == pytest.approx(_LLAMA_35 / 2.0 / 1e12)
    with pytest.raises(InvalidInput, match="seconds"):
        counter.achieved_tflops([3, 5], 0.0)
    monkeypatch.setenv("UNDERLAY_PEAK_TFLOPS", "2.5")
    device = registry.get_device("cpu")
    assert counter.mfu([3, 5], 1e-6, device) == pytest.approx(_LLAMA_35 / 1e-6 / 2.5e12)
