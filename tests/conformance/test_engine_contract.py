"""The ``ParallelEngine`` contract, run against every registered engine whose probe passes on this host,
on 1 and 2 ranks (gloo on cpu; on a GPU host ``UNDERLAY_DEVICE=cuda pytest tests/conformance``).

What a new engine must pass (``_engine_contract.check_engine``): one step equal to a float64
single-process reference, identical metrics on every rank, ``infer`` outputs of the rows passed in their
order, ``iter_weights`` equal to the exported HF state dict with only the named receivers getting
tensors, save/load resume identical, offload/onload exact, bad input refused before state changes.
Another package can run it with its own launcher: override the ``contract_launcher`` fixture, or call
``_engine_contract.run_engine_contract(name, world, root, launcher)``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance import _engine_contract as C

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture
def contract_launcher() -> C.Launcher:
    """How ranks start (override in a conftest to run the suite under another launcher)."""
    return C.default_launcher


@pytest.mark.parametrize("world", C.world_sizes())
@pytest.mark.parametrize("name", C.engine_names())
def test_engine_contract(name: str, world: int, tmp_path: Path, contract_launcher: C.Launcher) -> None:
    C.run_engine_contract(name, world, tmp_path, contract_launcher)
