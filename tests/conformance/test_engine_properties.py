"""Training properties (``_engine_properties``) of every registered engine whose probe passes here, at
1 and 2 ranks (gloo on cpu; ``UNDERLAY_DEVICE=cuda`` on a GPU host runs mcore too). mcore on the CPU
runs in ``tests/mcore/test_mcore_properties.py`` under its fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance import _engine_contract as C
from tests.conformance import _engine_properties as P

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("world", C.world_sizes())
@pytest.mark.parametrize("name", C.engine_names())
def test_engine_training_properties(name: str, world: int, tmp_path: Path) -> None:
    for model, chain in P.chains(name, world).items():
        results = C.default_launcher(
            P.job_properties, world, name, str(tmp_path / model), C.device_name(), model, chain
        )
        P.check_properties(results, world, C.tolerance())


@pytest.mark.parametrize("name", C.engine_names())
def test_checkpoint_load_fails_whole(name: str, tmp_path: Path) -> None:
    """A load failing right after each phase raises ``CheckpointError`` with live state unchanged."""
    world = max(C.world_sizes())  # 2 ranks on cpu; on an accelerator host no more than its devices
    P.check_load_faults(C.default_launcher(P.job_load_faults, world, name, str(tmp_path), C.device_name()))
