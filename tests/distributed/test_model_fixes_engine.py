"""Issue 34 through the fsdp2 engine (one gloo rank, one spawn for every case):

- loading: transformers' own ``save_pretrained`` output of every listed text architecture (per-expert
  tensors of Mixtral, DeepSeek-V3, GLM-4-MoE, Qwen-MoE; DeepSeek/GLM routing-bias buffers) loads into a
  policy and, for the MoE ones, a value model with every tensor bit-for-bit; ``iter_weights`` yields the
  checkpoint's names; ``export_hf`` writes the same tensors back;
- ``training_randomness="off"``: ``forward_backward`` sees the log-probs ``infer`` gives (dropout and
  router jitter configured), and the engine's repr says so;
- the router auxiliary loss reaches the ``loss_fn`` (``TokenOutputs.aux_loss``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

VALUE_ARCHS = ("mixtral", "deepseek_v3", "qwen3_moe", "qwen2_moe", "gpt_oss")
NO_VALUE_CLASS = "glm4_moe"  # transformers has no token-classification class for it: refused by name


def _files(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _engine(model: Any, **over: Any) -> Any:
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.interfaces import EngineConfig, ModelConfig, OptimConfig
    from underlay.registry import get_device

    cfg = EngineConfig(
        model=model,
        optim=OptimConfig(lr=1e-3),
        micro_batch_max_tokens=64,
        param_dtype="float32",
        reduce_dtype="float32",
        **over,
    )
    assert isinstance(cfg.model, ModelConfig)
    return FSDP2Engine(cfg, get_device("cpu"))


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for bucket in engine.iter_weights(1 << 29) for n, t in bucket}


def _differences(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    out = [f"names: only engine {sorted(set(a) - set(b))[:4]}, only file {sorted(set(b) - set(a))[:4]}"]
    if set(a) == set(b):
        out = [n for n in a if not torch.equal(a[n], b[n])]
    return out


def _load_cases(root: Path) -> dict[str, list[str]]:
    """Per case: the tensors that differ (empty: bit-for-bit)."""
    from tests.unit.models._f64 import LISTED, f64_model
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader
    from underlay.interfaces import ModelConfig
    from underlay.registry import get_device

    out: dict[str, list[str]] = {}
    for arch, overrides in LISTED.items():
        src = root / arch
        f64_model(arch, **overrides).float().save_pretrained(str(src))
        saved = _files(src)
        engine = _engine(ModelConfig(path=str(src)))
        out[arch] = _differences(_weights(engine), saved)
        exported = FSDP2WeightLoader(get_device("cpu")).export_hf(engine, root / f"{arch}-export")
        assert exported is not None
        out[f"{arch}/export"] = _differences(_files(exported), saved)
        if arch == "deepseek_v3":  # load_hf into an engine built from the seed: the same tensors
            seeded = _engine(ModelConfig(hf_config=f64_model(arch, **overrides).config, seed=1))
            report = FSDP2WeightLoader(get_device("cpu")).load_hf(seeded, src)
            out[f"{arch}/load_hf"] = _differences(_weights(seeded), saved) + list(report.unexpected)
        if arch in VALUE_ARCHS:
            critic = _weights(_engine(ModelConfig(path=str(src), kind="value")))
            assert "score.weight" in critic  # the head the checkpoint lacks, from the seed
            body = {n: t for n, t in saved.items() if not n.startswith("lm_head.")}
            own = {n: t for n, t in critic.items() if not n.startswith("score.")}
            out[f"{arch}/value"] = _differences(own, body)
    from underlay.interfaces import ConfigError

    try:
        _engine(ModelConfig(path=str(root / NO_VALUE_CLASS), kind="value"))
        out["glm4_moe/value refused"] = ["built"]
    except ConfigError as exc:
        out["glm4_moe/value refused"] = [] if "token-classification" in str(exc) else [str(exc)]
    return out


class _Recorder:
    """A loss_fn that records what it was given and contributes 0."""

    def __init__(self) -> None:
        self.log_probs: list[torch.Tensor] = []
        self.aux: list[torch.Tensor | None] = []

    def __call__(self, outputs: Any, batch: Any, ctx: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
        self.log_probs.append(outputs.log_probs.detach().clone())
        self.aux.append(outputs.aux_loss)
        return (outputs.log_probs * batch.loss_mask).sum() * 0.0, {}


def _randomness_and_aux() -> dict[str, Any]:
    from tests.unit.models._f64 import TINY
    from underlay.interfaces import ModelConfig, TokenBatch

    res: dict[str, Any] = {}
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (3, 10), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0
    batch = TokenBatch(ids * attn, attn, attn.clone(), {})
    cases = {
        "phi3": dict(resid_pdrop=0.3, embd_pdrop=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5),
    }
    from transformers import AutoConfig

    for arch, over in cases.items():
        for mode in ("off", "keep"):
            hf = AutoConfig.for_model(arch, **{**TINY, **over})
            engine = _engine(ModelConfig(hf_config=hf, training_randomness=mode), with_entropy=False)
            record = _Recorder()
            infer = engine.infer(batch).log_probs
            engine.forward_backward(batch, record)
            seen, aux = record.log_probs, record.aux
            res[f"{arch}/{mode}/equal"] = len(seen) == 1 and torch.equal(seen[0], infer)
            res[f"{arch}/{mode}/repr"] = f"training_randomness='{mode}'" in repr(engine)
            res[f"{arch}/aux"] = [a is not None and a.dim() == 0 and a.requires_grad for a in aux]
    return res


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    return {"load": _load_cases(Path(root)), "train": _randomness_and_aux()}


def test_checkpoints_randomness_and_aux_loss_through_the_engine(tmp_path: Path) -> None:
    (res,) = run_distributed(_job, 1, str(tmp_path))
    failed = {case: diff[:4] for case, diff in res["load"].items() if diff}
    assert not failed, failed
    train = res["train"]
    for arch in ("phi3", "mixtral"):
        assert train[f"{arch}/off/equal"], arch  # on-policy: training forward == inference forward
        assert not train[f"{arch}/keep/equal"], arch  # (the randomness is real)
        assert train[f"{arch}/off/repr"] and train[f"{arch}/keep/repr"]
    assert train["mixtral/aux"] == [True]
    assert train["phi3/aux"] == [False]
