"""LoRA on the mcore engine (``engines.mcore.lora``) under the CPU fixture, against peft on the float64
Hugging Face model: outputs, loss, every adapter gradient and the grad norm at TP=2 with sequence
parallelism (policy and value model), PP=2 and EP=2 x DP=2 (MoE, experts frozen); base weights frozen;
``disable_adapter`` gives the base model; exported adapters reload in peft and merged weights in
transformers; a checkpoint saved at TP=2 resumes at PP=2; and mcore equals the fsdp2 engine from the
same seeded adapters. Refusals name the module or option."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests._dist import run_distributed
from tests.mcore import _lora_workers as W
from tests.mcore._helpers import tiny_config
from underlay.interfaces import (
    BackendUnavailable,
    ConfigError,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
)

pytestmark = [pytest.mark.mcore, pytest.mark.distributed, pytest.mark.slow]

OUT_TOL = 1e-5
GRAD_TOL = 1e-4


def test_lora_layouts_equal_peft_and_fsdp2(tmp_path: Path) -> None:
    adapters = {
        "llama": W.write_adapter(str(tmp_path), "llama", "causal_lm", W.DENSE, 1),
        "llama_value": W.write_adapter(str(tmp_path), "llama", "value", (*W.DENSE, "score"), 2),
        "qwen3_moe": W.write_adapter(str(tmp_path), "qwen3_moe", "causal_lm", W.ATTENTION, 3),
    }
    results = run_distributed(W.lora_layouts, 2, str(tmp_path), adapters, timeout_s=400)
    for r in results:
        for case, n in (("tp", 56), ("tp_value", 58), ("pp", 56), ("moe", 32)):
            c = r[case]
            assert c["out"] < OUT_TOL, (case, c)
            assert c["off"] < OUT_TOL, (case, c)
            assert c["on_vs_off"] > 1e-3, (case, c)
            assert c["refused"] == 1.0, (case, c)
            assert c["loss"] < OUT_TOL, (case, c)
            assert c["grad_rel"] < GRAD_TOL, (case, c)
            assert c["n_grads"] == n, (case, c)  # A and B of every adapted module (4 layers)
            assert c["norm_rel"] < GRAD_TOL, (case, c)
            assert c["frozen"] == 1.0, (case, c)
            assert c["moved"] > 0.0, (case, c)
        # the checkpoint of TP=2 + SP resumed at PP=2 continues as the uninterrupted run
        a, b = r["tp_continue"], r["pp_continue"]
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["norm"] - b["norm"]) < 1e-5, (a, b)
        assert a["adapters"].keys() == b["adapters"].keys()
        assert max(float((a["adapters"][n] - b["adapters"][n]).abs().max()) for n in a["adapters"]) < 1e-6
        f = r["vs_fsdp2"]
        assert f["names"] == 1.0 and f["start"] == 0.0, f
        assert f["loss"] < 1e-6 and f["norm"] < 1e-5 and f["params"] < 1e-6 and f["merged"] < 1e-5, f
    assert results[0]["export_peft"] < OUT_TOL, results[0]
    assert results[0]["export_merged"] < OUT_TOL, results[0]


def _build(hf: object, lora: LoraConfig, **kw: object) -> None:
    from underlay.engines.mcore.engine import MCoreEngine
    from underlay.registry import get_device

    par = ParallelConfig(**kw.pop("parallel", {}))  # type: ignore[arg-type]
    model = ModelConfig(hf_config=hf, lora=lora, **kw)  # type: ignore[arg-type]
    MCoreEngine(EngineConfig(model=model, parallel=par), get_device("cpu"))


def test_lora_refusals_name_the_module_or_option() -> None:
    """Before any process state: modules mcore cannot adapt (experts, routers), a kept LoRA dropout,
    and with pp > 1 decoder layers without adapters."""
    moe = tiny_config("qwen3_moe")
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.experts.*cannot adapt"):
        _build(moe, LoraConfig(rank=4, target_modules="all-linear"))
    # peft's "all-linear" adapts MoE experts and routers as target parameters, which exclude_modules
    # does not reach: naming the modules (as the message says) is accepted (the build then stops at
    # the CPU device)
    with pytest.raises(BackendUnavailable, match="megatron-core calls CUDA directly"):
        _build(moe, LoraConfig(rank=4, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")))
    with pytest.raises(ConfigError, match="dropout=0.1 with training_randomness='keep'"):
        _build(tiny_config("llama"), LoraConfig(dropout=0.1), training_randomness="keep")
    with pytest.raises(ConfigError, match=r"pp=2: decoder layers \[1, 2, 3\] have no adapter"):
        _build(
            tiny_config("llama"),
            LoraConfig(target_modules=r"model\.layers\.0\.self_attn\.q_proj"),
            parallel={"pp": 2},
        )
