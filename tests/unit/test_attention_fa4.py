"""The ``fa4`` attention backend's selection logic on the CPU: its probe and flash-attn 2's tell the two
packages apart (flash-attn-4 installs a bare ``flash_attn`` namespace holding ``cute/``), building it
off a Hopper/Blackwell GPU fails with the reason, and ``auto`` then skips it.

The kernels themselves need an sm90/sm100 GPU:
``UNDERLAY_DEVICE=cuda UNDERLAY_ATTENTION=fa4 pytest tests/conformance/test_attention_contract.py``
checks them there against the float32/eager references."""

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
    # torch 2.13 has torch.nn.attention.register_flash_attention_impl, so only the package decides here
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


def test_activation_overrides_aten_flash_kernels_and_restores(site: Path) -> None:
    """Activation registers ``_fa4_glue.register`` with torch's registry and activates it; the glue maps
    aten's arguments to FA4's (``varlen_attn``'s causal window ``(-1, 0)`` is ``causal=True``) and keeps
    the values aten's ops return. The FA4 functions here record their arguments (the kernels need a GPU:
    the conformance suite runs them there)."""
    _install(site, ["flash_attn/cute/__init__.py"])
    (site / "flash_attn" / "cute" / "interface.py").write_text(
        "calls = []\n"
        "def _flash_attn_fwd(q, k, v, **kw):\n    calls.append(kw)\n    return q, k.t(), None, None, None\n"
        "def _flash_attn_bwd(*a, **kw):\n    calls.append(kw)\n    return a[0], a[1], a[2]\n"
    )
    from torch.nn import attention
    from torch.nn.attention import _registry

    from underlay.backends.portable import fa4_attention

    assert attention.current_flash_attention_impl() is None
    try:
        fa4_attention._activate()
        assert attention.current_flash_attention_impl() == "underlay_fa4"
        fa4_attention._activate()  # idempotent
        from flash_attn.cute import interface

        from underlay.backends.portable import _fa4_glue

        q, k = torch.ones(4, 2, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.bfloat16)
        cu = torch.tensor([0, 4], dtype=torch.int32)
        out, lse, rng, _, debug = _fa4_glue._forward(
            q, k, k, cu, cu, 4, 4, 0.0, True, False, scale=0.5, window_size_left=-1, window_size_right=0
        )
        assert out is q and lse.shape == (2, 4) and rng.shape == (2,) and debug.numel() == 0
        kw = interface.calls[-1]
        assert kw["causal"] is True and kw["window_size_left"] is None and kw["window_size_right"] is None
        assert kw["softmax_scale"] == 0.5 and kw["cu_seqlens_q"] is cu and kw["max_seqlen_q"] == 4
        _fa4_glue._forward(q, k, k, cu, cu, 4, 4, 0.0, False, False, window_size_left=3, window_size_right=0)
        kw = interface.calls[-1]
        assert kw["causal"] is False and (kw["window_size_left"], kw["window_size_right"]) == (3, 0)
        dq, *_ = _fa4_glue._backward(q, q, k, k, q, lse, cu, cu, 4, 4, 0.0, True, rng, rng, scale=0.5)
        assert dq is q and interface.calls[-1]["causal"] is True
        with pytest.raises(RuntimeError, match="dropout_p=0.1"):
            _fa4_glue._forward(q, k, k, cu, cu, 4, 4, 0.1, True, False)
        with pytest.raises(RuntimeError, match="return_debug_mask"):
            _fa4_glue._forward(q, k, k, cu, cu, 4, 4, 0.0, True, True)
        with pytest.raises(RuntimeError, match="num_splits=4"):
            _fa4_glue._forward(q, k, k, cu, cu, 4, 4, 0.0, True, False, num_splits=4)
        with pytest.raises(RuntimeError, match="seqused_k"):
            _fa4_glue._forward(q, k, k, cu, cu, 4, 4, 0.0, True, False, seqused_k=cu)
    finally:
        _registry.restore_flash_attention_impl(_raise_warn=False)
        sys.modules.pop("underlay.backends.portable._fa4_glue", None)
    assert attention.current_flash_attention_impl() is None
