"""CUDA backends: device, Triton kernels, flash-attn attention, NVTX profiler. Imported only when selected."""
