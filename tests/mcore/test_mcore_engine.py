"""The megatron-core engine on the CPU (gloo, fp32) under the test-only fixture, against float64
Hugging Face references. Every multi-process check runs in spawned processes: the fixture changes
global torch behaviour and must never enter the pytest process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from tests._dist import run_distributed
from tests.mcore import _workers as W

pytestmark = [pytest.mark.mcore, pytest.mark.distributed, pytest.mark.slow]

LP_TOL = 1e-5
LOSS_TOL = 1e-5
GRAD_TOL = 1e-4


@pytest.mark.parametrize(
    ("family", "tp", "pp", "ep", "world", "opts", "sizes"),
    [
        pytest.param("llama", 2, 1, 1, 2, {}, {}, id="llama-tp2"),
        pytest.param("qwen2_tied", 1, 2, 1, 2, {}, {}, id="qwen2tied-pp2"),
        pytest.param("qwen3", 2, 2, 1, 4, {}, {}, id="qwen3-tp2pp2"),
        pytest.param("qwen2", 2, 1, 1, 2, {"sequence_parallel": True}, {}, id="qwen2-tp2-sp"),
        pytest.param("qwen3_moe", 1, 1, 1, 1, {}, {}, id="qwen3moe-1rank"),
        # the cuda default's compiled RMSNorm (incl. q/k norm), RoPE rotation and megatron's SwiGLU fusion
        pytest.param("qwen3", 1, 1, 1, 1, {"fused_elementwise": True}, {}, id="qwen3-1rank-fused"),
        # etp unset = tp (megatron's default): experts split over TP like the dense layers
        pytest.param("qwen3_moe", 2, 1, 1, 2, {"sequence_parallel": True}, {}, id="qwen3moe-tp2-sp-etp2"),
        # etp=1 < tp=2: each expert whole on both TP ranks, which route different (SP) tokens to it
        pytest.param(
            "qwen3_moe",
            2,
            1,
            1,
            2,
            {"sequence_parallel": True, "distributed_optimizer": False},
            {"etp": 1},
            id="qwen3moe-tp2-sp-etp1",
        ),
        # the plain DDP all-reduce: the distributed optimizer leaves each rank only its reduce-scattered shard
        pytest.param("mistral", 1, 1, 1, 2, {"distributed_optimizer": False}, {}, id="mistral-dp2"),
        # expert parallelism (alltoall dispatcher): experts 0-1 on rank 0, 2-3 on rank 1, dp=2
        pytest.param("qwen3_moe", 1, 1, 2, 2, {"distributed_optimizer": False}, {}, id="qwen3moe-ep2"),
        # EP=2 x TP=2 (etp=2) with SP: routed tokens gathered over TP in unequal pieces
        pytest.param(
            "qwen3_moe",
            2,
            1,
            2,
            4,
            {"sequence_parallel": True, "distributed_optimizer": False},
            {},
            id="qwen3moe-ep2-tp2-sp",
        ),
        # the interleaved schedule: 2 virtual stages per pipeline rank, micro-batches padded to one length
        pytest.param("qwen3", 1, 2, 1, 2, {}, {"vpp": 2}, id="qwen3-pp2-vpp2"),
    ],
)
def test_logprobs_loss_grads_equal_hf(
    family: str, tp: int, pp: int, ep: int, world: int, opts: dict[str, Any], sizes: dict[str, Any]
) -> None:
    """Packed variable-length micro-batches (several per step, 24 tokens max) through megatron's
    schedules: per-token log-probs, the token-mean loss over dp, and every gradient (gathered over
    TP/PP/EP/ETP) equal the float64 HF model's. The layout reports ``etp`` (``tp`` when unset)."""
    results = run_distributed(W.check_forward_grads, world, family, tp, pp, ep, opts, sizes, timeout_s=300)
    for r in results:
        assert r["lp"] < LP_TOL, r
        assert r["loss"] < LOSS_TOL, r
        assert r["grad_rel"] < GRAD_TOL, r
        assert r["etp"] == sizes.get("etp", tp), r
        assert r["norm_rel"] < GRAD_TOL, r


@pytest.mark.parametrize("which", ["qkv", "gate_up"])
def test_negative_controls_catch_wrong_fusion(which: str) -> None:
    """A plain [q; k; v] concatenation or an [up; gate] fc1 gives log-probs over 100x the tolerance of
    the equality tests above, which therefore catch a wrong fusion order."""
    (err,) = run_distributed(W.wrong_fusion, 1, which)
    assert err > 100 * LP_TOL, err


def test_step_equals_fsdp2() -> None:
    """One forward_backward + clipped AdamW step equals the fsdp2 engine's on the same batch and seed
    (weight decay on every parameter in both); offload/onload of parameters, gradients and optimizer
    state between steps is bit-exact and the second step matches too."""
    (r,) = run_distributed(W.step_vs_fsdp2, 1, "qwen3", timeout_s=300)
    assert r["moved"] > 1e-4, r
    assert r["param"] < 1e-6, r
    assert r["loss"] < 1e-6 and r["norm"] < 1e-5 and r["skipped"] == 0.0, r
    # offload/onload in between is bit-exact, and the second step (Adam moments) still matches
    assert r["offload_exact"] == 1.0, r
    assert r["param2"] < 1e-6 and r["norm2"] < 1e-5, r


def test_export_reload_and_load_hf(tmp_path: Path) -> None:
    """Export at TP2 -> transformers reload gives the seed model's logits; loading that export with
    load_hf at PP2 gives HF's log-probs. A Qwen3-MoE export at EP=2 (each rank holds half the experts)
    reloads with the seed model's logits too."""
    out = str(tmp_path / "export")
    errs = run_distributed(W.export_reload, 2, "qwen3", 2, 1, out, timeout_s=300)
    assert errs[0] < 1e-9, errs
    errs = run_distributed(W.export_reload, 2, "qwen3_moe", 1, 1, str(tmp_path / "moe"), 2, timeout_s=300)
    assert errs[0] < 1e-9, errs
    lps = run_distributed(W.load_roundtrip, 2, "qwen3", 1, 2, out, timeout_s=300)
    assert max(lps) < LP_TOL, lps


def test_checkpoint_tp2pp2_resumes_with_identical_next_step(tmp_path: Path) -> None:
    """A checkpoint (model + distributed-optimizer state in megatron's fully_reshardable format,
    through CheckpointManager) saved at TP2xPP2 on 4 ranks, loaded into engines with other initial
    weights at the same layout and at TP1 x DP2: the next clipped AdamW step gives the uninterrupted
    run's grad norm and parameters (the Adam moments and step were restored and resharded, not started
    fresh)."""
    import torch

    root = str(tmp_path)
    (ref,) = run_distributed(W.resume_step, 4, "qwen3", 2, 2, root, "run", timeout_s=300)[:1]
    expect = torch.load(tmp_path / "run_tp2pp2.pt")
    for world, tp, pp in ((4, 2, 2), (2, 1, 1)):
        got = run_distributed(W.resume_step, world, "qwen3", tp, pp, root, "resume", timeout_s=300)[0]
        params = torch.load(tmp_path / f"resume_tp{tp}pp{pp}.pt")
        assert set(params) == set(expect)
        diff = max(float((params[n] - expect[n]).abs().max()) for n in expect)
        assert diff < 1e-6, (world, tp, pp, diff)
        assert abs(got["loss"] - ref["loss"]) < 1e-6 and got["step"] == 2.0, (got, ref)
        # the clipped step (grad_clip=1.0) used the same global norm at both layouts
        assert abs(got["norm"] - ref["norm"]) <= 1e-5 * ref["norm"], (world, tp, pp, got, ref)


# (family, tp, pp, options); ranks left over by tp * pp are data parallel
_NORM_LAYOUTS_4 = [
    ("qwen3", 2, 2, {}),
    ("qwen3", 2, 1, {}),
    ("qwen3", 1, 2, {}),
    ("qwen2", 2, 1, {"sequence_parallel": True}),
    ("qwen2_tied", 2, 2, {}),
    ("qwen3_moe", 2, 1, {"sequence_parallel": True}),
    # expert parallelism (EP=2 x TP=2, distributed optimizer over the expert data-parallel group)
    ("qwen3_moe", 2, 1, {"sequence_parallel": True, "ep": 2}),
    # virtual pipelines (PP=2 x VPP=2, dp=2): the same step as PP=2 above and the 1-rank step
    ("qwen3", 1, 2, {"vpp": 2}),
]
_NORM_LAYOUTS_1 = [
    ("qwen3", 1, 1, {}),
    ("qwen2", 1, 1, {}),
    ("qwen2_tied", 1, 1, {}),
    ("qwen3_moe", 1, 1, {}),
]


def test_grad_norm_and_clipped_step_independent_of_layout(tmp_path: Path) -> None:
    """The grad norm ``optimizer_step`` reports (and clips with) is the float64 HF model's for one
    batch at TP1 (1 rank) and, on 4 ranks, at TP2xPP2, TP2, PP2, TP2 with sequence parallelism
    (qkv biases, norms replicated over TP), tied embeddings across TP2xPP2 and MoE (router, experts)
    with TP2+SP, with EP2 x TP2+SP, and at PP2 x VPP2; and the clipped step (grad_clip=1.0 below every norm) gives every layout the
    parameters of the 1-rank step. Megatron counts a TP-sharded weight in the norm only when it
    carries ``tensor_model_parallel``; without it TP2xPP2's norm came out ~0.7 low."""
    import torch

    runs = {}
    for world, layouts in ((1, _NORM_LAYOUTS_1), (4, _NORM_LAYOUTS_4)):
        out = tmp_path / f"w{world}"
        out.mkdir()
        results = run_distributed(W.grad_norm_layouts, world, layouts, str(out), timeout_s=600)
        for i, layout in enumerate(layouts):
            per_rank = [r[i] for r in results]
            assert len({r["norm"] for r in per_rank}) == 1, (layout, per_rank)  # one global value
            r = per_rank[0]
            assert abs(r["norm"] - r["hf"]) <= 1e-5 * r["hf"], (world, layout, r)
            assert r["norm"] > 1.5 and r["skipped"] == 0.0, (world, layout, r)  # clipping is active
            runs[(world, i)] = (layout, torch.load(out / f"{i}.pt"))
    reference = {layout[0]: params for (world, _), (layout, params) in runs.items() if world == 1}
    for (world, _), (layout, params) in runs.items():
        expect = reference[layout[0]]
        assert set(params) == set(expect), layout
        diff = max(float((params[n] - expect[n]).abs().max()) for n in expect)
        assert diff < 1e-6, (world, layout, diff)
