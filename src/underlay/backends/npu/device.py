"""The ``npu`` device: Huawei Ascend through ``torch_npu`` (imported here, only when selected)."""

from __future__ import annotations

import importlib

from underlay.backends._accelerator import AcceleratorDevice
from underlay.interfaces import BackendUnavailable

__all__ = ["NpuDevice"]


class NpuDevice(AcceleratorDevice):
    """``Device`` for Ascend NPUs: hccl collectives, ``ASCEND_RT_VISIBLE_DEVICES``, Ray resource ``NPU``.

    Importing ``torch_npu`` registers the ``npu`` device type with torch; it happens in the constructor,
    so selecting another device never imports it.
    """

    _name = "npu"
    _dist_backend = "hccl"
    _visible_env = "ASCEND_RT_VISIBLE_DEVICES"
    _ray_resource = "NPU"

    def __init__(self) -> None:
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:
            raise BackendUnavailable(
                "device",
                "npu",
                f"importing torch_npu failed: {type(exc).__name__}: {exc}",
                ["cpu"],
                "install a torch_npu matching your torch and CANN (`pip install underlay[npu]`)",
            ) from exc
        import torch

        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise BackendUnavailable(
                "device",
                "npu",
                "torch_npu is installed but no NPU is visible",
                ["cpu"],
                "check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES",
            )
        super().__init__()
