"""Per-rank bodies of the mcore tests (module level so ``run_distributed`` can pickle them)."""

from __future__ import annotations

from typing import Any

import torch

from tests.mcore import _helpers as H


def grad_by_hf_name(eng: Any) -> dict[str, torch.Tensor]:
    """Full gradients by HF name: megatron's ``main_grad`` gathered like the weights."""
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
    return {
        "lp": float((out.log_probs.double() - ref_mine).abs().max()),
        "loss": abs(res.metrics["loss"] - float(ref_loss)),
        "grad_rel": gerr,
        "n": len(grads),
        "etp": eng.layout.etp,
    }


def eng_dp_rank(eng: Any) -> int:
    import torch.distributed as dist

    group = eng.layout.groups.dp
    return dist.get_rank(group) if group is not None else 0


def wrong_fusion(rank: int, world: int, which: str) -> float:
    """Max log-prob error against HF when the weight map fuses in a wrong order (negative control):
    ``qkv``: plain ``[q; k; v]`` concatenation; ``gate_up``: ``[up; gate]``."""
    import underlay.engines.mcore.weightmap as wm

    if which == "qkv":
        wm.fuse_qkv = lambda q, k, v, groups: torch.cat([q, k, v], 0)  # type: ignore[assignment]
    else:
        original = wm.fuse_gate_up
        wm.fuse_gate_up = lambda gate, up, r, n: original(up, gate, r, n)  # type: ignore[assignment]
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
