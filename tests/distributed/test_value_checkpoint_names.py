"""A value model (``ModelConfig(path, kind="value")``) never silently initialises a tensor that its
checkpoint holds under any name (issue 34, item 5).

From transformers' own ``save_pretrained`` of a token-classification model (dense qwen2; mixtral with
per-expert tensors; deepseek_v3 with its routing-bias buffer), one tensor is renamed at a time the way
checkpoints of other tools name them -- the head as ``lm_head`` (the name a value model ignores, since a
causal LM's vocabulary head is never a value head), ``classifier`` or ``v_head.summary``, a backbone
tensor, an expert tensor or the routing bias under another prefix -- and building the engine must
raise an ``underlay.errors`` exception that names the renamed tensor (under either name), never build with that tensor
seed-initialised (here through the fsdp2 engine; ``tests/mcore/test_mcore_matrix.py`` runs the same
cases through the mcore engine). The untouched checkpoint loads bit-for-bit (the architecture matrix,
``test_engine_matrix.py``, checks that per row)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

ARCHS = ("qwen2", "mixtral", "deepseek_v3")


def _renames(arch: str, names: list[str]) -> dict[str, tuple[str, str]]:
    """Per case: (the file's name, the name it is saved under instead). The head and backbone cases
    on the dense model; per MoE model, the tensors only it has."""
    if arch == "qwen2":
        return {
            "head as lm_head": ("score.weight", "lm_head.weight"),
            "head as classifier": ("score.weight", "classifier.weight"),
            "head as v_head": ("score.weight", "v_head.summary.weight"),
            "norm under another prefix": ("model.norm.weight", "transformer.norm.weight"),
        }
    part = {"mixtral": ".experts.", "deepseek_v3": "e_score_correction_bias"}[arch]
    hit = min(n for n in names if part in n)
    return {f"{part.strip('.')} renamed": (hit, hit.replace("model.layers.", "model.blocks.", 1))}


def renamed_tensor_outcomes(rank: int, world: int, root: str, engine_name: str) -> dict[str, dict[str, str]]:
    """Per architecture and case: ``""`` when building the ``engine_name`` engine's value model from
    the altered checkpoint raised an ``underlay.errors`` exception naming the renamed tensor, else what
    happened instead."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForTokenClassification

    from tests.distributed._engine_matrix import _engine
    from underlay.interfaces import ModelConfig, UnderlayError
    from underlay.models.coverage import tiny_config

    torch.set_num_threads(1)
    out: dict[str, dict[str, str]] = {}
    for arch in ARCHS:
        cfg = tiny_config(arch)
        cfg.num_labels = 1
        torch.manual_seed(0)
        src = Path(root) / arch
        AutoModelForTokenClassification.from_config(cfg).save_pretrained(str(src))
        tensors = load_file(str(src / "model.safetensors"))
        out[arch] = {}
        for case, (old, new) in _renames(arch, list(tensors)).items():
            assert old in tensors, (arch, case, old)
            d = Path(root) / f"{arch}-{case.replace(' ', '_')}"
            d.mkdir()
            (d / "config.json").write_text((src / "config.json").read_text())
            save_file({new if k == old else k: v for k, v in tensors.items()}, str(d / "model.safetensors"))
            try:
                _engine(ModelConfig(path=str(d), kind="value"), engine_name)
                out[arch][case] = f"built (renamed {old} -> {new})"
            except UnderlayError as exc:
                named = new in str(exc) or old in str(exc)  # as unread, or as missing from the files
                out[arch][case] = "" if named else f"refused without naming {old} or {new}: {exc}"
    return out


def test_value_model_refuses_tensors_it_would_not_read(tmp_path: Path) -> None:
    (res,) = run_distributed(renamed_tensor_outcomes, 1, str(tmp_path), "fsdp2", timeout_s=200)
    assert {arch: len(r) for arch, r in res.items()} == {"qwen2": 4, "mixtral": 1, "deepseek_v3": 1}
    bad = {f"{arch}/{case}": why for arch, r in res.items() for case, why in r.items() if why}
    assert not bad, bad
