"""Training properties that every engine must have, as functions any engine's test package runs with its
own launcher (see ``_engine_contract``), each against a float64 single-process reference.

One process group runs a whole list of layouts (``Layout``) in turn, so an engine pays one start-up for
all of them. The layouts form a chain: the first engine starts from the seed, every later one resumes
the previous layout's checkpoint, and each takes one optimizer step over TWO ``forward_backward``
calls, so one pass checks at every layout:

- ``accum_*``: gradient accumulation over two calls equals the reference's gradient of the sum of the
  two calls' losses (grad norm, and weights after the clipped AdamW step);
- ``resume``: resuming the previous layout's checkpoint continues exactly like the uninterrupted
  reference run, or is refused with ``CheckpointError`` (``refused``) and the live parameters and
  optimizer state are bit-identical to before the call (``refused_changed``; the chain then restarts
  from the reference state through ``load_hf`` and a fresh optimizer, see ``job_properties``);
- ``nonfinite_*``: a loss that is NaN on the last rank only makes ``optimizer_step`` skip on every
  rank, logs a warning on every rank naming that rank and the metric, and changes no parameter;
- ``load_*`` (first layout): ``load_hf`` of a missing-tensor (a per-expert one for MoE), mis-shaped,
  unexpected-tensor or truncated copy of the reference's ``save_pretrained`` files raises
  ``CheckpointError`` and leaves every weight bit-identical; the intact files then load exactly (the
  file's fp32 values, the float64 reference's weights);
- ``failed_*`` (every layout; at pp > 1 the ``loss_fn`` runs on the last stage and every rank raises): a ``loss_fn`` that raises, or returns a bad value
  (``InvalidInput``), on the second micro-batch of a call after an earlier call leaves no gradient at
  all (exactly zero) and no weight changed: the step that follows (``accum_*``) starts as a fresh
  engine's would, bit for bit;
- ``low_*`` (layouts with ``low_precision``): an engine built in ``param_dtype="bfloat16"``, after
  ``load_hf`` of another model and one step, holds the loaded weights moved by at most one step (its
  fp32 master copies follow the load), never the seed's.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.conformance._engine_contract import _ctx, _dp_coords, _hf_state
from tests.distributed import _fsdp_helpers as H
from underlay.interfaces import CheckpointError, LossContext, ParallelConfig, TokenBatch

__all__ = ["SLOW_CHAINS", "Layout", "chains", "check_properties", "job_properties", "tiny_config"]


@dataclass(frozen=True)
class Layout:
    """One engine layout of a chain: ``parallel`` sizes (``ParallelConfig`` keywords), engine
    ``options``, and whether it also runs the bfloat16 ``load_hf`` property."""

    name: str
    parallel: Mapping[str, int] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    low_precision: bool = False
    refuses: bool = False  # resuming the previous layout's checkpoint must be refused (CheckpointError)


# chains that the CPU test runs only among the slow variants (their layouts' properties at other
# layouts run in CI: cp2 in the "dense" chain)
SLOW_CHAINS = frozenset({"dense-vpp-cp"})


def chains(engine: str, world: int) -> dict[str, list[Layout]]:
    """The layout chains each engine runs at ``world`` ranks, by name (``"moe"`` for the Qwen3-MoE
    model, every other name the dense one): every layout of the engine the ranks can hold, each
    resuming the previous one's checkpoint."""
    if engine == "mcore" and world == 2:
        return {
            # dp2 -> tp2 (sequence parallel) -> pp2 -> cp2 -> the plain optimizer (refused: other format)
            "dense": [
                Layout("dp2", low_precision=True),
                Layout("tp2-sp", {"tp": 2}, {"sequence_parallel": True}),
                Layout("pp2", {"pp": 2}),
                Layout("cp2", {"cp": 2}),
                Layout("dp2-plain-optimizer", options={"distributed_optimizer": False}, refuses=True),
            ],
            # ep2 -> ep1 (refused: the experts' optimizer state does not map across)
            "moe": [Layout("ep2", {"ep": 2}), Layout("ep1-dp2", refuses=True)],
            # interleaved pipeline (its load_hf and broken files), then cp2 resuming it; bf16 at both
            "dense-vpp-cp": [
                Layout("pp2-vpp2", {"pp": 2, "vpp": 2}, low_precision=True),
                Layout("cp2", {"cp": 2}, low_precision=True),
            ],
        }
    if engine == "mcore":
        return {"dense": [Layout("single", low_precision=True)]}
    if world == 1:  # resuming is proved at 2 ranks; one layout keeps the single-rank run short
        return {"dense": [Layout("dp1", low_precision=True)]}
    return {"dense": [Layout(f"dp{world}", low_precision=True), Layout(f"dp{world}-resumed")]}


def tiny_config(model: str) -> Any:
    """A 4-layer tiny Qwen3 (``"dense"``: q/k norms, GQA) or Qwen3-MoE (``"moe"``: 4 experts, top-2);
    4 layers so that pp=2 x vpp=2 has a layer per virtual stage."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=H.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    if model == "moe":
        return Qwen3MoeConfig(
            **common, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1
        )
    return Qwen3Config(**common)


def _hf_named(model: Any, moe: bool) -> dict[str, torch.Tensor]:
    weights = H.merged_weights(model)
    if moe:
        from underlay.engines.mcore._hf import per_expert_names

        weights = per_expert_names(weights)
    return weights


class _Reference:
    """The uninterrupted float64 run: the seed model and a torch AdamW with the engine's settings;
    ``step`` takes one clipped step over the sum of the given batches' token-mean losses (each call's
    contribution under loss contract v3: k calls sum their contributions)."""

    def __init__(self, hf: Any, cfg: Any, seed: int, moe: bool) -> None:
        self.model = H.reference_model(copy.deepcopy(hf), seed)
        self.cfg = cfg
        self.moe = moe
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optim
        self.opt = torch.optim.AdamW(
            self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )

    def step(self, batches: list[TokenBatch]) -> tuple[float, dict[str, torch.Tensor]]:
        self.opt.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        for b in batches:
            loss, _ = H.pg_loss(H.reference_outputs(self.model, b), b, LossContext.single(b.loss_mask))
            total = total + loss
        total.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip or math.inf))
        self.opt.step()
        return norm, self.weights()

    def weights(self) -> dict[str, torch.Tensor]:
        return _hf_named(self.model, self.moe)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _nan_on_last_dp_rank(dp_rank: int, dp_size: int) -> Callable[..., Any]:
    """``H.pg_loss``, NaN on the last data-parallel rank (model-parallel peers compute one loss)."""

    def loss_fn(outputs: Any, batch: TokenBatch, ctx: LossContext) -> Any:
        loss_sum, metrics = H.pg_loss(outputs, batch, ctx)
        if dp_rank == dp_size - 1:
            loss_sum = loss_sum * float("nan")
        return loss_sum, metrics

    return loss_fn


def _optim_state(engine: Any) -> list[torch.Tensor]:
    """Every tensor of the engine's optimizer state that a load may change (for the unchanged check)."""
    opt = getattr(engine, "optimizer", None) or engine._optimizer
    inner = [o.optimizer for o in opt.chained_optimizers] if hasattr(opt, "chained_optimizers") else None
    if inner is None:
        inner = [opt.optimizer] if hasattr(opt, "optimizer") else [opt]
    out = []
    for o in inner:
        for group in o.param_groups:
            for p in group["params"]:
                out.append(p.detach().clone())
                for v in o.state.get(p, {}).values():
                    if torch.is_tensor(v):
                        out.append(v.detach().clone())
    return out


def _teardown(name: str) -> None:
    if name == "mcore":
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()


def job_properties(
    rank: int, world: int, name: str, root: str, dev_name: str, model: str, layouts: list[Layout]
) -> list[dict[str, Any]]:
    """Every rank: the chain of ``layouts`` (see the module docstring); one result dict per layout.
    ``root`` holds the checkpoints (``root/ckpt<i>``) and the other model's HF files."""
    import dataclasses

    moe = model == "moe"
    hf = tiny_config(model)
    _dev, build, loader = _ctx(name, dev_name)
    base = H.engine_config(copy.deepcopy(hf))
    ref = _Reference(hf, base, 0, moe)
    other_dir = Path(root) / "other_hf"
    if rank == 0 and not other_dir.exists():
        H.reference_model(copy.deepcopy(hf), 7).float().save_pretrained(str(other_dir))
    dist.barrier()
    handler = _Records()
    logging.getLogger("underlay").addHandler(handler)
    results: list[dict[str, Any]] = []
    previous: Path | None = None
    for i, lay in enumerate(layouts):
        out: dict[str, Any] = {"rank": rank, "layout": lay.name, "refuses": lay.refuses}
        cfg = dataclasses.replace(
            base,
            model=dataclasses.replace(base.model, seed=100 + i),  # never the reference's seed
            parallel=ParallelConfig(**lay.parallel),
            options=dict(lay.options),
        )
        engine = build(cfg)
        dpi, dps = _dp_coords(engine)
        if previous is None:
            ref_dir = _export_reference(ref, Path(root) / "ref0", rank)
            out.update(_bad_loads(loader, engine, ref_dir, rank, moe))
            loader.load_hf(engine, ref_dir)
            out["load_exact"] = H.max_diff(_hf_state(loader, engine), _files(ref_dir))
            out["load_f64"] = H.max_diff(_hf_state(loader, engine), ref.weights())
            fresh_optimizer = True
        else:
            before_w = _hf_state(loader, engine)
            before_o = _optim_state(engine)
            try:
                engine.load_checkpoint(previous)
                out["resume"] = "loaded"
                fresh_optimizer = False
            except CheckpointError as exc:
                out["resume"] = f"refused: {exc}"
                after_o = _optim_state(engine)
                out["refused_changed"] = max(
                    H.max_diff(_hf_state(loader, engine), before_w),
                    max(
                        (float((a - b).abs().max()) for a, b in zip(after_o, before_o) if a.numel()),
                        default=0.0,
                    )
                    if len(after_o) == len(before_o)
                    else math.inf,
                )
                # the chain goes on from the reference state with a fresh optimizer on both sides
                ref.opt = torch.optim.AdamW(
                    ref.params,
                    lr=ref.cfg.optim.lr,
                    betas=ref.cfg.optim.betas,
                    eps=ref.cfg.optim.eps,
                    weight_decay=ref.cfg.optim.weight_decay,
                )
                loader.load_hf(engine, _export_reference(ref, Path(root) / f"ref{i}", rank))
                fresh_optimizer = True
        out["fresh_optimizer"] = fresh_optimizer
        # gradient accumulation: two calls, one step, against the reference's step over both losses
        b1, b2 = H.global_batch(30 + 2 * i), H.global_batch(31 + 2 * i, n=4)
        out.update(_failed_steps(loader, engine, H.shard(b1, dpi, dps), dpi, dps))
        engine.forward_backward(H.shard(b1, dpi, dps), H.pg_loss)
        engine.forward_backward(H.shard(b2, dpi, dps), H.pg_loss)
        st = engine.optimizer_step()
        engine.lr_scheduler_step()
        ref_norm, ref_w = ref.step([b1, b2])
        out["accum_norm"] = abs(st.grad_norm - ref_norm) / ref_norm
        out["accum_weights"] = H.max_diff(_hf_state(loader, engine), ref_w)
        # non-finite loss on the last rank: skipped everywhere, a warning naming the rank and metric
        handler.messages.clear()
        kept = _hf_state(loader, engine)
        engine.forward_backward(H.shard(b1, dpi, dps), _nan_on_last_dp_rank(dpi, dps))
        skip = engine.optimizer_step()
        out["nonfinite_skipped"] = skip.skipped
        out["nonfinite_changed"] = H.max_diff(_hf_state(loader, engine), kept)
        out["nonfinite_warning"] = " | ".join(m for m in handler.messages if "non-finite" in m)
        ckpt = Path(root) / f"ckpt{i}"
        if rank == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        engine.save_checkpoint(ckpt)
        previous = ckpt
        del engine
        if lay.low_precision:
            out.update(_low_precision(name, build, loader, cfg, other_dir, rank, dpi, dps, moe))
        _teardown(name)
        results.append(out)
    logging.getLogger("underlay").removeHandler(handler)
    return results


def _files(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _bad_loads(loader: Any, engine: Any, good: Path, rank: int, moe: bool) -> dict[str, Any]:
    """``load_hf`` of broken copies of the ``save_pretrained`` files in ``good``: one tensor missing (a
    per-expert one for MoE), one mis-shaped, one unexpected, the file truncated. Per case the error
    and the largest change of any weight (must be ``0.0``)."""
    from safetensors.torch import save_file

    names = {"missing": {}, "shape": {}, "unexpected": {}, "truncated": {}}
    dirs = {case: good.parent / f"{good.name}-{case}" for case in names}
    if rank == 0:
        files = sorted(good.glob("*.safetensors"))
        assert len(files) == 1, files  # a tiny model: save_pretrained writes one file
        state = _files(good)
        victim = (
            "model.layers.1.mlp.experts.3.down_proj.weight" if moe else "model.layers.1.mlp.down_proj.weight"
        )
        assert victim in state, sorted(state)[:8]
        variants = {
            "missing": {k: v for k, v in state.items() if k != victim},
            "shape": {**state, victim: state[victim][:-1].contiguous()},
            "unexpected": {**state, "model.layers.1.mlp.extra.weight": torch.zeros(2, 2)},
        }
        for case, d in dirs.items():
            d.mkdir(parents=True, exist_ok=True)
            (d / "config.json").write_bytes((good / "config.json").read_bytes())
            if case == "truncated":
                data = files[0].read_bytes()
                (d / files[0].name).write_bytes(data[:-64])
            else:
                save_file(variants[case], str(d / files[0].name), metadata={"format": "pt"})
    dist.barrier()
    before = _hf_state(loader, engine)
    out: dict[str, Any] = {}
    for case, d in dirs.items():
        try:
            loader.load_hf(engine, d)
            out[f"load_{case}"] = "no error"
        except Exception as exc:
            out[f"load_{case}"] = f"{type(exc).__name__}: {exc}"
        out[f"load_{case}_changed"] = H.max_diff(_hf_state(loader, engine), before)
    return out


def _full_rows(seed: int, n: int) -> TokenBatch:
    """``n`` sequences of ``H.SEQ`` tokens each (no padding): at ``micro_batch_max_tokens=20`` every
    row is a micro-batch of its own, so every rank runs as many real micro-batches as it has rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, H.VOCAB, (n, H.SEQ), generator=g)
    attn = torch.ones_like(ids)
    loss_mask = attn.clone()
    loss_mask[:, 0] = 0
    return TokenBatch(ids, attn, loss_mask, {"advantages": torch.randn(n, generator=g)})


def _grad_abs_max(engine: Any) -> float:
    """The largest gradient value the engine holds (``param.grad`` and megatron's ``main_grad``)."""
    worst = 0.0
    for p in engine.model.parameters():
        for g in (p.grad, getattr(p, "main_grad", None)):
            if g is not None:
                local = g.to_local() if hasattr(g, "to_local") else g
                if local.numel():
                    worst = max(worst, float(local.detach().abs().max()))
    return worst


def _failed_steps(loader: Any, engine: Any, earlier: TokenBatch, dpi: int, dps: int) -> dict[str, Any]:
    """After a good ``forward_backward(earlier)``, a call whose ``loss_fn`` raises (``raise``) or returns
    a Python float (``bad_return``) on its second micro-batch (every rank runs two real micro-batches):
    the error, the largest gradient left (must be ``0.0``: the partial and the earlier gradients are
    dropped) and the largest weight change (``0.0``)."""

    def failing(bad_return: bool) -> Callable[..., Any]:
        def loss_fn(outputs: Any, batch: TokenBatch, ctx: LossContext) -> Any:
            loss, metrics = H.pg_loss(outputs, batch, ctx)
            if ctx.micro_batch == 1:
                if bad_return:
                    return float(loss), metrics
                raise RuntimeError("injected loss_fn failure")
            return loss, metrics

        return loss_fn

    kept = _hf_state(loader, engine)
    out: dict[str, Any] = {}
    rows = H.shard(_full_rows(70, 2 * dps), dpi, dps)
    for case, bad_return in (("raise", False), ("bad_return", True)):
        engine.forward_backward(earlier, H.pg_loss)  # gradients of an earlier call, to be dropped too
        out[f"failed_{case}_before"] = _grad_abs_max(engine)
        try:
            engine.forward_backward(rows, failing(bad_return))
            out[f"failed_{case}"] = "no error"
        except Exception as exc:
            out[f"failed_{case}"] = f"{type(exc).__name__}: {exc}"
        out[f"failed_{case}_grads"] = _grad_abs_max(engine)
    out["failed_changed"] = H.max_diff(_hf_state(loader, engine), kept)
    return out


def _export_reference(ref: _Reference, out: Path, rank: int) -> Path:
    """The reference's current weights as HF files (fp32), written by rank 0."""
    if rank == 0:
        state = {k: v.detach().float().contiguous() for k, v in ref.model.state_dict().items()}
        ref.model.save_pretrained(str(out), state_dict=state)
    dist.barrier()
    return out


def _low_precision(
    name: str, build: Any, loader: Any, cfg: Any, other_dir: Path, rank: int, dpi: int, dps: int, moe: bool
) -> dict[str, Any]:
    """A bf16 engine from seed 0: ``load_hf`` of the other model, one step. Each weight must be the
    loaded one moved by one step: within ``1.5 * lr`` (AdamW moves a weight by at most about lr) plus
    bf16 rounding of the loaded value; a load that the master copies missed leaves the seed's."""
    import dataclasses

    _teardown(name)
    low = build(dataclasses.replace(cfg, param_dtype="bfloat16"))
    loader.load_hf(low, other_dir)
    from safetensors.torch import load_file

    loaded: dict[str, torch.Tensor] = {}
    for f in sorted(other_dir.glob("*.safetensors")):
        loaded.update(load_file(str(f)))
    b = H.global_batch(50)
    low.forward_backward(H.shard(b, dpi, dps), H.pg_loss)
    low.optimizer_step()
    after = _hf_state(loader, low)
    lr = cfg.optim.lr
    worst = 0.0
    for n, w in after.items():
        ref = loaded[n].double()
        bound = 1.5 * lr + 2.0**-8 * float(ref.abs().max())
        worst = max(worst, float((w.double().cpu() - ref).abs().max()) / bound)
    del low
    return {"low_ratio": worst}


def check_properties(results: list[list[dict[str, Any]]], world: int, tol: float) -> None:
    """What ``job_properties`` must show, per layout, on every rank."""
    assert len(results) == world
    for per_rank in results:
        # every chain proves the file checks (its first layout) and failed-call cleanup (every layout)
        assert "load_exact" in per_rank[0], per_rank[0]
        assert all("failed_raise" in r for r in per_rank), [r["layout"] for r in per_rank]
        for r in per_rank:
            if "load_exact" in r:  # broken files refused with nothing changed; the intact ones exact
                for case in ("missing", "shape", "unexpected", "truncated"):
                    assert r[f"load_{case}"].startswith("CheckpointError"), (case, r)
                    assert r[f"load_{case}_changed"] == 0.0, (case, r)
                assert r["load_exact"] == 0.0 and r["load_f64"] < tol, r
            if "failed_raise" in r:  # a failed call leaves no gradient and no weight changed
                assert r["failed_raise_before"] > 0.0 and r["failed_bad_return_before"] > 0.0, r
                assert r["failed_raise"].startswith("RuntimeError: injected"), r
                assert r["failed_bad_return"].startswith("InvalidInput"), r
                assert r["failed_raise_grads"] == 0.0 and r["failed_bad_return_grads"] == 0.0, r
                assert r["failed_changed"] == 0.0, r
            assert r["accum_norm"] < tol and r["accum_weights"] < tol, r
            assert r["nonfinite_skipped"] and r["nonfinite_changed"] == 0.0, r
            assert f"rank {world - 1}" in r["nonfinite_warning"] and "loss" in r["nonfinite_warning"], r
            if "resume" in r:  # exactly the expected refusals, each before any live state changed
                assert (r["resume"] != "loaded") == r["refuses"], r
                assert r["resume"] == "loaded" or r["refused_changed"] == 0.0, r
            if "low_ratio" in r:
                assert r["low_ratio"] <= 1.0, r


def _load_phases(name: str, engine: Any) -> list[tuple[str, Any, str]]:
    """``(phase, owner, attribute)`` of each step of ``engine.load_checkpoint`` that writes live state
    (or reads the files), in order: the test makes each raise right after it ran."""
    import torch.distributed.checkpoint.state_dict as dcp_sd

    if name == "mcore":
        from megatron.core import dist_checkpointing

        from underlay.engines.mcore._chunks import unwrap as _unwrap

        return [
            ("read", dist_checkpointing, "load"),
            ("model", _unwrap(engine.chunks[-1]), "load_state_dict"),
            ("optimizer", engine._optimizer, "load_state_dict"),
            ("schedule", engine._schedulers[-1], "load_state_dict"),
        ]
    import underlay.utils.safe_dcp as safe_dcp

    return [
        ("read", safe_dcp, "safe_dcp_load"),
        ("model", dcp_sd, "set_model_state_dict"),
        ("optimizer", dcp_sd, "set_optimizer_state_dict"),
        ("schedule", engine._scheduler, "load_state_dict"),
    ]


def job_load_faults(rank: int, world: int, name: str, root: str, dev_name: str) -> dict[str, Any]:
    """Every rank: a checkpoint load that fails right after each of its phases (an ``Exception``, and
    torch's ``CheckpointException``, a ``BaseException``, after the read) must raise
    ``CheckpointError`` and leave the parameters, the optimizer state and the LR schedule exactly as
    they were; the load then succeeds unpatched. Returns per injected failure the error text and the
    largest change of any live value."""
    from torch.distributed.checkpoint.api import CheckpointException

    hf = tiny_config("dense")
    _dev, build, loader = _ctx(name, dev_name)
    engine = build(H.engine_config(copy.deepcopy(hf)))
    dpi, dps = _dp_coords(engine)
    ckpt = Path(root) / "ckpt"
    if rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    b = H.global_batch(60)
    engine.forward_backward(H.shard(b, dpi, dps), H.pg_loss)
    engine.optimizer_step()
    engine.save_checkpoint(ckpt)
    engine.forward_backward(H.shard(b, dpi, dps), H.pg_loss)
    engine.optimizer_step()
    engine.lr_scheduler_step()
    sched = getattr(engine, "_scheduler", None) or engine._schedulers[-1]
    before = (_hf_state(loader, engine), _optim_state(engine), copy.deepcopy(sched.state_dict()))

    def changed() -> float:
        w, o, s = _hf_state(loader, engine), _optim_state(engine), sched.state_dict()
        if len(o) != len(before[1]) or s != before[2]:
            return math.inf
        return max(
            H.max_diff(w, before[0]), *(float((a - b).abs().max()) for a, b in zip(o, before[1]) if a.numel())
        )

    out: dict[str, Any] = {}
    cases = [(p, owner, attr, RuntimeError) for p, owner, attr in _load_phases(name, engine)]
    cases.insert(1, ("read-base", *_load_phases(name, engine)[0][1:], CheckpointException))
    for phase, owner, attr, exc_type in cases:
        original = getattr(owner, attr)

        def failing(
            *args: Any, _orig: Any = original, _exc: Any = exc_type, _phase: str = phase, **kwargs: Any
        ) -> Any:
            _orig(*args, **kwargs)
            if _exc is CheckpointException:
                raise CheckpointException("injected failure", {})
            raise _exc(f"injected failure after {_phase}")

        setattr(owner, attr, failing)
        try:
            engine.load_checkpoint(ckpt)
            out[phase] = "no error"
        except CheckpointError as exc:
            out[phase] = f"CheckpointError: {exc}"
        except BaseException as exc:
            out[phase] = f"{type(exc).__name__}: {exc}"
        finally:
            if owner.__dict__.get(attr) is failing:
                if isinstance(owner, type) or hasattr(owner, "__file__"):
                    setattr(owner, attr, original)
                else:
                    delattr(owner, attr)
        out[f"{phase}_changed"] = changed()
    engine.load_checkpoint(ckpt)
    out["loaded_step"] = engine.global_step
    return out


def check_load_faults(results: list[dict[str, Any]]) -> None:
    """What ``job_load_faults`` must show on every rank."""
    for r in results:
        for phase in ("read", "read-base", "model", "optimizer", "schedule"):
            assert r[phase].startswith("CheckpointError"), (phase, r)
            assert ("injected" if phase != "read-base" else "CheckpointException") in r[phase], (phase, r)
            assert r[f"{phase}_changed"] == 0.0, (phase, r)
        assert r["loaded_step"] == 1, r
