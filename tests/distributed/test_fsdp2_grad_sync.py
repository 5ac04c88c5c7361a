"""fsdp2 ``grad_sync``: reducing gradients once per ``forward_backward`` (``"per_step"``) gives the
gradients, the clipped norm and the optimizer step of reducing after every micro-batch, at 1 and 2 gloo
ranks, with several micro-batches of different lengths: fp32 (also against the float64 reference),
bf16 compute with fp32 reduction (FSDP2's reduce-dtype accumulation) under full recomputation and
TiledMLP, LoRA with the host-offloaded AdamW, a value model with FSDP's CPU offload. Also: no sharded
gradient exists before the last micro-batch, a second call before the optimizer step syncs per
micro-batch, and a step that fails in the loss or in the middle of backward leaves nothing behind (the
next one-micro-batch call syncs, later steps equal the other engine's). One spawn per world size; the
rest of the fsdp2 suite runs with the default, which is ``"per_step"`` wherever it fits."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H

SYNCS = ("per_step", "per_micro_batch")
TOL = 2e-5  # fp32 engine vs float64 reference (as test_fsdp2_engine)


class _FailInBackward(torch.autograd.Function):
    """Identity in forward; raises in backward (a failure in the middle of the model's backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure in backward")


def _has_grads(engine: Any) -> bool:
    """Whether a sharded gradient exists (between micro-batches ``model.parameters()`` may be the
    unsharded parameters, which FSDP keeps registered while they stay unsharded)."""
    from underlay.engines.fsdp2.engine import _fsdp_params

    return any(fp.sharded_param.grad is not None for fp in _fsdp_params(engine.model))


class _Probe:
    """A loss function that records, at each micro-batch, whether sharded gradients already exist."""

    def __init__(self, engine: Any, loss_fn: Callable[..., Any]) -> None:
        self.engine, self.loss_fn = engine, loss_fn
        self.seen: list[bool] = []

    def __call__(self, outputs: Any, batch: Any, ctx: Any) -> Any:
        self.seen.append(_has_grads(self.engine))
        return self.loss_fn(outputs, batch, ctx)


def _grads(engine: Any) -> dict[str, torch.Tensor]:
    return {
        n: H.local(p.grad).detach().clone() for n, p in engine.model.named_parameters() if p.grad is not None
    }


def _params(engine: Any) -> dict[str, torch.Tensor]:
    from underlay.engines.fsdp2._build import hf_name

    return {hf_name(n): t.detach().cpu().clone() for n, t in engine.named_full_parameters()}


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference relative to the largest magnitude of ``b`` (inf when the keys differ)."""
    if set(a) != set(b) or not a:
        return math.inf
    keys = [k for k in a if b[k].numel()]  # a rank's shard of a small parameter may be empty
    if any(a[k].shape != b[k].shape for k in a):
        return math.inf
    scale = max((float(b[k].abs().max()) for k in keys), default=0.0) or 1.0
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in keys), default=0.0) / scale


def _pair(
    batch: Any,
    loss_fn: Callable[..., Any],
    hf: Any,
    options: dict[str, Any] | None = None,
    setup: Callable[[Any, Any], None] | None = None,
    **cfg: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One engine per ``grad_sync`` mode, same seed and batch (``setup(engine, batch)`` after the
    build): one step each. Returns the engines and the figures comparing them."""
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.registry import get_device

    engines, probes, grads, results = {}, {}, {}, {}
    for sync in SYNCS:
        # FSDP2 at every world size: the world-size-1 path (single_device) has no gradient sync
        opts = {"single_device": False, **(options or {}), "grad_sync": sync}
        ec = H.engine_config(hf, options=opts, **cfg)
        engine = FSDP2Engine(ec, get_device("cpu"))
        if setup is not None:
            setup(engine, batch)
        probes[sync] = _Probe(engine, loss_fn)
        res = engine.forward_backward(batch, probes[sync])
        grads[sync] = _grads(engine)
        no_grad = sorted(n for n, p in engine.model.named_parameters() if p.grad is None)
        results[sync] = (res, engine.optimizer_step())
        engines[sync] = engine
    (rs, ss), (rm, sm) = results["per_step"], results["per_micro_batch"]
    figures = {
        "resolved": [e.resolved_options.grad_sync for e in engines.values()],
        "micro_batches": rs.num_micro_batches,
        "loss": abs(rs.metrics["loss"] - rm.metrics["loss"]),
        "grads": _rel(grads["per_step"], grads["per_micro_batch"]),
        "norm": abs(ss.grad_norm - sm.grad_norm) / max(sm.grad_norm, 1e-30),
        "params": H.max_diff(_params(engines["per_step"]), _params(engines["per_micro_batch"])),
        "seen_per_step": probes["per_step"].seen,
        "seen_per_mb": probes["per_micro_batch"].seen,
        "no_grad": no_grad,  # of the per_micro_batch engine; the per_step one has the same (grads)
    }
    return engines, figures


def _fail_in_backward(engine: Any, at_call: int) -> Any:
    """Make the first decoder layer's ``at_call``-th forward output raise in its backward (after the
    later layers' backward ran); returns the hook handle."""
    calls = [0]

    def hook(_module: Any, _args: Any, output: Any) -> Any:
        calls[0] += 1
        if calls[0] != at_call:
            return None
        if isinstance(output, tuple):
            return (_FailInBackward.apply(output[0]), *output[1:])
        return _FailInBackward.apply(output)

    return engine.model.model.layers[0].register_forward_hook(hook)


def _late_mlps(engine: Any, batch: Any) -> None:
    """The first decoder layer's MLP takes part only in the last micro-batch of ``batch``, the second
    layer's never (their outputs are replaced by their inputs): parameters of a layer whose first
    gradient of the step arrives in the syncing micro-batch, or never, next to parameters (attention)
    that have one from the first micro-batch on."""
    n = len(engine._plan(batch))
    layers = engine.model.model.layers
    calls = [0, 0]

    def skip(i: int) -> Callable[..., Any]:
        def hook(_module: Any, args: Any, _output: Any) -> Any:
            calls[i] += 1
            return None if i == 0 and calls[i] == n else args[0] * 1.0

        return hook

    for i in (0, 1):
        layers[i].mlp.register_forward_hook(skip(i))


def _failing_loss(at_call: int) -> Callable[..., Any]:
    calls = [0]

    def loss(outputs: Any, batch: Any, ctx: Any) -> Any:
        calls[0] += 1
        if calls[0] == at_call:
            raise ValueError("injected failure in the loss")
        return H.pg_loss(outputs, batch, ctx)

    return loss


def job(rank: int, world: int) -> dict[str, Any]:
    import copy

    from underlay.interfaces import LoraConfig, ModelConfig

    out: dict[str, Any] = {}

    def local(seed: int, n: int) -> Any:  # n sequences per rank, lengths 4..12; 20-token micro-batches
        return H.shard(H.global_batch(seed, n=n * world), rank, world)

    # fp32: per_step == per_micro_batch == the float64 reference on the whole batch
    gb = H.global_batch(21, n=6 * world)
    engines, out["fp32"] = _pair(H.shard(gb, rank, world), H.pg_loss, H.llama_config())
    ec = H.engine_config(H.llama_config())
    ref_loss, ref_norm, ref_w = H.reference_step(H.reference_model(H.llama_config(), 0), gb, ec)
    out["fp32_ref_weights"] = H.max_diff(_params(engines["per_step"]), ref_w)

    # then, on the same two engines: failures, a one-micro-batch call, a second call per step
    st, mb = engines["per_step"], engines["per_micro_batch"]
    failing = local(31, 6)
    try:
        st.forward_backward(failing, _failing_loss(at_call=2))
        out["fail_loss"] = "no error"
    except ValueError as exc:
        out["fail_loss"] = str(exc)
    handle = _fail_in_backward(st, at_call=2)
    try:
        st.forward_backward(failing, H.pg_loss)
        out["fail_backward"] = "no error"
    except RuntimeError as exc:
        out["fail_backward"] = str(exc)
    finally:
        handle.remove()
    out["fail_micro_batches"] = len(st._plan(failing))
    out["no_grads_after_failures"] = not _has_grads(st)
    one = local(41, 1)  # one sequence per rank: one micro-batch, so per_step sets nothing itself
    for e in (st, mb):
        out["one_micro_batches"] = e.forward_backward(one, H.pg_loss).num_micro_batches
    out["one_synced"] = all(p.grad is not None for p in st.model.parameters())
    second = local(51, 6)
    probe = _Probe(st, H.pg_loss)
    st.forward_backward(second, probe)
    mb.forward_backward(second, H.pg_loss)
    out["second_seen"] = probe.seen  # gradients pending: this call synced per micro-batch
    out["second_grads"] = _rel(_grads(st), _grads(mb))
    out["second_norms"] = [e.optimizer_step().grad_norm for e in (st, mb)]
    probe = _Probe(st, H.pg_loss)
    third = local(61, 6)
    st.forward_backward(third, probe)
    mb.forward_backward(third, H.pg_loss)
    out["third_seen"] = probe.seen
    out["third_norms"] = [e.optimizer_step().grad_norm for e in (st, mb)]
    out["after_failures_params"] = H.max_diff(_params(st), _params(mb))
    del engines, st, mb

    # bf16 compute, fp32 reduction (FSDP2 accumulates the unsharded gradients in fp32), with MLP
    # parameters that get their first gradient in the last micro-batch, or none
    _, out["late"] = _pair(
        local(75, 6),
        H.pg_loss,
        H.llama_config(),
        setup=_late_mlps,
        param_dtype="bfloat16",
        reduce_dtype="float32",
    )
    if world == 1:  # the rest once, at 2 ranks (the fsdp2 suite runs the per_step default at both)
        out["ref"] = (ref_loss, ref_norm)
        return out
    # bf16/fp32 LoRA (frozen base: no gradients there) with full recomputation, TiledMLP and the
    # host-offloaded AdamW
    hf = H.llama_config()
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    _, out["bf16_lora"] = _pair(
        local(71, 6),
        H.pg_loss,
        hf,
        {"optimizer_offload": True},
        model=ModelConfig(hf_config=hf, seed=0, tiled_mlp_tiles=2, lora=lora),
        recompute="full",
        param_dtype="bfloat16",
        reduce_dtype="float32",
    )
    # a value model with FSDP's CPU offload (sharded gradients on the host)
    hv = H.llama_config(classifier_dropout=0.0)
    _, out["value"] = _pair(
        local(91, 6),
        H.value_loss,
        hv,
        model=ModelConfig(hf_config=copy.deepcopy(hv), kind="value"),
        cpu_offload=True,
    )
    out["ref"] = (ref_loss, ref_norm)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_per_step_grad_sync_equals_per_micro_batch(world: int) -> None:
    for r in run_distributed(job, world, timeout_s=400):
        cases = [("fp32", 1e-6), ("late", 1e-5)]
        if world == 2:
            cases += [("bf16_lora", 1e-5), ("value", 1e-6)]
        for case, tol in cases:
            f = r[case]
            assert f["resolved"] == list(SYNCS), (case, f)
            assert f["micro_batches"] >= 2, (case, f)  # several micro-batches, of different lengths
            # per_step: no sharded gradient before the last micro-batch; per_micro_batch: from the 2nd on
            assert not any(f["seen_per_step"]), (case, f)
            assert f["seen_per_mb"] == [False] + [True] * (len(f["seen_per_mb"]) - 1), (case, f)
            assert f["grads"] <= tol and f["norm"] <= tol and f["loss"] <= 1e-6, (case, f)
            assert f["params"] <= 1e-6, (case, f)  # lr 1e-3, clipped to 0.5
        late = r["late"]["no_grad"]
        assert any("layers.1.mlp" in n for n in late) and not any("layers.0.mlp" in n for n in late), late
        assert r["fp32_ref_weights"] <= TOL, r
        assert r["fail_micro_batches"] >= 3, r  # the failures hit the middle of the step
        assert r["fail_loss"] == "injected failure in the loss", r
        assert "injected failure in backward" in r["fail_backward"], r
        assert r["no_grads_after_failures"] and r["one_micro_batches"] == 1 and r["one_synced"], r
        assert all(r["second_seen"]) and len(r["second_seen"]) >= 2, r
        assert r["second_grads"] <= 1e-6, r
        assert not any(r["third_seen"]) and len(r["third_seen"]) >= 2, r
        for a, b in (r["second_norms"], r["third_norms"]):
            assert abs(a - b) <= 1e-6 * b, r
        assert r["after_failures_params"] <= 1e-6, r
