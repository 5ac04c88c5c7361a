"""fsdp2's weight map through transformers' own conversion mapping (``engines._hf_conversion``): for
the MoE / renamed-tensor model types whose ``save_pretrained`` layout differs from their modules, the
map names exactly the file's tensors, ``to_hf`` writes them bit-for-bit and ``from_hf`` rebuilds every
module tensor bit-for-bit; a layout that fuses several parameters into one file tensor, and a config
transformers' ``AutoModelForCausalLM`` cannot build, are refused by name. (The whole engine path of
these rows -- load, infer, export, checkpoint, value -- is tests/distributed/test_engine_matrix.py's.)"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from underlay.interfaces import ConfigError, ModelConfig

ROWS = [
    "afmoe",  # per-expert experts.{e}.gate_proj/up_proj/down_proj (MergeModulelist + Concatenate)
    "ernie4_5_moe",  # + routing bias renamed (mlp.moe_statics.e_score_correction_bias)
    "flint",  # + attention sinks renamed (softmax_offset)
    "hy_v3",  # + router, shared experts and expert bias renamed
    "kolibri1",  # + layer norms and router bias renamed
    "ergo",  # every tensor renamed (tok_embeddings, layers.*, attention.wqkv ...), transposed router
    "mixtral",  # block_sparse_moe.experts.{e}.w1/w3/w2 (the per-model table this replaced)
    "deepseek_v3",  # per-expert tensors and the routing-bias buffer
    "granitemoe",  # fused experts renamed (input_linear / output_linear), router renamed
]


def _tiny(model_type: str) -> torch.nn.Module:
    from tests.unit.models._matrix import tiny_model

    return tiny_model(model_type).float()


def _map(model: torch.nn.Module) -> object:
    from underlay.engines.fsdp2.weightmap import fsdp2_weight_map, persistent_buffers

    named = [*model.named_parameters(remove_duplicate=False), *persistent_buffers(model)]
    return fsdp2_weight_map(named, model.config, "causal_lm", model)


def _saved(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(path))
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("model_type", ROWS)
def test_map_reads_and_writes_the_save_pretrained_layout(model_type: str, tmp_path: Path) -> None:
    from underlay.engines._hf_conversion import CONVERTED
    from underlay.engines.fsdp2.weightmap import persistent_buffers

    model = _tiny(model_type)
    file = _saved(model, tmp_path)
    wmap = _map(model)
    tensors = {**dict(persistent_buffers(model)), **dict(model.named_parameters())}
    names = {n for r in wmap.rules for n in r.hf_names}  # type: ignore[attr-defined]
    assert names | set(wmap.tied) >= set(file) and names <= set(file), (  # type: ignore[attr-defined]
        sorted(names ^ set(file))[:5]
    )
    changed = [r for r in wmap.rules if r.kind == CONVERTED or r.hf_names != (r.engine_name,)]  # type: ignore[attr-defined]
    assert changed, "no tensor converted or renamed: the row tests nothing"
    for rule in wmap.rules:  # type: ignore[attr-defined]
        full = tensors[rule.engine_name].detach()
        written = rule.to_hf(full)
        assert list(written) == list(rule.hf_names)
        for n, t in written.items():
            assert torch.equal(t, file[n]), f"{model_type}: to_hf({rule.engine_name})[{n}] != the file's"
        back = rule.from_hf({n: file[n] for n in rule.hf_names})
        assert back.shape == full.shape and torch.equal(back, full), (
            f"{model_type}: from_hf(file) != module tensor {rule.engine_name}"
        )


def test_fused_file_tensor_of_several_parameters_is_refused() -> None:
    """sarvam_moe keeps ``query_key_value`` fused on disk (three parameters in memory): refused by name."""
    with pytest.raises(ConfigError, match="builds one file tensor from several in-memory tensors"):
        _map(_tiny("sarvam_moe"))


def test_config_auto_model_cannot_build_is_refused_by_name() -> None:
    """emu3's ``save_pretrained`` writes an ``Emu3TextConfig``: no AutoModelForCausalLM class."""
    from underlay.engines.fsdp2._build import build_model

    config = _tiny("emu3").config
    assert type(config).__name__ == "Emu3TextConfig"
    with pytest.raises(ConfigError, match="is no AutoModelForCausalLM config"):
        build_model(ModelConfig(hf_config=config), config, meta=True)


def test_model_shape_takes_per_layer_mlp_widths() -> None:
    """Gemma 3n's ``intermediate_size`` is one width per layer: the memory shape takes the widest."""
    from transformers import AutoModelForCausalLM

    from underlay.engines.fsdp2._auto import model_shape
    from underlay.models.coverage import tiny_config

    config = tiny_config("gemma3n_text")
    config.intermediate_size = [48, 64]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    assert model_shape(model, config).ffn == 64


def test_checkpoint_missing_an_expert_is_refused_before_any_change(tmp_path: Path) -> None:
    """The load plan of a per-expert checkpoint lacking one expert's tensor (or holding a tensor the
    model has not) raises ``CheckpointError`` naming it, before any parameter is read (issue 33)."""
    from safetensors.torch import save_file

    from underlay.engines._hf_load import gather_headers, plan_load
    from underlay.interfaces import CheckpointError

    model = _tiny("afmoe")
    file = _saved(model, tmp_path / "full")
    wmap = _map(model)
    plan = plan_load(wmap, gather_headers(tmp_path / "full"), tmp_path / "full", True)  # type: ignore[arg-type]
    assert not plan.missing and not plan.unexpected
    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert gone in file
    for label, tensors, named in (
        ("missing", {n: t for n, t in file.items() if n != gone}, gone),
        (
            "unexpected",
            {**file, "model.layers.1.mlp.experts.9.up_proj.weight": file[gone].clone()},
            "experts.9",
        ),
    ):
        (tmp_path / label).mkdir()
        save_file(tensors, str(tmp_path / label / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=f"{label} .*{named}"):
            plan_load(wmap, gather_headers(tmp_path / label), tmp_path / label, True)  # type: ignore[arg-type]
