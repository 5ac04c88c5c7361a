"""The ``cuda`` device: NVIDIA (and ROCm builds of torch) through ``torch.cuda``."""

from __future__ import annotations

from underlay.backends._accelerator import AcceleratorDevice

__all__ = ["CudaDevice"]


class CudaDevice(AcceleratorDevice):
    """``Device`` for CUDA GPUs: nccl collectives, ``CUDA_VISIBLE_DEVICES``, Ray resource ``GPU``."""

    _name = "cuda"
    _dist_backend = "nccl"
    _visible_env = "CUDA_VISIBLE_DEVICES"
    _ray_resource = "GPU"
