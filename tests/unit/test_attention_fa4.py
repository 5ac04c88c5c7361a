"""The ``fa4`` attention backend's selection logic on the CPU: its probe and flash-attn 2's tell the two
packages apart (flash-attn-4 installs a bare ``flash_attn`` namespace holding ``cute/``), building it
off a Hopper/Blackwell GPU fails with the reason, and ``auto`` then skips it.

The kernels themselves need an sm90/sm100 GPU: ``benchmarks/gpu/probe_fa4.py`` and
``UNDERLAY_DEVICE=cuda UNDERLAY_ATTENTION=fa4 pytest tests/conformance/test_attention_contract.py``
check them there against the float32/eager references."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from underlay import registry
from underlay.backends.cpu.device import CpuDevice
from underlay.interfaces import AttentionSpec, BackendUnavailable


def _install(root: Path, files: list[str]) -> None:
    for rel in files:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Path]:
    """An empty directory first on ``sys.path``, with ``flash_attn`` forgotten before and after."""
    sys.path.insert(0, str(tmp_path))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            del sys.modules[name]
        registry.reset()


def test_fa4_namespace_is_not_flash_attn_2(site: Path) -> None:
    _install(site, ["flash_attn/cute/__init__.py", "flash_attn/cute/interface.py"])
    fa2 = registry._probe_flash_attn2()
    assert not fa2.available and "flash_attn_interface" in fa2.reason
    fa4 = registry._probe_fa4()
    # torch 2.13 ships torch/nn/attention/_fa4.py, so only the package decides here
    assert fa4.available, fa4.reason


def test_flash_attn_2_is_not_fa4(site: Path) -> None:
    _install(site, ["flash_attn/__init__.py", "flash_attn/flash_attn_interface.py"])
    assert registry._probe_flash_attn2().available
    fa4 = registry._probe_fa4()
    assert not fa4.available and "flash-attn-4" in fa4.reason and "underlay[fa4]" in fa4.hint


def test_neither_installed(site: Path) -> None:
    assert not registry._probe_flash_attn2().available
    assert not registry._probe_fa4().available


def test_building_off_hopper_names_the_capability(site: Path) -> None:
    _install(site, ["flash_attn/cute/__init__.py", "flash_attn/cute/interface.py"])
    from underlay.backends.portable.fa4_attention import FA4Attention

    with pytest.raises(BackendUnavailable, match=r"compute capability 9\.x or 10\.x.*'cpu'"):
        FA4Attention(CpuDevice())


class _Hopper(CpuDevice):
    """A device that reports itself as an sm90 GPU, to reach ``supports`` (the kernels never run)."""

    @property
    def name(self) -> str:
        return "cuda"

    def capability(self, index: int | None = None) -> tuple[int, int] | None:
        return (9, 0)


def _spec(
    d: int, dv: int | None = None, dtype: torch.dtype = torch.bfloat16, device: str = "cuda"
) -> AttentionSpec:
    return AttentionSpec(
        layout="varlen",
        dtype=dtype,
        device_type=device,
        head_dim=d,
        head_dim_v=dv,
        num_heads=8,
        num_kv_heads=2,
        causal=True,
        window=None,
        softcap=None,
        sinks=False,
    )


def test_supports_states_fa4_limits(site: Path) -> None:
    _install(site, ["flash_attn/cute/__init__.py", "flash_attn/cute/interface.py"])
    from underlay.backends.portable.fa4_attention import FA4Attention

    kern = FA4Attention(_Hopper())
    assert kern.name == "fa4"
    assert kern.supports(_spec(128)) == ()
    assert kern.supports(_spec(256)) == ()
    assert any("bf16/fp16" in r for r in kern.supports(_spec(128, dtype=torch.float32)))
    assert any("multiples of 8" in r for r in kern.supports(_spec(100)))
    assert any("<= 256" in r for r in kern.supports(_spec(320)))
    assert any("runs on cuda" in r for r in kern.supports(_spec(128, device="cpu")))


def test_registry_names_the_alternatives_when_building_fails(site: Path) -> None:
    _install(site, ["flash_attn/cute/__init__.py", "flash_attn/cute/interface.py"])
    with pytest.raises(
        BackendUnavailable, match=r"compute capability.*Available attention backends here: .*torch"
    ):
        registry._build("attention", "fa4")
