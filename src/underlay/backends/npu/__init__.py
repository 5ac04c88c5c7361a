"""Ascend NPU backends: device, fusion attention, mstx profiler. Import torch_npu only when selected."""
