"""The architecture matrix through the engines: the per-rank body that checks rows of
``coverage.EXACT[engine]`` through the public API of the fsdp2 engine, or of the mcore engine under
the CPU fixture of ``tests/mcore`` (module level so ``run_distributed`` can pickle it).

Per row, from the tiny float64 model of ``tests.unit.models._matrix.tiny_model`` (every parameter and
floating buffer moved off its init) saved in fp32 with transformers' own ``save_pretrained``:

- ``load``: ``ModelConfig(path)`` builds the policy from that checkpoint and ``iter_weights`` gives back
  every tensor of the file bit-for-bit under the file's names;
- ``infer``: ``infer`` log-probs equal, bit-for-bit, the log-probs ``forward_backward`` hands the
  ``loss_fn`` for the same batch (on-policy), although the checkpoint's config turns on every
  training-mode randomness it has a setting for (:func:`with_training_randomness`: residual, embedding,
  hidden, MLP and classifier dropout, MoE router jitter): ``training_randomness="off"`` (the default)
  must switch all of it off, and the engine's repr says ``training_randomness='off'``;
- ``export``: ``export_hf`` writes the file's tensors back and transformers' ``from_pretrained`` of the
  export gives logits equal, bit-for-bit, to ``from_pretrained`` of the source checkpoint;
- ``checkpoint``: after one optimizer step, ``CheckpointManager.save`` then ``load`` into a fresh engine
  (built from the config with another seed: its log-probs differ before the load) gives identical
  ``infer`` log-probs, and one more step on both gives identical log-probs again (optimizer state);
- ``value``: ``ModelConfig(path, kind="value")`` of a ``save_pretrained`` token-classification model of
  the type (perturbed too, so no tensor equals the seed's init) builds, every tensor (head and backbone)
  equals the file's bit-for-bit, ``infer`` returns finite values; ``load_hf`` of the causal-LM checkpoint
  into that value engine (``strict=False``) then replaces every backbone tensor with the causal-LM
  file's and reports exactly the head as missing.

A check that raises returns ``"<ErrorType>: <message>"`` instead of ``""`` (passed); a failed equality
returns a description. ``tests/distributed/test_engine_matrix.py`` compares the outcome with the
reviewed gaps of ``coverage.ENGINE_GAPS``.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHECKS = ("load", "infer", "export", "checkpoint", "value")
"""The engine-level checks of one row, in the order they run."""


_RANDOM = re.compile(r"dropout|pdrop|jitter")
"""Config keys of a training-mode randomness (dropout rates, router jitter noise)."""


def with_training_randomness(config: Any, prefix: str = "", *, jitter: bool = True) -> list[str]:
    """Set every numeric dropout / jitter key of ``config`` (and of its sub-configs) to 0.3, in place,
    except attention dropout (refused by both engines whatever the mode) and, with ``jitter=False``,
    router jitter (the mcore engine refuses ``router_jitter_noise`` by name); returns the keys set."""
    from transformers import PretrainedConfig

    keys: list[str] = []
    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            keys += with_training_randomness(value, f"{prefix}{key}.", jitter=jitter)
        elif "jitter" in key and not jitter:
            continue
        elif _RANDOM.search(key) and "att" not in key and type(value) in (int, float):
            setattr(config, key, 0.3)
            keys.append(prefix + key)
    return keys


def batch() -> Any:
    """Three right-padded rows of 10 tokens (one with 3 padding tokens), loss on every real token."""
    from underlay.interfaces import TokenBatch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (3, 10), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0
    return TokenBatch(ids * attn, attn, attn.clone(), {})


def _engine(model: Any, name: str = "fsdp2") -> Any:
    """The ``name`` engine (``"fsdp2"``, or ``"mcore"`` under the CPU fixture of ``tests/mcore``) of
    ``model`` in fp32 at world size 1."""
    from underlay.interfaces import EngineConfig, OptimConfig
    from underlay.registry import get_device

    cfg = EngineConfig(
        model=model,
        optim=OptimConfig(lr=1e-2),
        micro_batch_max_tokens=64,
        param_dtype="float32",
        reduce_dtype="float32",
        recompute="none",
    )
    if name == "mcore":
        from tests.mcore._helpers import make_engine

        return make_engine(cfg)
    from underlay.engines.fsdp2.engine import FSDP2Engine

    return FSDP2Engine(cfg, get_device("cpu"))


def _loader(name: str) -> Any:
    if name == "mcore":
        from underlay.engines.mcore.weights import MCoreWeightLoader

        return MCoreWeightLoader()
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader
    from underlay.registry import get_device

    return FSDP2WeightLoader(get_device("cpu"))


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for bucket in engine.iter_weights(1 << 29) for n, t in bucket}


def _files(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _differ(mine: dict[str, torch.Tensor], file: dict[str, torch.Tensor]) -> str:
    """'' when both hold the same names and bit-equal tensors; else what differs."""
    if set(mine) != set(file):
        return f"names: only engine {sorted(set(mine) - set(file))[:3]}, only file {sorted(set(file) - set(mine))[:3]}"
    bad = [n for n in file if not torch.equal(mine[n], file[n])]
    return f"tensors differ: {bad[:3]} ({len(bad)} in all)" if bad else ""


class _Recorder:
    """A loss_fn that records the log-probs it was given; its loss is the masked mean log-prob."""

    def __init__(self) -> None:
        self.log_probs: list[torch.Tensor] = []

    def __call__(self, outputs: Any, batch: Any, ctx: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        self.log_probs.append(outputs.log_probs.detach().clone())
        m = batch.loss_mask
        return -(outputs.log_probs * m).sum() / ctx.global_loss_tokens, {}


def _hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager")
    with torch.no_grad():
        # fresh copies: the loaded tensors may map the file at any byte offset, and some CPU kernels
        # (grouped expert matmuls) round differently on differently aligned data
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()
        return model(input_ids=ids).logits  # type: ignore[no-any-return]


def _run(out: dict[str, str], name: str, fn: Callable[[], str]) -> None:
    from underlay.interfaces import UnderlayError

    try:
        out[name] = fn()
    except UnderlayError as exc:
        out[name] = f"{type(exc).__name__}: {exc}"


def check_row(model_type: str, root: Path, perturb: str = "", engine_name: str = "fsdp2") -> dict[str, str]:
    """Every check of :data:`CHECKS` for ``model_type`` through the ``engine_name`` engine (files under
    ``root / model_type``); ``""`` per
    passed check. ``perturb`` names one check whose reference is deliberately spoiled (the negative
    control: that check must then fail); for ``"infer"`` the policy keeps its training-mode randomness
    (``training_randomness="keep"``), which fails the check on rows that have any."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from tests.unit.models._matrix import tiny_model
    from underlay.checkpoint import CheckpointManager
    from underlay.interfaces import ModelConfig

    base = root / model_type
    lm_dir = base / "lm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = tiny_model(model_type).float()
        with_training_randomness(lm.config, jitter=engine_name != "mcore")
        lm.save_pretrained(str(lm_dir))
    file = _files(lm_dir)
    loader = _loader(engine_name)
    b = batch()
    out: dict[str, str] = {}
    engine: Any = None

    keep = "keep" if perturb == "infer" else "off"  # the model's randomness on: infer must fail

    def load() -> str:
        nonlocal engine
        engine = _engine(ModelConfig(path=str(lm_dir), training_randomness=keep), engine_name)
        ref = dict(file)
        if perturb == "load":
            name = next(iter(ref))
            ref[name] = ref[name] + 1e-6
        return _differ(_weights(engine), ref)

    _run(out, "load", load)
    if engine is None:  # nothing else can run without the policy
        return {**out, **{c: "not run: load failed" for c in CHECKS if c != "load"}}

    def infer() -> str:
        if f"training_randomness={keep!r}" not in repr(engine):
            return f"the engine's repr does not show training_randomness={keep!r}: {engine!r}"
        lp = engine.infer(b).log_probs
        record = _Recorder()
        engine.forward_backward(b, record)
        seen = record.log_probs[0]
        if len(record.log_probs) != 1 or not torch.equal(seen, lp):
            return f"forward_backward log-probs != infer's: max diff {float((seen - lp).abs().max())}"
        return ""

    def export() -> str:
        exported = loader.export_hf(engine, base / "export", dtype=torch.float32)
        assert exported is not None
        diff = _differ(_files(exported), file)
        if diff:
            return f"export: {diff}"
        ids = b.input_ids[:, :7]  # no padding: the checkpoint's own forward of every row
        a, r = _hf_logits(exported, ids), _hf_logits(lm_dir, ids)
        if perturb == "export":
            r = r + 1e-6
        if not torch.equal(a, r):
            return f"from_pretrained(export) logits != from_pretrained(source): {float((a - r).abs().max())}"
        return ""

    def checkpoint() -> str:
        engine.optimizer_step()
        lp = engine.infer(b).log_probs
        CheckpointManager(base / "ckpt", engine).save(1, {"step": 1})
        fresh = _engine(ModelConfig(hf_config=AutoConfig.from_pretrained(str(lm_dir)), seed=1), engine_name)
        if torch.equal(fresh.infer(b).log_probs, lp):
            return "the fresh engine already gives the saved log-probs (the check could not fail)"
        CheckpointManager(base / "ckpt", fresh).load()
        got = fresh.infer(b).log_probs + (1e-6 if perturb == "checkpoint" else 0.0)
        if not torch.equal(got, lp):
            return f"log-probs after save/load into a fresh engine differ: {float((got - lp).abs().max())}"
        for e in (engine, fresh):  # the resumed run continues as the uninterrupted one
            e.forward_backward(b, _Recorder())
            e.optimizer_step()
        a, r = fresh.infer(b).log_probs, engine.infer(b).log_probs
        if not torch.equal(a, r):
            return f"one step after the load: log-probs differ from the uninterrupted run's: {float((a - r).abs().max())}"
        return ""

    def value() -> str:
        cfg = copy.deepcopy(AutoConfig.from_pretrained(str(lm_dir)))
        cfg.num_labels = 1
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(7)
                critic = AutoModelForTokenClassification.from_config(cfg)
        except ValueError:  # no token-classification class: the engine must refuse by name
            critic = None
        if critic is not None:
            with torch.no_grad():
                for p in critic.parameters():
                    p.add_(torch.randn_like(p) * 0.2)
            critic.save_pretrained(str(base / "value"))
        # without a token-classification class, kind="value" of the causal LM is what must be refused
        vpath = base / "value" if critic is not None else lm_dir
        venv = _engine(ModelConfig(path=str(vpath), kind="value"), engine_name)
        vfile = _files(base / "value")
        if perturb == "value":
            name = next(iter(vfile))
            vfile[name] = vfile[name] + 1e-6
        diff = _differ(_weights(venv), vfile)
        if diff:
            return f"value model vs its checkpoint: {diff}"
        values = venv.infer(b).values
        if values is None or not bool(torch.isfinite(values).all()):
            return "value model infer: no finite values"
        head = {n for n in vfile if n not in file and not n.startswith("lm_head.")}
        report = loader.load_hf(venv, lm_dir, strict=False)
        if set(report.missing) != head:
            return (
                f"load_hf(causal LM) into the value model: missing {report.missing}, expected {sorted(head)}"
            )
        # the causal LM's vocabulary head, which a value model drops (gpt_neox names it embed_out)
        body = {n: t for n, t in file.items() if not n.startswith(("lm_head.", "embed_out."))}
        own = {n: t for n, t in _weights(venv).items() if n not in head}
        diff = _differ(own, body)
        return f"value backbone from the causal-LM checkpoint: {diff}" if diff else ""

    for name, fn in (("infer", infer), ("export", export), ("checkpoint", checkpoint), ("value", value)):
        _run(out, name, fn)
    return out


def check_rows(
    rank: int, world: int, model_types: list[str], root: str, perturb: str = "", engine_name: str = "fsdp2"
) -> dict[str, Any]:
    """:func:`check_row` of every model type (one process; ``torch`` on one thread: tiny matmuls)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {mt: check_row(mt, Path(root), perturb, engine_name) for mt in model_types}
    finally:
        torch.set_num_threads(threads)


def mcore_refusals(rank: int, world: int, model_types: list[str]) -> dict[str, str]:
    """Per model type: the ``ConfigError`` message of building the mcore engine (CPU fixture) from
    its tiny config, ``""`` when the engine builds."""
    from underlay.interfaces import ConfigError, ModelConfig
    from underlay.models.coverage import tiny_config

    out: dict[str, str] = {}
    for mt in model_types:
        try:
            _engine(ModelConfig(hf_config=tiny_config(mt)), "mcore")
            out[mt] = ""
        except ConfigError as exc:
            out[mt] = str(exc)
    return out
