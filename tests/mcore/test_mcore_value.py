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
    transformers as ``*ForTokenClassification`` with equal values; ``load_hf`` of it into a TP2 engine
    of another seed gives HF's values; a value model built from a causal-LM directory takes the
    backbone from the files (``lm_head`` dropped) and the seed model's head; dropout (0.5) in training
    draws the same mask on both TP ranks and changes the loss."""
    results = run_distributed(W.value_layouts, 2, "qwen3", str(tmp_path), timeout_s=600)
    for r in results:
        for tag in ("tp2", "tp2sp", "pp2"):
            assert r[f"{tag}_values"] < TOL, (tag, r)
            assert r[f"{tag}_shifted"] > 100 * TOL, (tag, r)
            assert r[f"{tag}_loss"] < TOL and r[f"{tag}_tokens"] == 0.0, (tag, r)
            assert r[f"{tag}_names"] == 1.0 and r[f"{tag}_grad_rel"] < GRAD_TOL, (tag, r)
        assert r["load_report_clean"] == 1.0 and r["load_values"] < TOL, r
        assert r["causal_backbone"] == 0.0 and r["causal_lm_head_dropped"] == 1.0, r
        assert r["causal_head_seeded"] == 0.0, r
        assert r["dropout_tp_agree"] == 1.0 and r["dropout_loss_change"] > 1e-3, r
    assert results[0]["export_values"] < 1e-9 and results[0]["export_class"] == 1.0, results[0]
