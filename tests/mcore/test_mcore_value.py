"""Value models (``ModelConfig(kind="value")``, the critic) on the megatron-core engine, on the CPU
(gloo, fp32) under the test-only fixture, against the float64 Hugging Face token-classification model."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests._dist import run_distributed
from tests.mcore import _workers as W

pytestmark = [pytest.mark.mcore, pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-5
GRAD_TOL = 1e-4


def test_value_model_equals_hf_at_tp2_sp_pp2_and_round_trips(tmp_path: Path) -> None:
    """Per-token values (no shift), the token-mean value loss over packed variable-length
    micro-batches and every gradient (score head included) equal the float64 HF token-classification
    model's at TP2, TP2 with sequence parallelism and PP2; a one-token shift of the values (the
    causal-LM alignment) is over 100x the tolerance (negative control). The PP2 export reloads in
    transformers as ``*ForTokenClassification`` with equal values; ``load_hf`` of it, and
    ``load_checkpoint`` of a PP2 checkpoint, into a TP2 engine of another seed give HF's values; a value model built from a causal-LM directory takes the
    backbone from the files (``lm_head`` dropped) and the seed model's head; dropout (0.5) kept in
    training (``training_randomness="keep"``) draws the same mask on both TP ranks and changes the loss,
    and under the default (``"off"``) the training loss equals infer's."""
    results = run_distributed(W.value_layouts, 2, "qwen3", str(tmp_path), timeout_s=600)
    for r in results:
        for tag in ("tp2", "tp2sp", "pp2"):
            assert r[f"{tag}_values"] < TOL, (tag, r)
            assert r[f"{tag}_shifted"] > 100 * TOL, (tag, r)
            assert r[f"{tag}_loss"] < TOL and r[f"{tag}_tokens"] == 0.0, (tag, r)
            assert r[f"{tag}_names"] == 1.0 and r[f"{tag}_grad_rel"] < GRAD_TOL, (tag, r)
        assert r["load_report_clean"] == 1.0 and r["load_values"] < TOL, r
        assert r["ckpt_before"] > 100 * TOL and r["ckpt_values"] < TOL, r
        assert r["causal_backbone"] == 0.0 and r["causal_lm_head_dropped"] == 1.0, r
        assert r["causal_head_seeded"] == 0.0, r
        assert r["dropout_tp_agree_keep"] == 1.0 and r["dropout_loss_change_keep"] > 1e-3, r
        assert r["dropout_tp_agree_off"] == 1.0 and r["dropout_loss_change_off"] < TOL, r
    assert results[0]["export_values"] < 1e-9 and results[0]["export_class"] == 1.0, results[0]


def test_value_step_equals_fsdp2_and_data_path_reads_no_device_values() -> None:
    """A value model's forward_backward + clipped AdamW step equals the fsdp2 engine's on the same
    batch and seed (every parameter by HF name, the head included; loss, metric, grad norm).

    Host synchronisations of the engine's data path: batches are validated, planned and packed on
    the host, so no tensor that reached the device through the engine is read back by the engine's
    own code during ``forward_backward``, ``optimizer_step`` or ``infer`` (the callers are recorded on
    marked tensors; megatron's own reads are listed separately). The marking does not change the
    step. Malformed batches still raise ``InvalidInput`` naming the problem before any gradient or
    step state changes."""
    (r,) = run_distributed(W.host_syncs, 1, timeout_s=300)
    v = r["value_step"]
    assert v["names"] == 1.0 and v["skipped"] == 0.0, v
    assert v["moved"] > 1e-4 and v["head_moved"] > 1e-4, v
    assert v["param"] < 1e-6 and v["loss"] < 1e-6 and v["value_metric"] < 1e-5 and v["norm"] < 1e-5, v
    assert r["same_step"] == 1.0, r
    mine = {
        phase: [s for s in sites if "engines/" in s or "ops/loss.py" in s]
        for phase, sites in r["phases"].items()
    }
    # the one read of a device value: the metrics of the step, after their all-reduce (the global loss
    # counts are summed from the host batch; aggregate_loss reads nothing for the batch's own mask)
    assert [s.split(" ")[1:] for s in mine["forward_backward"]] == [["reduce", "[tolist]"]], mine
    assert not mine["infer"] and not mine["optimizer_step"], mine
    # the attention kernel takes the host lengths the engine attached, megatron's THD RoPE the host
    # cu_seqlens (both read the device copy before: once per micro-batch, and twice per layer for q, k)
    late = [s for sites in r["phases"].values() for s in sites if "_read_lengths" in s or "rotary" in s]
    assert not late, r["phases"]
    m = r["messages"]
    for call in ("forward_backward", "infer"):
        assert "rows [1] have no tokens" in m[f"empty_row/{call}"], m
        assert "out of range [0, 128): min 128" in m[f"id_range/{call}"], m
        assert "min -128" in m[f"negative_id/{call}"], m
        assert "dtype torch.float32" in m[f"dtype/{call}"], m
        assert "empty (B=0)" in m[f"empty/{call}"], m
    assert r["grads_untouched"] == 1.0 and r["step_unchanged"] == 1.0, r
