"""The model matrix (underlay.models.coverage) against the installed transformers and the engines' own
capability checks: every causal-LM model type is classified, the live classification equals the
reviewed one, refusals carry the engine's ConfigError, and docs/model-matrix.md shows the same table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from underlay.models import coverage

DOC = Path(__file__).resolve().parents[3] / "docs" / "model-matrix.md"


@pytest.fixture(scope="module")
def rows() -> list[coverage.CoverageRow]:
    return coverage.coverage_matrix()


def test_every_causal_lm_model_type_is_classified() -> None:
    unknown = coverage.unknown_model_types()
    assert not unknown, (
        f"transformers registers causal-LM model types that underlay.models.coverage.KNOWN does not "
        f"classify: {unknown}; run `underlay info --models`, review, and add them to KNOWN and "
        "docs/model-matrix.md"
    )
    stale = sorted(set(coverage.KNOWN) - set(coverage.causal_lm_model_types()))
    assert not stale, f"KNOWN lists model types the installed transformers lacks: {stale}"


def test_engines_classify_as_reviewed(rows: list[coverage.CoverageRow]) -> None:
    live = {(r.model_type, r.engine): r.status for r in rows}
    differ = {
        (mt, engine): (want, live[mt, engine])
        for mt, statuses in coverage.KNOWN.items()
        for engine, want in zip(coverage.ENGINES, statuses)
        if live.get((mt, engine)) != want
    }
    assert not differ, f"(model type, engine): (reviewed, engine says) differ: {differ}"


def test_refusals_are_the_engines_config_errors(rows: list[coverage.CoverageRow]) -> None:
    for r in rows:
        if r.status == "refused":
            if r.engine == "mcore":  # arch_of's ConfigError
                assert r.reason.startswith("mcore: "), r
            else:  # inspect_model's ConfigError names the type (a VLM's text part may be named)
                assert "is not supported by underlay.models" in r.reason, r
        elif r.status == "accepted":  # only fsdp2 rows the matrix test found not exact, with why
            assert r.engine == "fsdp2" and r.reason == coverage.NOT_EXACT[r.model_type] != "", r
        elif r.status in ("exact", "encoder-decoder"):
            assert r.reason == "", r
        else:  # no-tiny-config: transformers' own error says why
            assert r.reason.split(":")[0].endswith(("Error", "Exception")), r
    for engine, exact in coverage.EXACT.items():
        for mt in exact:
            assert coverage.KNOWN[mt][coverage.ENGINES.index(engine)] == "exact", (mt, engine)


def test_docs_table_equals_coverage(rows: list[coverage.CoverageRow]) -> None:
    assert coverage.markdown_table(rows) in DOC.read_text(), (
        "docs/model-matrix.md differs from underlay.models.coverage; regenerate its counts and table "
        "from coverage.markdown_table(coverage.coverage_matrix())"
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~97 rows: 2-3 minutes on an idle 2-core machine, far more under load
def test_fsdp2_exact_rows_equal_transformers() -> None:
    """Every fsdp2 row marked exact: packed_forward of the prepared float64 model equals transformers'
    eager forward of each sequence alone (log-probs and entropies at T=1 and T=0.7, the gradient of
    their weighted sum) and two packings of the same sequences give bit-equal log-probs. About 97 rows,
    1-2 s each on 2 cores: slow; test_model_matrix_rows.py runs a fixed subset of each kind in CI."""
    from tests.unit.models._matrix import TOL
    from tests.unit.models.test_model_matrix_rows import FAST_ROWS, ROW_TOL

    # the rows test_model_matrix_rows.py checks (the same check, a tolerance at least as tight) are not
    # run twice
    assert ROW_TOL <= TOL and set(FAST_ROWS) <= coverage.EXACT["fsdp2"]
    rows = sorted(coverage.EXACT["fsdp2"] - set(FAST_ROWS))
    # in a process whose PyTorch CPU kernels are pinned to AVX2 (read when torch starts): with AVX512
    # kernels the fp32 routers of several MoE rows differ by 1e-8..2e-7 between packings, because the
    # vectorised fp32 elementwise loops treat the tail elements a vector width leaves over apart (a
    # host fact, not underlay's packing; docs/model-matrix.md). Pinning the whole suite is no option:
    # bf16 kernels on an AVX512 host then fail ("pack_vnni2 is only supported when avx512 is supported").
    code = (
        "import json, sys\n"
        "from tests.unit.models._matrix import check_row\n"
        "print(json.dumps({mt: check_row(mt) for mt in sys.argv[1:]}))\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", code, *rows], env=env, cwd=root, capture_output=True, text=True, timeout=1700
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bad = {
        mt: diffs
        for mt, diffs in json.loads(proc.stdout.strip().splitlines()[-1]).items()
        if diffs["packings"] != 0.0 or max(diffs.values()) >= TOL
    }
    assert not bad, f"rows marked exact that differ from transformers (tolerance {TOL}): {bad}"


def test_info_models_prints_counts_and_reasons(
    rows: list[coverage.CoverageRow], capsys: pytest.CaptureFixture[str]
) -> None:
    from underlay.cli import _print_models

    _print_models(rows, coverage.counts(rows))
    out = capsys.readouterr().out
    for engine, per in coverage.counts(rows).items():
        assert f"{engine}: " + ", ".join(f"{n} {s}" for s, n in per.items()) in out
    refused = next(r for r in rows if r.engine == "mcore" and r.status == "refused")
    assert f"{refused.model_type:<28} refused: {refused.reason}" in out


REFUSED_BY_FEATURE = {
    "bert": "an output-layer bias",
    "gptj": "an output-layer bias",
    "blt": "cross-attention layers (BltCrossAttention",
    "doge": "dynamic mask attention (config.keep_window_size=",
    "dory": "depth-recurrent layers run 2 times (config.n_recurrent_loops)",
    "gemma4_unified_assistant": "every layer reuses key/value states of another model",
}
"""fsdp2 refusals by a feature the packed route or the log-prob head does not compute (one type each)."""


def test_refusals_name_the_missing_feature(rows: list[coverage.CoverageRow]) -> None:
    reason = {r.model_type: r.reason for r in rows if r.engine == "fsdp2" and r.status == "refused"}
    for mt, feature in REFUSED_BY_FEATURE.items():
        assert feature in reason.get(mt, ""), (mt, reason.get(mt))
