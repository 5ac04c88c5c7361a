"""``ModelConfig(path=..., overrides=...)``: the overridden config is built, the checkpoint's weights
load into it unchanged, its outputs equal transformers' model with the same overrides (float64), the
export carries the overrides, and every bad override is refused before anything is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H
from underlay.interfaces import ConfigError, ModelConfig

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 8,
    "rope_theta": 10000.0,
}
OVERRIDES = {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}


def _save_checkpoint(root: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(H.llama_config(), dtype=torch.float32)
    with torch.no_grad():  # every parameter off its init value
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(str(root / "ckpt"))
    return root / "ckpt"


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    from dataclasses import replace

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from underlay import registry

    ckpt = _save_checkpoint(Path(root))
    cfg = H.engine_config(H.llama_config())
    batch = H.global_batch(5)
    out: dict[str, Any] = {}
    for name, over in (("plain", None), ("over", OVERRIDES)):
        model_cfg = ModelConfig(path=str(ckpt), overrides=over)
        engine = registry.get_engine(replace(cfg, model=model_cfg))
        got = engine.infer(batch).log_probs
        assert got is not None
        # transformers' own model with the same overrides and the checkpoint's weights
        ref_model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64, **(over or {}))
        ref_model.set_attn_implementation("eager")
        ref = H.reference_outputs(ref_model, batch).log_probs
        assert ref is not None
        out[f"{name}_err"] = float((got.double() - ref).abs().max())
        out[f"{name}_logp"] = got.double()
        out[f"{name}_rope"] = engine.hf_config.rope_parameters
        out[f"{name}_maxpos"] = engine.hf_config.max_position_embeddings
        files = load_file(str(ckpt / "model.safetensors"))
        loaded = dict(registry.get_weight_loader("fsdp2").iter_hf_tensors(engine))
        out[f"{name}_weights_equal"] = all(
            torch.equal(loaded[k].to(files[k].dtype).cpu(), files[k]) for k in files
        )
        registry.get_weight_loader("fsdp2").export_hf(engine, Path(root) / f"export_{name}")
    return out


def test_overrides_build_load_and_export(tmp_path: Path) -> None:
    r = run_distributed(_job, 1, str(tmp_path))[0]
    assert r["plain_err"] < 1e-5 and r["over_err"] < 1e-5, (r["plain_err"], r["over_err"])
    assert r["plain_weights_equal"] and r["over_weights_equal"]
    # the override changes the numbers (so the comparison above can fail) and is what was built
    assert float((r["over_logp"] - r["plain_logp"]).abs().max()) > 1e-3
    assert r["over_rope"]["rope_type"] == "llama3" and r["over_maxpos"] == 256
    assert r["plain_rope"]["rope_type"] == "default"
    exported = json.loads((tmp_path / "export_over" / "config.json").read_text())
    assert exported["rope_parameters"]["rope_type"] == "llama3" and exported["max_position_embeddings"] == 256
    assert exported["rms_norm_eps"] == 1e-5
    plain = json.loads((tmp_path / "export_plain" / "config.json").read_text())
    assert plain["rope_parameters"]["rope_type"] == "default"


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"hidden_sise": 64}, "has no such field"),
        ({"hidden_size": 64}, "changes parameter shapes"),
        ({"num_hidden_layers": 4}, "changes parameter shapes"),
        ({"max_position_embeddings": "long"}, "is a str"),
        ({"rms_norm_eps": True}, "is a bool"),
        ({"attn_implementation": "sdpa"}, "ModelConfig.attention"),
        ({"torch_dtype": "bfloat16"}, "EngineConfig.param_dtype"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "rejected by LlamaConfig"),
        ({"text_config.rope_scaling": {}}, "no sub-config 'text_config'"),
        ({"max_position_embeddings": object()}, "JSON-serialisable"),
        ({"bad key": 1}, "attribute name"),
    ],
)
def test_bad_overrides_are_refused_naming_the_key(tmp_path: Path, over: dict[str, Any], match: str) -> None:
    from underlay.engines.fsdp2._build import hf_config_of as fsdp2_config
    from underlay.engines.mcore._hf import hf_config_of as mcore_config

    ckpt = tmp_path / "c"
    ckpt.mkdir()
    H.llama_config().save_pretrained(str(ckpt))
    for build in (fsdp2_config, mcore_config):
        with pytest.raises(ConfigError, match=match):
            build(ModelConfig(path=str(ckpt), overrides=over))


def test_overrides_leave_the_callers_config_alone_and_allow_shapes_without_a_checkpoint() -> None:
    from underlay.engines.fsdp2._build import hf_config_of as fsdp2_config
    from underlay.engines.mcore._hf import hf_config_of as mcore_config

    base = H.llama_config()
    for build in (fsdp2_config, mcore_config):
        cfg = build(
            ModelConfig(hf_config=base, overrides={"num_hidden_layers": 3, "rope_scaling": LLAMA3_ROPE})
        )
        assert cfg.num_hidden_layers == 3 and cfg.rope_parameters["rope_type"] == "llama3"
        assert base.num_hidden_layers == 2 and base.rope_parameters["rope_type"] == "default"
    with pytest.raises(ConfigError, match="mapping"):
        ModelConfig(hf_config=base, overrides=[("num_hidden_layers", 3)])  # type: ignore[arg-type]
