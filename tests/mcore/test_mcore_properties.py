"""The training properties (``tests/conformance/_engine_properties.py``) for mcore under the CPU
fixture: one 2-rank process group per chain runs its layouts (each resumes the previous one's
checkpoint), all against the float64 reference. The chains in ``P.SLOW_CHAINS`` (pp2 x vpp2 -> cp2)
are marked ``slow``: CI covers cp2 in the dense chain, and ``-m "not slow"`` leaves them out."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests.conformance import _engine_properties as P
from tests.conformance._engine_contract import device_name, tolerance
from tests.mcore.test_mcore_conformance import fixture_launcher

pytestmark = [pytest.mark.mcore, pytest.mark.distributed]


@pytest.mark.parametrize(
    "chain",
    [
        pytest.param(c, marks=[pytest.mark.slow] if c in P.SLOW_CHAINS else [])
        for c in sorted(P.chains("mcore", 2))
    ],
)
def test_mcore_training_properties(chain: str, tmp_path: Path) -> None:
    """Every chain of ``P.chains("mcore", 2)``: dense dp2 -> tp2+sp -> pp2 -> cp2 -> plain optimizer,
    MoE ep2 -> ep1, and (slow) pp2 x vpp2 -> cp2, each layout checked by ``P.check_properties``."""
    results = fixture_launcher(
        P.job_properties, 2, "mcore", str(tmp_path), device_name(), chain, P.chains("mcore", 2)[chain]
    )
    P.check_properties(results, 2, tolerance())


def test_mcore_checkpoint_load_fails_whole(tmp_path: Path) -> None:
    """A load failing right after each phase (files read, model, optimizer, LR schedule; torch's
    ``CheckpointException`` too) raises ``CheckpointError`` with the live state unchanged."""
    P.check_load_faults(fixture_launcher(P.job_load_faults, 2, "mcore", str(tmp_path), device_name()))
