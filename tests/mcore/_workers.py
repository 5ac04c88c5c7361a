"""Per-rank bodies of the mcore tests (module level so ``run_distributed`` can pickle them)."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.mcore import _helpers as H


def grad_by_hf_name(eng: Any) -> dict[str, torch.Tensor]:
    """Full gradients by HF name: megatron's ``main_grad`` gathered like the weights."""
    eng.finalize_grads()
    saved = {}
    for c in eng.chunks:
        for p in c.parameters():
            saved[p] = p.data.clone()
            p.data.copy_(p.main_grad.to(p.dtype))
    out = {n: t.clone() for n, t in eng.named_full_tensors()}
    for p, v in saved.items():
        p.data.copy_(v)
    return out


def check_forward_grads(
    rank: int,
    world: int,
    family: str,
    tp: int,
    pp: int,
    ep: int,
    opts: dict[str, Any],
    sizes: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Log-probs (infer), loss and gradients of one forward_backward against the float64 HF model;
    ``sizes`` are further ``ParallelConfig`` sizes (``etp``, ``vpp``, ``cp``)."""
    if opts.get("fused_elementwise") and not torch.cuda.is_available():
        # the fused graphs traced by dynamo and autograd (aot_eager) without inductor's C++ build, which
        # is no production path (fused_elementwise defaults on with cuda only, where it runs inductor)
        # and cost about a minute of CPU here
        os.environ.setdefault("UNDERLAY_COMPILE_BACKEND", "aot_eager")
    cfg = H.tiny_config(family)
    eng = H.make_engine(H.engine_config(cfg, tp=tp, pp=pp, ep=ep, **(sizes or {}), **opts))
    dp = eng.layout.dp_shard
    full = H.make_batch(1, b=4 * dp // max(dp, 1) * dp)
    mine = full.select(list(range(eng_dp_rank(eng), full.batch_size, dp)))
    out = eng.infer(mine, with_entropy=True)
    ref_lp, ref_loss, ref_grads = H.hf_reference(cfg, full)
    ref_mine = ref_lp[list(range(eng_dp_rank(eng), full.batch_size, dp))]
    res = eng.forward_backward(mine, H.pg_loss)
    grads = grad_by_hf_name(eng)
    gerr = 0.0
    for name, g in grads.items():
        r = ref_grads[name]
        gerr = max(gerr, float((g.double() - r).abs().max() / (r.abs().max() + 1e-6)))
    # the optimizer's global grad norm (every shard and replica counted once) against HF's
    ref_norm = float(sum((g**2).sum() for g in ref_grads.values()) ** 0.5)
    norm = eng.optimizer_step().grad_norm
    return {
        "lp": float((out.log_probs.double() - ref_mine).abs().max()),
        "loss": abs(res.metrics["loss"] - float(ref_loss)),
        "grad_rel": gerr,
        "n": len(grads),
        "etp": eng.layout.etp,
        "norm_rel": abs(norm - ref_norm) / ref_norm,
    }


def eng_dp_rank(eng: Any) -> int:
    import torch.distributed as dist

    group = eng.layout.groups.dp
    return dist.get_rank(group) if group is not None else 0


def wrong_fusion(rank: int, world: int, which: str) -> float:
    """Max log-prob error against HF when the weight map fuses in a wrong order (negative control):
    ``qkv``: plain ``[q; k; v]`` concatenation; ``gate_up``: ``[up; gate]``."""
    import dataclasses

    import underlay.engines.mcore.weightmap as wm

    # the rule constructors the engine's weight map (and so its fill through the shared reader) uses
    if which == "qkv":
        qkv = wm._wm_qkv

        def plain_qkv(name: str, q: str, k: str, v: str, **kw: int) -> Any:
            rule = qkv(name, q, k, v, **kw)
            return dataclasses.replace(rule, from_hf=lambda t: torch.cat([t[q], t[k], t[v]], 0))

        wm._wm_qkv = plain_qkv
    else:
        gate_up = wm._wm_gate_up
        wm._wm_gate_up = lambda name, gate, up: gate_up(name, up, gate)
    cfg = H.tiny_config("llama")
    eng = H.make_engine(H.engine_config(cfg))
    batch = H.make_batch(3)
    out = eng.infer(batch)
    ref_lp, _, _ = H.hf_reference(cfg, batch)
    return float((out.log_probs.double() - ref_lp).abs().max())


def step_vs_fsdp2(rank: int, world: int, family: str) -> dict[str, float]:
    """One forward_backward + optimizer_step of mcore and of fsdp2 from the same seed and batch:
    the largest parameter difference after the step, the loss and grad-norm differences."""
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.engines.mcore._hf import per_expert_names
    from underlay.registry import get_device

    cfg = H.tiny_config(family)
    ecfg = H.engine_config(cfg)
    mc = H.make_engine(ecfg)
    fs = FSDP2Engine(ecfg, get_device("cpu"))
    batch = H.make_batch(5)
    before = {n: t.clone() for n, t in mc.named_full_tensors()}
    r1 = mc.forward_backward(batch, H.pg_loss)
    s1 = mc.optimizer_step()
    r2 = fs.forward_backward(batch, H.pg_loss)
    s2 = fs.optimizer_step()
    # clones: at world size 1 a full tensor may share storage with the live parameter
    after_m = {n: t.clone() for n, t in mc.named_full_tensors()}
    after_f = {n: t.clone() for n, t in per_expert_names(dict(fs.named_full_tensors())).items()}
    param1 = max(float((after_m[n] - after_f[n]).abs().max()) for n in after_m)
    norm1, loss1, skipped1 = (
        abs(s1.grad_norm - s2.grad_norm),
        abs(r1.metrics["loss"] - r2.metrics["loss"]),
        s1.skipped,
    )
    moved = max(float((after_m[n] - before[n]).abs().max()) for n in after_m)
    # offload/onload of parameters, gradients (after a backward) and optimizer state is exact
    kept = {n: t.clone() for n, t in after_m.items()}
    mc.forward_backward(batch, H.pg_loss)
    grads = {n: t.clone() for n, t in grad_by_hf_name(mc).items()}
    mc.offload()
    mc.onload()
    exact = all(torch.equal(kept[n], t) for n, t in mc.named_full_tensors())
    exact &= all(torch.equal(grads[n], t) for n, t in grad_by_hf_name(mc).items())
    m2 = mc.optimizer_step()
    fs.forward_backward(batch, H.pg_loss)
    f2 = fs.optimizer_step()
    after2_m = dict(mc.named_full_tensors())
    after2_f = per_expert_names(dict(fs.named_full_tensors()))
    return {
        "param": param1,
        "offload_exact": float(exact),
        "param2": max(float((after2_m[n] - after2_f[n]).abs().max()) for n in after2_m),
        "norm2": abs(m2.grad_norm - f2.grad_norm),
        "moved": moved,
        "loss": loss1,
        "norm": norm1,
        "skipped": float(skipped1),
    }


def export_reload(rank: int, world: int, family: str, tp: int, pp: int, out_dir: str, ep: int = 1) -> float:
    """Export at the given layout; rank 0 reloads with transformers and compares logits with the
    seed-0 HF model (max abs difference; 0.0 on other ranks). float64, MoE in fp32 (transformers'
    grouped expert matmul has no float64 kernel)."""
    from transformers import AutoModelForCausalLM

    from underlay.engines.fsdp2._build import build_model
    from underlay.engines.mcore.weights import MCoreWeightLoader
    from underlay.interfaces import ModelConfig

    cfg = H.tiny_config(family)
    eng = H.make_engine(H.engine_config(cfg, tp=tp, pp=pp, ep=ep))
    path = MCoreWeightLoader().export_hf(eng, out_dir)
    if path is None:
        return 0.0
    dtype = torch.float32 if getattr(cfg, "num_experts", 0) else torch.float64
    reloaded = AutoModelForCausalLM.from_pretrained(str(path)).to(dtype)
    ref = build_model(ModelConfig(hf_config=cfg, seed=0), cfg, meta=False).to(dtype)
    batch = H.make_batch(7)
    a = reloaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    b = ref(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return float((a - b).abs().max())


def load_roundtrip(rank: int, world: int, family: str, tp: int, pp: int, src: str) -> float:
    """Load an exported HF directory with ``load_hf`` into a differently seeded engine at the given
    layout; the max log-prob difference against the HF reference of seed 0."""
    from underlay.engines.mcore.weights import MCoreWeightLoader
    from underlay.interfaces import EngineConfig, ModelConfig

    cfg = H.tiny_config(family)
    base = H.engine_config(cfg, tp=tp, pp=pp)
    ecfg = EngineConfig(
        model=ModelConfig(path=src, seed=0),
        parallel=base.parallel,
        optim=base.optim,
        micro_batch_max_tokens=base.micro_batch_max_tokens,
        param_dtype="float32",
        options=base.options,
    )
    eng = H.make_engine(ecfg)
    report = MCoreWeightLoader().load_hf(eng, src)
    assert not report.missing and not report.unexpected, report
    batch = H.make_batch(8)
    out = eng.infer(batch)
    ref_lp, _, _ = H.hf_reference(cfg, batch)
    return float((out.log_probs.double() - ref_lp).abs().max())


def resume_step(
    rank: int, world: int, family: str, tp: int, pp: int, root: str, phase: str
) -> dict[str, float]:
    """Checkpoint resume through ``CheckpointManager`` under ``root/ckpt``. ``phase="run"``: step 1,
    save, step 2 (the uninterrupted run); ``"resume"``: a fresh engine with other initial weights
    loads the latest checkpoint and takes step 2. Rank 0 writes the full parameters after step 2 by
    HF name to ``root/<phase>_tp<tp>pp<pp>.pt`` (too large for the result pipe); returns the step-2
    loss and grad norm and the global step."""
    import dataclasses
    from pathlib import Path

    from underlay.checkpoint import CheckpointManager

    cfg = H.tiny_config(family)
    ecfg = H.engine_config(cfg, tp=tp, pp=pp)
    if phase == "resume":  # other initial weights: everything after the load must come from the file
        ecfg = dataclasses.replace(ecfg, model=dataclasses.replace(ecfg.model, seed=5))
    eng = H.make_engine(ecfg)
    dp = eng.layout.dp_shard

    def step(seed: int) -> tuple[float, float]:
        full = H.make_batch(seed, b=4)
        mine = full.select(list(range(eng_dp_rank(eng), full.batch_size, dp)))
        res = eng.forward_backward(mine, H.pg_loss)
        out = eng.optimizer_step()
        eng.lr_scheduler_step()
        return res.metrics["loss"], out.grad_norm

    manager = CheckpointManager(str(Path(root) / "ckpt"), eng)
    if phase == "run":
        step(11)
        manager.save(1, {})
    else:
        manager.load()
    loss, norm = step(12)
    params = {n: t.detach().double().cpu().clone() for n, t in eng.named_full_tensors()}
    if rank == 0:
        torch.save(params, Path(root) / f"{phase}_tp{tp}pp{pp}.pt")
    return {"loss": loss, "norm": norm, "step": float(eng.global_step)}


def grad_norm_layouts(
    rank: int, world: int, layouts: list[tuple[str, int, int, dict[str, Any]]], out_dir: str
) -> list[dict[str, float]]:
    """For each ``(family, tp, pp, options)`` in turn (megatron's parallel state is torn down between
    layouts): an engine from seed 0 takes one forward_backward on its data-parallel share of one fixed
    batch and one clipped ``optimizer_step`` (``grad_clip=1.0`` from ``engine_config``). Returns per
    layout the reported grad norm, the float64 HF model's grad norm of the same loss (fp32 for MoE)
    and whether the step was skipped; rank 0 writes the full parameters after the step by HF name to
    ``out_dir/<i>.pt`` (the i-th layout)."""
    from pathlib import Path

    from megatron.core import parallel_state as ps

    results = []
    for i, (family, tp, pp, opts) in enumerate(layouts):
        cfg = H.tiny_config(family)
        eng = H.make_engine(H.engine_config(cfg, tp=tp, pp=pp, **opts))
        dp = eng.layout.dp_shard
        full = H.make_batch(21, b=4)
        eng.forward_backward(full.select(list(range(eng_dp_rank(eng), full.batch_size, dp))), H.pg_loss)
        step = eng.optimizer_step()
        params = {n: t.detach().double().clone() for n, t in eng.named_full_tensors()}
        if rank == 0:
            torch.save(params, Path(out_dir) / f"{i}.pt")
        _, _, ref = H.hf_reference(cfg, full)
        hf_norm = sum(float(g.pow(2).sum()) for g in ref.values()) ** 0.5
        results.append({"norm": step.grad_norm, "hf": hf_norm, "skipped": float(step.skipped)})
        del eng
        ps.destroy_model_parallel()
    return results


def _value_engine(family: str, *, seed: int = 0, path: str | None = None, **sizes: Any) -> Any:
    import dataclasses

    cfg = H.tiny_config(family, classifier_dropout=sizes.pop("dropout", 0.0))
    randomness = sizes.pop("randomness", "off")
    ecfg = H.engine_config(cfg, kind="value", **sizes)
    model = dataclasses.replace(
        ecfg.model, seed=seed, path=path, hf_config=None if path else cfg, training_randomness=randomness
    )
    return cfg, H.make_engine(dataclasses.replace(ecfg, model=model))


def value_layouts(rank: int, world: int, family: str, out_dir: str) -> dict[str, float]:
    """A value model (``kind="value"``, no dropout) at TP2, TP2 + sequence parallelism and PP2 on two
    ranks, one after the other: ``infer`` values, the token-mean value loss of ``forward_backward``
    over packed variable-length micro-batches and every gradient (score head included) against the
    float64 HF token-classification model; ``shifted`` is the error a causal-LM style one-token shift
    of the values would have (the negative control). At PP2: ``export_hf`` -> transformers reload
    (rank 0), and ``load_hf`` of that export and ``load_checkpoint`` of a PP2 checkpoint each into a
    TP2 engine of another seed. A value model built
    from a causal-LM directory takes its backbone from the files and the head from the seed. With
    ``classifier_dropout=0.5`` at TP2 the training values differ from ``infer``'s and agree on both
    TP ranks."""
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from underlay.engines.mcore.weights import MCoreWeightLoader

    out: dict[str, float] = {}
    batch = H.value_batch(31)
    cfg = H.tiny_config(family, classifier_dropout=0.0)
    ref_v, ref_loss, ref_grads = H.hf_value_reference(cfg, batch)
    m = batch.attention_mask.double()
    for tag, sizes in (
        ("tp2", {"tp": 2}),
        ("tp2sp", {"tp": 2, "sequence_parallel": True}),
        ("pp2", {"pp": 2}),
    ):
        _, eng = _value_engine(family, **sizes)
        values = eng.infer(batch).values.double()
        res = eng.forward_backward(batch, H.value_loss)
        grads = grad_by_hf_name(eng)
        out[f"{tag}_values"] = float((values - ref_v).abs().max())
        shifted = torch.cat([torch.zeros_like(values[:, :1]), values[:, :-1]], 1) * m
        out[f"{tag}_shifted"] = float((shifted - ref_v).abs().max())
        out[f"{tag}_loss"] = abs(res.metrics["loss"] - float(ref_loss))
        out[f"{tag}_tokens"] = float(res.loss_tokens - int(batch.loss_mask.sum()))
        out[f"{tag}_names"] = float(set(grads) == set(ref_grads))
        out[f"{tag}_grad_rel"] = max(
            float((grads[n].double() - r).abs().max() / (r.abs().max() + 1e-6)) for n, r in ref_grads.items()
        )
        if tag == "pp2":
            (Path(out_dir) / "ckpt").mkdir(exist_ok=True)
            eng.save_checkpoint(Path(out_dir) / "ckpt")
            path = MCoreWeightLoader().export_hf(eng, str(Path(out_dir) / "value"))
            if path is not None:
                from transformers import AutoModelForTokenClassification

                hf = AutoModelForTokenClassification.from_pretrained(str(path)).double().eval()
                again = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[..., 0]
                out["export_values"] = float((again * m - ref_v).abs().max())
                out["export_class"] = float(type(hf).__name__.endswith("ForTokenClassification"))
        del eng
        ps.destroy_model_parallel()
    dist.barrier()
    # the PP2 checkpoint (dist_checkpointing, head included) resharded into a TP2 engine of another seed
    _, eng = _value_engine(family, seed=3, tp=2)
    out["ckpt_before"] = float((eng.infer(batch).values.double() - ref_v).abs().max())
    eng.load_checkpoint(Path(out_dir) / "ckpt")
    out["ckpt_values"] = float((eng.infer(batch).values.double() - ref_v).abs().max())
    del eng
    ps.destroy_model_parallel()
    # load_hf of the exported value model into a TP2 engine seeded differently
    _, eng = _value_engine(family, seed=3, tp=2)
    report = MCoreWeightLoader().load_hf(eng, str(Path(out_dir) / "value"))
    out["load_report_clean"] = float(not report.missing and not report.unexpected)
    out["load_values"] = float((eng.infer(batch).values.double() - ref_v).abs().max())
    del eng
    ps.destroy_model_parallel()
    # a value model from a causal-LM directory: backbone from the files, head from the seed
    causal = Path(out_dir) / "causal"
    if rank == 0:
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(str(causal))
    dist.barrier()
    _, eng = _value_engine(family, path=str(causal), pp=2)
    from safetensors.torch import load_file

    files = load_file(str(causal / "model.safetensors"))
    full = dict(eng.named_full_tensors())
    out["causal_backbone"] = max(float((full[n] - t).abs().max()) for n, t in files.items() if n in full)
    out["causal_lm_head_dropped"] = float("lm_head.weight" not in full)
    from underlay.engines.mcore._hf import seeded_hf_state, value_hf_config
    from underlay.interfaces import ModelConfig

    vcfg = value_hf_config(cfg)
    head = seeded_hf_state(ModelConfig(hf_config=vcfg, seed=0, kind="value"), vcfg)
    out["causal_head_seeded"] = max(
        float((full[n] - head[n]).abs().max()) for n in ("score.weight", "score.bias")
    )
    del eng
    ps.destroy_model_parallel()
    # dropout kept in training (training_randomness="keep"): the same mask on both TP ranks, none in
    # infer; with the default ("off") training equals infer
    for randomness in ("keep", "off"):
        _, eng = _value_engine(family, tp=2, dropout=0.5, randomness=randomness)
        seen: list[torch.Tensor] = []

        def capture(outputs: Any, b: Any, ctx: Any, seen: list[torch.Tensor] = seen) -> Any:
            seen.append(outputs.values.detach().clone())
            return H.value_loss(outputs, b, ctx)

        res = eng.forward_backward(batch, capture)
        train = torch.cat([v.reshape(-1) for v in seen])
        other = [torch.zeros_like(train) for _ in range(world)]
        dist.all_gather(other, train)
        clean = eng.infer(batch).values
        lm = batch.loss_mask.to(clean.dtype)
        eval_loss = float((0.5 * (clean - batch.extras["ret"]).pow(2) * lm).sum() / lm.sum())
        out[f"dropout_tp_agree_{randomness}"] = float(torch.equal(other[0], other[1]))
        out[f"dropout_loss_change_{randomness}"] = abs(res.metrics["loss"] - eval_loss)
        del eng
        ps.destroy_model_parallel()
    return out


_SYNC_METHODS = frozenset(
    {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy", "unique"}
)


def host_syncs(rank: int, world: int) -> dict[str, Any]:
    """Where the data path of ``forward_backward`` and ``infer`` reads device values on the host.

    The CPU has no device, so the engine's one host->device entry point (``_to_device``) is wrapped
    to return a marked tensor subclass: every tensor computed from the batch after it went to the
    "device" stays marked (``__torch_function__``), and each call on a marked tensor that needs its
    values on the host (``item``, ``tolist``, ``bool``/``int``/``float``, ``nonzero``, ``cpu``, ...:
    a synchronisation on an accelerator) is recorded with its innermost non-torch caller. Returns
    those callers (``file:line function``) per phase, and whether the step's numbers match an
    unwrapped engine's (the marking changes nothing). Also: malformed batches raise ``InvalidInput``
    with their messages before any gradient is accumulated or the step counter moves."""
    import os
    import traceback

    from megatron.core import parallel_state as ps

    from underlay.interfaces import InvalidInput, TokenBatch

    sites: list[str] = []

    class Marked(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if getattr(func, "__name__", "") in _SYNC_METHODS:
                for frame in reversed(traceback.extract_stack()[:-1]):
                    inner = f"{os.sep}torch{os.sep}" in frame.filename or frame.filename.endswith(
                        "_cpu_fixture.py"
                    )
                    if not inner:
                        parts = Path(frame.filename).parts
                        short = "/".join(parts[-3:])
                        sites.append(f"{short}:{frame.lineno} {frame.name} [{func.__name__}]")
                        break
            return super().__torch_function__(func, types, args, kwargs or {})

    from pathlib import Path

    cfg = H.tiny_config("qwen3")
    batch = H.make_batch(41)
    out: dict[str, Any] = {}
    plain = H.make_engine(H.engine_config(cfg))
    ref = plain.forward_backward(batch, H.pg_loss)
    ref_norm = plain.optimizer_step().grad_norm
    del plain
    ps.destroy_model_parallel()
    eng = H.make_engine(H.engine_config(cfg))
    original = eng._to_device
    eng._to_device = lambda t: original(t).as_subclass(Marked)
    phases: dict[str, list[str]] = {}
    res = eng.forward_backward(batch, H.pg_loss)
    phases["forward_backward"], sites[:] = list(sites), []
    step = eng.optimizer_step()
    phases["optimizer_step"], sites[:] = list(sites), []
    eng.infer(batch, with_entropy=True)
    phases["infer"], sites[:] = list(sites), []
    out["phases"] = phases
    out["same_step"] = float(
        abs(res.metrics["loss"] - ref.metrics["loss"]) < 1e-7
        and res.loss_tokens == ref.loss_tokens
        and abs(step.grad_norm - ref_norm) < 1e-6
    )
    # malformed input: the error and its message, before any state changes
    step_before = eng.global_step
    good = H.make_batch(42)
    bad = {
        "empty_row": TokenBatch(
            good.input_ids, good.attention_mask * torch.tensor([[1], [0], [1], [1]]), good.loss_mask
        ),
        "id_range": TokenBatch(good.input_ids + H.VOCAB, good.attention_mask, good.loss_mask),
        "negative_id": TokenBatch(good.input_ids - H.VOCAB, good.attention_mask, good.loss_mask),
        "dtype": TokenBatch(good.input_ids.float(), good.attention_mask, good.loss_mask),
        "empty": TokenBatch(good.input_ids[:0], good.attention_mask[:0], good.loss_mask[:0]),
    }
    messages: dict[str, str] = {}
    for name, b in bad.items():
        for call in ("forward_backward", "infer"):
            try:
                if call == "forward_backward":
                    eng.forward_backward(b, H.pg_loss)
                else:
                    eng.infer(b)
                messages[f"{name}/{call}"] = "no error"
            except InvalidInput as exc:
                messages[f"{name}/{call}"] = str(exc)
    out["messages"] = messages
    out["grads_untouched"] = float(
        all(float(p.main_grad.abs().max()) == 0.0 for c in eng.chunks for p in c.parameters())
    )
    out["step_unchanged"] = float(eng.global_step == step_before)
    del eng
    ps.destroy_model_parallel()
    out["value_step"] = value_step_vs_fsdp2(rank, world)  # shares this process (one spawn fewer)
    return out


def value_step_vs_fsdp2(rank: int, world: int) -> dict[str, float]:
    """One forward_backward + clipped AdamW step of a value model (qwen3, no dropout) on mcore and on
    fsdp2 from the same seed and batch: the largest parameter difference after the step (every
    parameter, score head included, by HF name), how far the step moved them, the loss and
    grad-norm differences, and whether both engines hold the same HF names."""
    import copy

    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.registry import get_device

    cfg = H.tiny_config("qwen3", classifier_dropout=0.0)
    mc = H.make_engine(H.engine_config(copy.deepcopy(cfg), kind="value"))
    fs = FSDP2Engine(H.engine_config(copy.deepcopy(cfg), kind="value"), get_device("cpu"))
    batch = H.value_batch(51)
    before = {n: t.clone() for n, t in mc.named_full_tensors()}
    r1 = mc.forward_backward(batch, H.value_loss)
    s1 = mc.optimizer_step()
    r2 = fs.forward_backward(batch, H.value_loss)
    s2 = fs.optimizer_step()
    after_m = {n: t.clone() for n, t in mc.named_full_tensors()}
    after_f = {n: t.clone() for n, t in fs.named_full_tensors()}
    return {
        "names": float(set(after_m) == set(after_f) and "score.weight" in after_m),
        "param": max(float((after_m[n] - after_f[n]).abs().max()) for n in after_m),
        "moved": max(float((after_m[n] - before[n]).abs().max()) for n in after_m),
        "head_moved": float((after_m["score.weight"] - before["score.weight"]).abs().max()),
        "loss": abs(r1.metrics["loss"] - r2.metrics["loss"]),
        "value_metric": abs(r1.metrics["value"] - r2.metrics["value"]),
        "norm": abs(s1.grad_norm - s2.grad_norm),
        "skipped": float(s1.skipped or s2.skipped),
    }
