"""Shared pytest configuration: marker-based skips, a clean backend registry per test, and
deterministic property tests (hypothesis draws the same examples every run, derived from each test's
name, and keeps no example database; explore new examples with ``--hypothesis-profile=default``)."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator

import pytest
import torch

from underlay import registry

try:
    from hypothesis import settings
except ImportError:  # the verl environment has no hypothesis (and no property tests)
    pass
else:
    settings.register_profile("underlay-deterministic", derandomize=True, database=None)
    settings.load_profile("underlay-deterministic")


def _has_cuda() -> bool:
    return torch.version.cuda is not None and registry.probe("device", "cuda").available


def _has_npu() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU (run on the GPU host: UNDERLAY_DEVICE=cuda pytest -m gpu)"
    )
    skip_npu = pytest.mark.skip(
        reason="needs an Ascend NPU with torch_npu (UNDERLAY_DEVICE=npu pytest on that host)"
    )
    gpu, npu = _has_cuda(), _has_npu()
    full_matrix = "full_matrix" in (config.getoption("markexpr", "") or "")
    skip_full = pytest.mark.skip(
        reason="the whole matrix: select it with -m full_matrix (docs/model-matrix.md)"
    )
    conformance = pytest.mark.conformance
    for item in items:
        if item.nodeid.startswith("tests/conformance/"):  # scripts/test_gpu.sh selects them by marker
            item.add_marker(conformance)
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        if "npu" in item.keywords and not npu:
            item.add_marker(skip_npu)
        if "full_matrix" in item.keywords and not full_matrix:
            item.add_marker(skip_full)


@functools.cache
def _cpu_host() -> bool:
    return not _has_cuda() and not _has_npu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """On a host without an accelerator, a test (its fixtures' set-up and teardown included) computes
    with one intra-op thread in the pytest process, as every rank of ``tests/_dist.py`` does: the
    suite's tensors are tiny, and CI runs four pytest lanes on two cores, where a second OpenMP thread
    per process spins waiting for a core (30 exact model rows took 58 s of CPU and 194 s of wall with
    two threads on a loaded 2-core host, 6 s and 13 s with one). A test that changes the count gets the
    previous one back. tests/distributed keeps the inherited count (it tests how ranks pick theirs)."""
    if not _cpu_host() or item.nodeid.startswith("tests/distributed/"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    """Every test starts and ends with no cached backend selection."""
    registry.reset()
    yield
    registry.reset()
