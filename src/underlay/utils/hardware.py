"""Peak dense matmul throughput of known accelerators (vendor datasheets, dense, no sparsity)."""

from __future__ import annotations

import torch

from underlay.utils import env

__all__ = ["PEAK_TFLOPS", "lookup_peak_flops", "peak_flops_from_env"]

# (name fragment matched against the upper-cased device name, bf16/fp16 dense TFLOP/s, fp32 TFLOP/s)
# More specific fragments come first ("H100 PCIE" before "H100", "GB200" before "B200").
PEAK_TFLOPS: tuple[tuple[str, float, float | None], ...] = (
    ("GB200", 2500.0, 80.0),
    ("B200", 2250.0, 80.0),
    ("B100", 1750.0, 60.0),
    ("H200 NVL", 835.5, 60.0),
    ("H200", 989.4, 66.9),
    ("H100 PCIE", 756.5, 51.2),
    ("H100 NVL", 835.5, 60.0),
    ("H100", 989.4, 66.9),
    ("H800 PCIE", 756.5, 51.2),
    ("H800", 989.4, 66.9),
    ("H20", 148.0, 44.0),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.05, 91.6),
    ("L40", 181.05, 90.5),
    ("L20", 119.5, 59.8),
    ("L4", 121.0, 30.3),
    ("A10G", 70.0, 31.2),
    ("A10", 125.0, 31.2),
    ("RTX 4090", 165.2, 82.6),
    ("MI325X", 1307.4, 163.4),
    ("MI300X", 1307.4, 163.4),
    ("MI250X", 383.0, 95.7),
    ("ASCEND910B", 354.0, None),
    ("910B", 354.0, None),
)


def peak_flops_from_env() -> float | None:
    """``UNDERLAY_PEAK_TFLOPS`` (TFLOP/s) in FLOP/s, or ``None`` when unset. Anything but a finite number
    > 0 raises ``ConfigError``."""
    value = env.get_float("UNDERLAY_PEAK_TFLOPS", positive=True)
    return None if value is None else value * 1e12


def lookup_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of ``device_name`` for ``dtype`` (bf16/fp16: tensor cores; fp32: plain FP32;
    fp8: twice bf16 on chips from Hopper on), or ``None`` for an unknown device or dtype."""
    upper = device_name.upper()
    for fragment, half, single in PEAK_TFLOPS:
        if fragment in upper:
            if dtype in (torch.bfloat16, torch.float16):
                return half * 1e12
            if dtype == torch.float32:
                return None if single is None else single * 1e12
            if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and fragment[:1] in ("H", "B", "G"):
                return 2 * half * 1e12
            return None
    return None
