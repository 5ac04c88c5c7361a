"""The training properties (``tests/conformance/_engine_properties.py``) for mcore under the CPU
fixture: one 2-rank process group per model runs a chain of layouts (each resumes the previous one's
checkpoint), all against the float64 reference."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests.conformance import _engine_properties as P
from tests.conformance._engine_contract import device_name, tolerance
from tests.mcore.test_mcore_conformance import fixture_launcher

pytestmark = [pytest.mark.mcore, pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("model", sorted(P.chains("mcore", 2)))
def test_mcore_training_properties(model: str, tmp_path: Path) -> None:
    results = fixture_launcher(
        P.job_properties, 2, "mcore", str(tmp_path), device_name(), model, P.chains("mcore", 2)[model]
    )
    P.check_properties(results, 2, tolerance())


def test_mcore_checkpoint_load_fails_whole(tmp_path: Path) -> None:
    """A load failing right after each phase (files read, model, optimizer, LR schedule; torch's
    ``CheckpointException`` too) raises ``CheckpointError`` with the live state unchanged."""
    P.check_load_faults(fixture_launcher(P.job_load_faults, 2, "mcore", str(tmp_path), device_name()))
