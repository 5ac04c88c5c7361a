"""underlay as a training backend for verl 0.9.1 (extra ``verl``; its own venv: ``scripts/setup.sh verl``).

Importing this module registers :class:`UnderlayLMEngine` (``language_model``) and
:class:`UnderlayValueEngine` (``value_model``) in verl's ``EngineRegistry`` under backend
``"underlay"`` for devices cpu, cuda and npu. verl then builds them with
``EngineRegistry.new(model_type, backend="underlay", model_config=..., engine_config=...,
optimizer_config=..., checkpoint_config=...)``; ``engine_config`` is an :class:`UnderlayEngineConfig`
(verl's FSDP engine config with ``strategy="underlay"`` and the underlay engine's name) or verl's
own ``FSDPEngineConfig``. It also registers verl's missing CPU platform
(:class:`~underlay.integrations.verl.platform.CPUPlatform`, selected by ``VERL_PLATFORM=cpu``), which
lets verl's Ray workers (``TrainingWorker``) run on the host CPU. See ``docs/verl.md``.
"""

from __future__ import annotations

# first: verl's engine modules read the platform when imported (verl/workers/engine/fsdp/transformer_impl.py:89
# `device_name = get_device_name()`), so the CPU platform must be registered before they load
from underlay.integrations.verl.platform import CPUPlatform

# isort: split
from underlay.integrations.verl.config import UnderlayEngineConfig, to_underlay_config
from underlay.integrations.verl.engine import UnderlayLMEngine, UnderlayValueEngine

__all__ = [
    "CPUPlatform",
    "UnderlayEngineConfig",
    "UnderlayLMEngine",
    "UnderlayValueEngine",
    "to_underlay_config",
]
