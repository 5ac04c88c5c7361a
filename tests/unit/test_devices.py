"""Device backends beyond the conformance suite: npu laziness and errors, the peak-FLOPs table, cpu memory."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

import underlay
from underlay.interfaces import BackendUnavailable
from underlay.utils.hardware import lookup_peak_flops


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_npu_without_torch_npu_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERLAY_DEVICE", "npu")
    with pytest.raises(BackendUnavailable) as err:
        underlay.get_device()
    assert "torch_npu" in err.value.reason
    assert "underlay[npu]" in str(err.value)


def test_npu_module_imports_torch_npu_only_when_constructed() -> None:
    code = (
        "import sys, underlay.backends.npu.device as m; "
        "print('torch_npu' in sys.modules, hasattr(m, 'NpuDevice'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "True"]


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H200", torch.bfloat16, 989.4),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5),
        ("NVIDIA H100 80GB HBM3", torch.float16, 989.4),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA H20", torch.bfloat16, 148.0),
        ("NVIDIA L40S", torch.bfloat16, 362.05),
        ("NVIDIA GB200", torch.bfloat16, 2500.0),
        ("AMD Instinct MI300X", torch.bfloat16, 1307.4),
        ("Ascend910B2", torch.bfloat16, 354.0),
        ("NVIDIA H200", torch.float32, 66.9),
        ("NVIDIA H200", torch.float8_e4m3fn, 2 * 989.4),
    ],
)
def test_peak_flops_table(name: str, dtype: torch.dtype, tflops: float) -> None:
    value = lookup_peak_flops(name, dtype)
    assert value is not None
    assert value == pytest.approx(tflops * 1e12)


def test_unknown_model_gives_none_not_a_crash() -> None:
    assert lookup_peak_flops("Imaginary Accelerator 9000", torch.bfloat16) is None
    assert lookup_peak_flops("NVIDIA H200", torch.int8) is None


def test_cpu_peak_flops_is_measured_and_cached() -> None:
    dev = underlay.get_device("cpu")
    a = dev.peak_flops(torch.float32)
    assert a is not None
    assert a > 1e8
    assert dev.peak_flops(torch.float32) == a
