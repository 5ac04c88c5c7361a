"""The engine contract suite (``tests/conformance/_engine_contract.py``) run for mcore under the CPU
fixture: each spawned rank installs ``tests/mcore/_cpu_fixture.py`` before the suite's job runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from tests._dist import run_distributed
from tests.conformance import _engine_contract as C

pytestmark = [pytest.mark.mcore, pytest.mark.distributed, pytest.mark.slow]


def _under_fixture(rank: int, world: int, fn: Callable[..., Any], *args: Any) -> Any:
    from tests.mcore._cpu_fixture import install

    install()
    return fn(rank, world, *args)


def fixture_launcher(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``Launcher`` for the suite: real gloo process groups, the CPU fixture installed in every rank."""
    return run_distributed(_under_fixture, world, fn, *args, timeout_s=300, backend="gloo")


@pytest.mark.parametrize("world", [1, 2])
def test_engine_contract_mcore(world: int, tmp_path: Path) -> None:
    C.run_engine_contract("mcore", world, tmp_path, fixture_launcher)


@pytest.mark.parametrize("model", sorted(C.MODELS))
def test_weight_loader_contract_mcore(model: str, tmp_path: Path) -> None:
    """At 2 ranks only (1 rank passes too; dropped to keep the mcore group near 3 min of CI)."""
    C.run_loader_contract("mcore", 2, tmp_path, model, fixture_launcher)
