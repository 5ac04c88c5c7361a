"""A failed ``forward_backward`` at pp > 1 (``docs/reliability.md`` §6): the ``loss_fn`` runs on the last
pipeline stage only, yet every rank returns promptly, raises the same exception, keeps no gradient, and
the next good step equals, bit for bit, the step of an engine that never failed.

One gloo process group runs its layouts in turn (megatron's parallel state is torn down
between engines); each layout builds a reference engine (one good step) and then the engine under test
(a good call before each failing call: a call whose ``loss_fn`` raises on its second micro-batch, one
whose ``loss_fn`` returns a Python float there, three whose model forward raises there (a forward
pre-hook on a decoder layer, ``SITES``: the first stage's first layer, the last stage's first chunk,
its last layer); then an ``infer`` whose first stage's model raises, and the same good step as the
reference)."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("megatron.core")

import torch

from tests.mcore import _helpers as H
from tests.mcore.test_mcore_conformance import fixture_launcher
from underlay.interfaces import LossContext, TokenBatch

pytestmark = [pytest.mark.mcore, pytest.mark.distributed]


def _full_rows(seed: int, n: int) -> TokenBatch:
    """``n`` rows of 12 tokens (no padding): at ``micro_batch_max_tokens=24`` two rows per micro-batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, H.VOCAB, (n, 12), generator=g)
    attn = torch.ones_like(ids)
    loss = attn.clone()
    loss[:, :2] = 0
    return TokenBatch(ids, attn, loss, {"adv": torch.randn(n, generator=g)})


def _mine(eng: Any, batch: TokenBatch) -> TokenBatch:
    """This data-parallel rank's rows of ``batch`` (strided)."""
    from megatron.core import parallel_state as ps

    dp = eng.layout.dp_shard
    return batch.select(list(range(ps.get_data_parallel_rank(), batch.batch_size, dp)))


def _failing(bad_return: bool, only_dp_rank: int | None, failed: list[bool]) -> Any:
    """A ``loss_fn`` that fails on micro-batch 1 (of ranks of data-parallel rank ``only_dp_rank``, or
    everywhere): raises ``RuntimeError``, or returns a Python float (``InvalidInput``); appends to
    ``failed`` when it fails here."""
    from megatron.core import parallel_state as ps

    def loss_fn(outputs: Any, batch: TokenBatch, ctx: LossContext) -> Any:
        loss, metrics = H.pg_loss(outputs, batch, ctx)
        here = only_dp_rank is None or ps.get_data_parallel_rank() == only_dp_rank
        if ctx.micro_batch == 1 and here:
            failed.append(True)
            if bad_return:
                return float(loss), metrics
            raise RuntimeError("injected loss_fn failure")
        return loss, metrics

    return loss_fn


def _failing_layer(eng: Any, case: str, only_dp_rank: int | None, failed: list[bool]) -> Any:
    """On the ranks of the pipeline stage of ``SITES[case]`` (and data-parallel rank ``only_dp_rank``,
    or every one), a forward pre-hook on that site's decoder layer that raises ``RuntimeError`` on the
    layer's second call (micro-batch 1: one call per micro-batch) and appends to ``failed``; the hook's
    handle, ``None`` on the other ranks."""
    from megatron.core import parallel_state as ps

    from underlay.engines.mcore._chunks import unwrap

    stage, chunk, index = SITES[case]
    here = only_dp_rank is None or ps.get_data_parallel_rank() == only_dp_rank
    if ps.get_pipeline_model_parallel_rank() != stage or not here:
        return None
    layer = unwrap(eng._chunks[chunk]).decoder.layers[index]
    calls = [0]

    def hook(module: Any, args: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            failed.append(True)
            raise RuntimeError(f"injected model failure on stage {stage}")

    return layer.register_forward_pre_hook(hook)


# model-failure case -> (pipeline stage, model chunk, decoder layer of the chunk) that raises: the first
# stage's first layer (no received input), the last stage's first chunk (with vpp2 a chunk that
# receives an input and sends an output; without, the last chunk), the last stage's last layer
SITES = {"model_first": (0, 0, 0), "model_mid": (1, 0, 0), "model_last": (1, -1, -1)}
# case -> (the pipeline stage where it fails, the start of the exception every rank raises)
CASES = {
    "raise": (1, "RuntimeError: injected loss_fn failure"),
    "bad_return": (1, "InvalidInput"),
    **{
        case: (site[0], f"RuntimeError: injected model failure on stage {site[0]}")
        for case, site in SITES.items()
    },
}


def _grad_abs_max(eng: Any) -> float:
    worst = 0.0
    for p in eng.model.parameters():
        for g in (p.grad, getattr(p, "main_grad", None)):
            if g is not None and g.numel():
                worst = max(worst, float(g.detach().abs().max()))
    return worst


def _step(eng: Any, seed: int) -> tuple[float, list[torch.Tensor]]:
    """One good step over ``make_batch(seed)``: the grad norm and this rank's parameters after it."""
    eng.forward_backward(_mine(eng, H.make_batch(seed, b=4)), H.pg_loss)
    norm = eng.optimizer_step().grad_norm
    return norm, [p.detach().clone() for p in eng.model.parameters()]


def job_failed_step(rank: int, world: int, layouts: list[dict[str, Any]], skip_drop: bool) -> list[Any]:
    """Every rank, per layout: the reference step, then the failing calls and the step after them.
    ``skip_drop`` (the negative control) makes the engine keep its gradients after a failure."""
    from megatron.core import parallel_state as ps

    from underlay.engines.mcore._optim import MCoreOptim

    if skip_drop:
        MCoreOptim._drop_grads = lambda self: None  # type: ignore[method-assign]
    results = []
    for sizes in layouts:
        opts = dict(sizes.pop("options", {}))
        only = sizes.pop("only_dp_rank", None)
        cfg = H.engine_config(H.tiny_config("llama"), **sizes, **opts)
        ref = H.make_engine(cfg)
        ref_norm, ref_params = _step(ref, 7)
        del ref
        ps.destroy_model_parallel()
        eng = H.make_engine(cfg)
        out: dict[str, Any] = {
            "layout": sizes,
            "stage": ps.get_pipeline_model_parallel_rank(),
            "fails_here": only is None or ps.get_data_parallel_rank() == only,
        }
        for case in CASES:
            out[f"{case}_before"] = None
            if not opts.get("overlap_grad_reduce"):  # (overlap allows one call per step)
                eng.forward_backward(_mine(eng, H.make_batch(3, b=4)), H.pg_loss)  # to be dropped too
                out[f"{case}_before"] = _grad_abs_max(eng)
            start = time.monotonic()
            here: list[bool] = []
            loss_fn, hook = H.pg_loss, None
            if case.startswith("model_"):
                hook = _failing_layer(eng, case, only, here)
            else:
                loss_fn = _failing(case == "bad_return", only, here)
            try:
                rows = _mine(eng, _full_rows(5, 4 * eng.layout.dp))
                eng.forward_backward(rows, loss_fn)
                out[case] = "no error"
            except Exception as exc:
                notes = " ".join(getattr(exc, "__notes__", []))
                out[case] = f"{type(exc).__name__}: {exc} {notes}"
            finally:
                if hook is not None:
                    hook.remove()
            out[f"{case}_seconds"] = time.monotonic() - start
            out[f"{case}_here"] = bool(here)
            out[f"{case}_grads"] = _grad_abs_max(eng)
        # infer: the model forward raises on the first stage (no gradient involved)
        here_infer: list[bool] = []
        hook = _failing_layer(eng, "model_first", only, here_infer)
        start = time.monotonic()
        try:
            eng.infer(_mine(eng, _full_rows(5, 4 * eng.layout.dp)))
            out["infer"] = "no error"
        except Exception as exc:
            notes = " ".join(getattr(exc, "__notes__", []))
            out["infer"] = f"{type(exc).__name__}: {exc} {notes}"
        finally:
            if hook is not None:
                hook.remove()
        out["infer_seconds"] = time.monotonic() - start
        out["infer_here"] = bool(here_infer)
        norm, params = _step(eng, 7)
        out["norm_equal"] = norm == ref_norm
        out["params_equal"] = len(params) == len(ref_params) and all(
            torch.equal(a, b) for a, b in zip(params, ref_params)
        )
        del eng
        ps.destroy_model_parallel()
        results.append(out)
    return results


def _check(results: list[list[dict[str, Any]]]) -> None:
    for per_rank in results:
        for r in per_rank:
            for case, (_, error) in CASES.items():
                assert r[f"{case}_before"] is None or r[f"{case}_before"] > 0.0, (case, r)
                # every rank raises the failing rank's exception; the others are told who raised it
                assert r[case].startswith(error), (case, r)
                # the schedule ran to its end: far below the group timeout (300 s)
                assert r[f"{case}_seconds"] < 60, (case, r)
                assert r[f"{case}_grads"] == 0.0, (case, r)
            assert r["infer"].startswith("RuntimeError: injected model failure on stage 0"), r
            assert r["infer_seconds"] < 60, r
            assert r["norm_equal"] and r["params_equal"], r
    for i in range(len(results[0])):  # per layout
        rows = [per_rank[i] for per_rank in results]
        assert {r["stage"] for r in rows} == {0, 1}, rows
        for r in rows:  # a rank that did not fail is told which rank and stage did
            for case, (stage, _) in CASES.items():
                told = f"(pipeline stage {stage} of 2), not on this rank" in r[case]
                assert told != r[f"{case}_here"], (case, r)
                assert r[f"{case}_here"] == (r["stage"] == stage and r["fails_here"]), (case, r)
            told = "infer: raised on rank" in r["infer"] and "(pipeline stage 0 of 2)" in r["infer"]
            assert told != r["infer_here"], r
            assert r["infer_here"] == (r["stage"] == 0 and r["fails_here"]), r


def test_mcore_failed_step_pp2() -> None:
    """4 ranks: tp2 x pp2 with sequence parallelism (the loss_fn, or the model forward of one stage,
    fails on both TP ranks of the stage; the first stage's stand-in holds T'/tp tokens), pp2 x vpp2 x
    dp2 (interleaved schedule, fixed shapes; the failures on data-parallel rank 1 only) and pp2 x dp2
    with ``overlap_grad_reduce`` (failures on dp rank 1 only, the last micro-batch's bucket reductions
    started during the backward on dp rank 0). Every rank raises the failing rank's exception
    promptly, keeps no gradient, and the next step is bit-equal to a fresh engine's.

    Negative controls: ``job_failed_step(..., skip_drop=True)`` (no gradient dropped) fails
    ``_check`` (gradients left, unequal step); on the code before the fix, the ranks whose loss_fn or
    model did not fail wait in the pipeline transfers until the group timeout; a stand-in not tied
    to the received input leaves the previous stage waiting for its gradient; one not tied to the
    parameters leaves dp rank 0 waiting for bucket reductions that dp rank 1 never starts (overlap)."""
    layouts = [
        {"tp": 2, "pp": 2, "options": {"sequence_parallel": True}},
        {"pp": 2, "vpp": 2, "only_dp_rank": 1},
        {"pp": 2, "only_dp_rank": 1, "options": {"overlap_grad_reduce": True}},
    ]
    _check(fixture_launcher(job_failed_step, 4, layouts, False))
