"""Per-rank bodies of the mcore scale tests (config pass-through, uneven pipeline stages, partial
recompute, gradient-reduce/parameter-gather overlap): one 2-rank process group runs every
layout in turn, megatron's parallel state torn down between layouts."""

from __future__ import annotations

from typing import Any

from tests.mcore import _helpers as H
from tests.mcore._workers import eng_dp_rank, grad_by_hf_name


def _against_hf(eng: Any, cfg: Any, seed: int) -> dict[str, float]:
    """infer log-probs, the loss and every gradient of one forward_backward on this rank's dp share of
    a 4-row batch, against the float64 HF model: max abs log-prob and loss errors, max relative
    gradient error."""
    dp = eng.layout.dp_shard
    full = H.make_batch(seed, b=4)
    rows = list(range(eng_dp_rank(eng), full.batch_size, dp))
    mine = full.select(rows)
    out = eng.infer(mine)
    ref_lp, ref_loss, ref_grads = H.hf_reference(cfg, full)
    res = eng.forward_backward(mine, H.pg_loss)
    grads = grad_by_hf_name(eng)
    gerr = max(
        float((g.double() - ref_grads[n]).abs().max() / (ref_grads[n].abs().max() + 1e-6))
        for n, g in grads.items()
    )
    return {
        "lp": float((out.log_probs.double() - ref_lp[rows]).abs().max()),
        "loss": abs(res.metrics["loss"] - float(ref_loss)),
        "grad_rel": gerr,
    }


def _layer_calls(eng: Any) -> tuple[list[int], Any]:
    """Forward-call counters of every decoder layer of this rank's chunks (``counts[i]`` for the
    ``i``-th local layer) and a function that removes the hooks."""
    layers = [layer for c in eng.chunks for layer in c.module.decoder.layers]
    counts = [0] * len(layers)
    handles = []
    for i, layer in enumerate(layers):

        def hook(*_: Any, i: int = i) -> None:
            counts[i] += 1

        handles.append(layer.register_forward_pre_hook(hook))

    def remove() -> None:
        for h in handles:
            h.remove()

    return counts, remove


def pipeline_phase(rank: int, world: int) -> dict[str, Any]:
    """pp=2 on 2 ranks. (1) Uneven stages (1 layer first, 3 last) with block recompute of 1 layer per
    chunk and pass-through fields in all three megatron configs; (2) even stages with uniform
    recompute in units of 2 layers. Each against HF, with the fields read back from megatron and
    the forward calls per local layer of one training micro-batch counted (a recomputed layer runs
    its forward twice)."""
    import dataclasses

    from megatron.core import parallel_state as ps

    cfg = H.tiny_config("qwen3")
    out: dict[str, Any] = {}
    layouts = {
        "uneven_block": dict(
            transformer={
                "num_layers_in_first_pipeline_stage": 1,
                "num_layers_in_last_pipeline_stage": 3,
                "recompute_method": "block",
                "recompute_num_layers": 1,
            },
            optimizer={"log_num_zeros_in_grad": True},
            ddp={"check_for_nan_in_grad": True},
        ),
        "uniform2": dict(transformer={"recompute_method": "uniform", "recompute_num_layers": 2}),
    }
    for name, opts in layouts.items():
        ecfg = dataclasses.replace(H.engine_config(cfg, pp=2, **opts), recompute="full")
        eng = H.make_engine(ecfg)
        r = _against_hf(eng, cfg, seed=31)
        tf = eng._tf_config
        r["read_back"] = {
            "first": tf.num_layers_in_first_pipeline_stage,
            "last": tf.num_layers_in_last_pipeline_stage,
            "method": tf.recompute_method,
            "unit": tf.recompute_num_layers,
            "granularity": tf.recompute_granularity,
            "zeros": eng._optimizer.config.log_num_zeros_in_grad,
            "nan_check": eng.chunks[0].ddp_config.check_for_nan_in_grad,
        }
        first_layers = [int(layer.layer_number) for c in eng.chunks for layer in c.module.decoder.layers]
        r["layers"] = first_layers
        counts, remove = _layer_calls(eng)
        one = H.make_batch(32, b=1, s=8)
        eng.zero_grad()
        eng.forward_backward(one, H.pg_loss)
        remove()
        eng.zero_grad()
        r["calls"] = counts
        out[name] = r
        del eng
        ps.destroy_model_parallel()
    return out


def overlap_phase(rank: int, world: int) -> dict[str, Any]:
    """dp=2 on 2 ranks, three optimizer steps of the same batches with the gradient reduction and the
    parameter all-gather overlapped or not: ``both`` (distributed optimizer, overlap_grad_reduce +
    overlap_param_gather) against ``off`` (no overlap), ``allreduce`` (overlap_grad_reduce without
    the distributed optimizer) against ``allreduce_off``. Per variant: the full parameters read
    right after each step (before any forward: a deferred all-gather must be finished by the read),
    the log-probs of an ``infer`` after the last step, the grad norms; plus whether a second
    ``forward_backward`` before the step is refused under overlap and ``zero_grad`` drains a started
    reduction."""
    import torch
    from megatron.core import parallel_state as ps

    from underlay.interfaces import InvalidInput

    cfg = H.tiny_config("llama")
    # each overlapped variant against its baseline without overlap
    variants = {
        "off": {},
        "both": {"overlap_grad_reduce": True, "overlap_param_gather": True},
        "allreduce_off": {"distributed_optimizer": False},
        "allreduce": {"overlap_grad_reduce": True, "distributed_optimizer": False},
    }
    baseline = {"both": "off", "allreduce": "allreduce_off"}
    out: dict[str, Any] = {}
    for name, opts in variants.items():
        eng = H.make_engine(H.engine_config(cfg, **opts))
        dp_rank = eng_dp_rank(eng)
        params: list[dict[str, torch.Tensor]] = []
        norms: list[float] = []
        init = {n: t.clone() for n, t in eng.named_full_tensors()}
        for step in range(3):
            full = H.make_batch(40 + step, b=4)
            eng.forward_backward(full.select([dp_rank, dp_rank + 2]), H.pg_loss)
            norms.append(eng.optimizer_step().grad_norm)
            if step == 2:  # steps 0 and 1: the next forward's pre-hooks gather the parameters
                params.append({n: t.clone() for n, t in eng.named_full_tensors()})
        lp = eng.infer(H.make_batch(50, b=2)).log_probs.clone()
        refused = ""
        if opts:
            one = H.make_batch(51, b=1)
            eng.forward_backward(one, H.pg_loss)
            try:
                eng.forward_backward(one, H.pg_loss)
            except InvalidInput as e:
                refused = str(e)
            eng.zero_grad()  # drains the reduction the first call started
            eng.forward_backward(one, H.pg_loss)  # a fresh accumulation runs
            eng.zero_grad()
        out[name] = {"params": params, "init": init, "lp": lp, "norms": norms, "refused": refused}
        del eng
        ps.destroy_model_parallel()
    res: dict[str, Any] = {}
    for name, ref in baseline.items():
        r, base = out[name], out[ref]
        diffs = [
            max(float((a[n] - b[n]).abs().max()) for n in a) for a, b in zip(r["params"], base["params"])
        ]
        res[name] = {
            "param_diff": max(diffs),
            "lp_diff": float((r["lp"] - base["lp"]).abs().max()),
            "norm_diff": max(abs(a - b) for a, b in zip(r["norms"], base["norms"])),
            "moved": max(float((base["params"][0][n] - base["init"][n]).abs().max()) for n in base["init"]),
            "refused": r["refused"],
        }
    return res


def all_phases(rank: int, world: int) -> dict[str, Any]:
    """Every phase in one 2-rank process group (one spawn for the test module)."""
    return {"pipeline": pipeline_phase(rank, world), "overlap": overlap_phase(rank, world)}
