"""Architectures beyond plain llama/qwen on the mcore engine, exact against transformers' float64
forward at TP=2 and at PP=2 (one process group per layout running every architecture): Llama 3 RoPE
scaling, sliding windows (mistral, qwen2), vocabularies padded for TP (padded rows get no
probability and never leave the engine), mixtral, qwen2_moe (shared expert behind a gate) and
glm4_moe (dense first layer, partial RoPE, sigmoid router with routing bias and groups), deepseek_v3
(multi-latent attention with glm4_moe's MoE); and the refusals that name what the engine cannot
build."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._dist import run_distributed
from tests.mcore import _model_archs as A
from underlay.interfaces import ConfigError

pytestmark = pytest.mark.mcore

LP_TOL = 5e-6  # fp32 engine against the float64 model: log-probs (seen: <= 7e-7)
GRAD_TOL = 1e-5  # relative to the largest gradient of each tensor (seen: <= 1.1e-6)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mcore_models")
    A.write_checkpoints(root)
    return root


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_architectures_equal_hf(checkpoints: Path, tp: int, pp: int) -> None:
    """Per architecture: log-probs and every gradient equal the float64 HF model's; after a training
    step moved the weights, ``load_hf`` of the checkpoint followed by ``iter_weights`` gives back
    exactly the checkpoint's tensors under exactly its names (padded vocabulary rows never appear)."""
    (res, _) = run_distributed(A.check_layout_all_archs, 2, tp, pp, str(checkpoints), timeout_s=300)
    assert set(res) == set(A.arch_configs())
    for name, r in res.items():
        assert "refused" not in r, (name, r)
        assert r["lp"] < LP_TOL, (name, r)
        assert r["grad_rel"] < GRAD_TOL, (name, r)
        assert r["grad_names"] == 1.0, (name, r)
        assert r["moved"] > 1e-4, (name, r)  # the step changed the weights, so the load is what restores them
        assert r["roundtrip"] == 0.0 and r["names"] == 1.0, (name, r)
    # vocabularies that tp=2 does not divide are padded to the next multiple, nothing else is
    padded = ("llama3", "qwen2_window", "mixtral", "glm4_moe", "deepseek_v3")
    expected = (
        {name: 132 if name in ("llama3", "qwen2_window") else 128 for name in padded} if tp == 2 else {}
    )
    for name, r in res.items():
        assert r["vocab_rows"] == expected.get(name, A.arch_configs()[name].vocab_size), (name, r)


def test_refusals_name_the_missing_piece() -> None:
    """What the engine cannot build exactly is refused by name, before any process group."""
    import transformers as tf

    from underlay.engines.mcore.config import arch_of

    common = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, vocab_size=64)
    cases = [
        (tf.DeepseekV3Config(**common, rope_interleave=False), "rope_interleave=False"),
        (
            tf.DeepseekV3Config(
                **common, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
            ),
            "yarn",
        ),
        (tf.Glm4MoeConfig(**common, n_group=2, topk_group=1, num_experts_per_tok=4), "2 best experts"),
        (tf.Glm4MoeConfig(**common, norm_topk_prob=False), "norm_topk_prob=False"),
        (
            tf.LlamaConfig(**common, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
            "yarn",
        ),
        (tf.Qwen2MoeConfig(**common, mlp_only_layers=[0]), "mlp_only_layers"),
    ]
    for cfg, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            arch_of(cfg)
