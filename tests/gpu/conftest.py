"""GPU tests select the cuda device: each test runs with ``UNDERLAY_DEVICE=cuda`` (they are skipped
without CUDA by the marker ``gpu``, see tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from underlay import registry


@pytest.fixture(autouse=True)
def _cuda_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("UNDERLAY_DEVICE", "cuda")
    registry.reset()
    yield
    registry.reset()
