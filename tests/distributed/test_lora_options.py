"""LoRA options of the fsdp2 engine: ``"all-linear"`` and exclusions select what peft selects; an
adapter directory (``export_adapters`` / peft) loads bit for bit and equals peft's model in float64;
``disable_adapter()`` gives the base model's log-probs from the same engine; refusals name the cause."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H
from underlay.interfaces import ConfigError, InvalidInput, LoraConfig, OptimConfig

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _adapted(names: Any) -> set[str]:
    return {n.split(".lora_")[0].removeprefix("base_model.model.") for n in names if ".lora_A." in n}


def _logp(model: Any, batch: Any) -> torch.Tensor:
    out = H.reference_outputs(model, batch).log_probs
    assert out is not None
    return out


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    from underlay import registry

    out: dict[str, Any] = {}
    hf = H.llama_config()
    batch = H.global_batch(4)
    loader = registry.get_weight_loader("fsdp2")

    # all-linear minus o_proj: the same modules peft adapts on the plain transformers model
    lora = LoraConfig(rank=4, alpha=8.0, target_modules="all-linear", exclude_modules=("o_proj",))
    eng = registry.get_engine(H.engine_config(hf, lora=lora))
    ref = get_peft_model(
        H.reference_model(hf, 0),
        PeftLoraConfig(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["o_proj"]),
    )
    out["selected"] = sorted(_adapted(n for n, _ in eng.model.named_parameters()))
    out["peft_selected"] = sorted(_adapted(n for n, _ in ref.named_parameters()))

    # train adapters, export them, start a new engine from the directory
    qv = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    cfg = H.engine_config(hf, lora=qv, optim=OptimConfig(lr=2e-2, grad_clip=None))
    a = registry.get_engine(cfg)
    for seed in (1, 2):
        a.forward_backward(H.global_batch(seed), H.pg_loss)
        a.optimizer_step()
    adir = Path(root) / "adapter"
    loader.export_adapters(a, adir)
    b = registry.get_engine(H.engine_config(hf, lora=LoraConfig.from_adapter(str(adir))))
    ta, tb = dict(a.named_adapter_tensors()), dict(b.named_adapter_tensors())
    out["adapters_equal"] = ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    lp_a, lp_b = a.infer(batch).log_probs, b.infer(batch).log_probs
    assert lp_a is not None and lp_b is not None
    out["infer_equal"] = torch.equal(lp_a, lp_b)
    peft_model = PeftModel.from_pretrained(H.reference_model(hf, 0), str(adir)).double()
    out["peft_err"] = float((lp_b.double() - _logp(peft_model, batch)).abs().max())

    # the reference policy from the same engine: adapters bypassed
    base = _logp(H.reference_model(hf, 0), batch)
    with b.disable_adapter():
        lp_off = b.infer(batch).log_probs
        try:
            b.forward_backward(batch, H.pg_loss)
            out["fb_inside"] = "no error"
        except InvalidInput as exc:
            out["fb_inside"] = str(exc)
    assert lp_off is not None
    out["off_err"] = float((lp_off.double() - base).abs().max())
    out["on_vs_base"] = float((lp_b.double() - base).abs().max())
    lp_again = b.infer(batch).log_probs
    out["back_on"] = lp_again is not None and torch.equal(lp_again, lp_b)
    try:
        with registry.get_engine(H.engine_config(hf)).disable_adapter():
            pass
        out["no_lora"] = "no error"
    except InvalidInput as exc:
        out["no_lora"] = str(exc)
    try:
        registry.get_engine(
            H.engine_config(
                hf, lora=LoraConfig(rank=8, target_modules=("q_proj", "v_proj"), adapter_path=str(adir))
            )
        )
        out["mismatch"] = "no error"
    except ConfigError as exc:
        out["mismatch"] = str(exc)
    return out


def test_lora_selection_adapter_loading_and_disable(tmp_path: Path) -> None:
    r = run_distributed(_job, 1, str(tmp_path))[0]
    assert r["selected"] == r["peft_selected"] and r["selected"]
    assert not any(s.endswith("o_proj") for s in r["selected"]) and not any(
        "lm_head" in s for s in r["selected"]
    )
    assert any(s.endswith("gate_proj") for s in r["selected"])
    assert r["adapters_equal"] and r["infer_equal"]
    assert r["peft_err"] < 1e-5, r["peft_err"]
    assert r["on_vs_base"] > 1e-4, r["on_vs_base"]  # the adapters change the outputs...
    assert r["off_err"] < 1e-5, r["off_err"]  # ...and disable_adapter removes exactly them
    assert r["back_on"]
    assert "inside disable_adapter()" in r["fb_inside"]
    assert "no LoRA adapters" in r["no_lora"]
    assert "rank: config 8 vs file 4" in r["mismatch"]


def test_lora_config_refusals(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="empty"):
        LoraConfig(target_modules=())
    with pytest.raises(ConfigError, match="tuple of str"):
        LoraConfig(exclude_modules=(1,))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        LoraConfig.from_adapter(str(tmp_path))
    from underlay.engines.fsdp2._build import check_adapter_dir

    with pytest.raises(ConfigError, match="adapter_model.safetensors"):
        check_adapter_dir(LoraConfig(adapter_path=str(tmp_path)))
