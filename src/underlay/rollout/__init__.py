"""Rollout interface: weight sync to inference engines, rollout trace and replay.

- ``WeightSender`` / ``WeightReceiver`` (``underlay.rollout.transport``): stream an engine's weights
  (``WeightPayload``: full, LoRA adapters, FP8) to inference workers, colocated (shared memory / CUDA
  IPC) or disaggregated (a broadcast group of its own), versioned and all-or-nothing on the receiver.
- Sinks (``underlay.rollout.sinks``): ``ModuleSink`` (a torch / transformers model, double-buffered),
  ``StagingSink`` (stage then hand to an engine's loader), ``AdapterDirSink`` (peft adapter dirs).
- ``HFRolloutWorker``: a transformers model in its own process kept in step through a receiver.
- ``underlay.rollout.adapters``: vLLM and SGLang hooks over the same receiver.
- ``RolloutTracer`` / ``RolloutReplay`` (``underlay.rollout.trace``): rollout rows, dumps and replay.

Attributes are imported on first use: ``import underlay.rollout`` imports neither transformers nor peft.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "AdapterDirSink",
    "HFRolloutWorker",
    "ModuleSink",
    "RolloutRecord",
    "RolloutReplay",
    "RolloutTracer",
    "StagingSink",
    "SyncReport",
    "WeightPayload",
    "WeightReceiver",
    "WeightSender",
    "WeightSink",
    "WeightSyncError",
    "peft_param_name",
]

_WHERE = {
    "AdapterDirSink": "sinks",
    "ModuleSink": "sinks",
    "StagingSink": "sinks",
    "WeightSink": "sinks",
    "peft_param_name": "sinks",
    "HFRolloutWorker": "hf_worker",
    "RolloutRecord": "trace",
    "RolloutReplay": "trace",
    "RolloutTracer": "trace",
    "SyncReport": "transport",
    "WeightReceiver": "transport",
    "WeightSender": "transport",
    "WeightSyncError": "transport",
    "WeightPayload": "payload",
}

if TYPE_CHECKING:
    from underlay.rollout.hf_worker import HFRolloutWorker
    from underlay.rollout.payload import WeightPayload
    from underlay.rollout.sinks import AdapterDirSink, ModuleSink, StagingSink, WeightSink, peft_param_name
    from underlay.rollout.trace import RolloutRecord, RolloutReplay, RolloutTracer
    from underlay.rollout.transport import SyncReport, WeightReceiver, WeightSender, WeightSyncError


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"underlay.rollout.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'underlay.rollout' has no attribute {name!r}")
