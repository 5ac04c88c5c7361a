"""The ``WeightLoader`` contract, run against every registered weight loader (with the engine of the same
name) whose probe passes on this host, on 1 and 2 ranks, for a dense model, a tied-embedding model and a
mixture-of-experts model whose checkpoint keeps one tensor per expert (``_engine_contract.check_loader``):
loading a transformers-saved directory and streaming it back gives the files' tensors exactly; strict
loading refuses missing and unexpected names, and any load refuses shape mismatches, before a parameter
changes; export writes the same tensors (sharded, with an index) and transformers loads them.
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


@pytest.mark.parametrize("model", sorted(C.MODELS))
@pytest.mark.parametrize("world", C.world_sizes())
@pytest.mark.parametrize("name", C.engine_names("weight_loader"))
def test_weight_loader_contract(
    name: str, world: int, model: str, tmp_path: Path, contract_launcher: C.Launcher
) -> None:
    C.run_loader_contract(name, world, tmp_path, model, contract_launcher)
