"""``NpuFusionAttention``: the mapping of causal/window to torch_npu's documented sparse modes and what
``supports`` reports. The kernel itself runs only on an Ascend host (``-m npu``)."""

from __future__ import annotations

import pytest
import torch

from underlay import registry
from underlay.backends.npu.attention import UNBOUNDED, FusionMask, NpuFusionAttention, fusion_mask
from underlay.interfaces import AttentionSpec, UnsupportedOperation


@pytest.mark.parametrize(
    ("causal", "window", "expected"),
    [
        (False, None, FusionMask(0, UNBOUNDED, UNBOUNDED, False)),
        (True, None, FusionMask(3, UNBOUNDED, 0, True)),
        (True, (128, 0), FusionMask(4, 128, 0, True)),
        (True, (128, 7), FusionMask(4, 128, 0, True)),  # causal caps the right side
        (False, (64, 16), FusionMask(4, 64, 16, True)),
        (False, (-1, 16), FusionMask(4, UNBOUNDED, 16, True)),
        (True, (-1, 5), FusionMask(4, UNBOUNDED, 0, True)),
    ],
)
def test_sparse_mode_mapping(causal: bool, window: tuple[int, int] | None, expected: FusionMask) -> None:
    assert fusion_mask(causal, window) == expected


def _spec(**kw: object) -> AttentionSpec:
    base: dict[str, object] = {
        "dtype": torch.bfloat16,
        "head_dim": 128,
        "num_heads": 16,
        "num_kv_heads": 4,
        "device_type": "npu",
    }
    base.update(kw)
    return AttentionSpec(**base)  # type: ignore[arg-type]


def test_supports() -> None:
    kernel = NpuFusionAttention(registry.get_device())
    assert kernel.supports(_spec()) == ()
    assert kernel.supports(_spec(dtype=torch.float32, window=(32, 0))) == ()
    for spec, reason in (
        (_spec(device_type="cpu"), "runs on npu"),
        (_spec(dtype=torch.float64), "fp16/bf16/fp32"),
        (_spec(head_dim=576), "head_dim <= 512"),
        (_spec(head_dim_v=64), "Dv == D"),
        (_spec(softcap=50.0), "softcap"),
    ):
        assert any(reason in r for r in kernel.supports(spec)), spec


def test_cpu_tensors_are_refused_before_torch_npu_is_needed() -> None:
    kernel = NpuFusionAttention(registry.get_device())
    q = torch.randn(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(UnsupportedOperation, match="runs on npu"):
        kernel.varlen(q, q, q, cu, cu, 4, 4)
