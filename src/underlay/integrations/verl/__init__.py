"""underlay as a training backend for verl 0.9.1 (extra ``verl``; its own venv: ``scripts/setup.sh verl``).

Importing this module registers :class:`UnderlayLMEngine` (``language_model``) and
:class:`UnderlayValueEngine` (``value_model``) in verl's ``EngineRegistry`` under backend
``"underlay"`` for devices cpu, cuda and npu. verl then builds them with
``EngineRegistry.new(model_type, backend="underlay", model_config=..., engine_config=...,
optimizer_config=..., checkpoint_config=...)``; ``engine_config`` is an :class:`UnderlayEngineConfig`
(verl's FSDP engine config with ``strategy="underlay"`` and the underlay engine's name) or verl's
own ``FSDPEngineConfig``. See ``docs/verl.md``.
"""

from __future__ import annotations

from underlay.integrations.verl.config import UnderlayEngineConfig, to_underlay_config
from underlay.integrations.verl.engine import UnderlayLMEngine, UnderlayValueEngine

__all__ = ["UnderlayEngineConfig", "UnderlayLMEngine", "UnderlayValueEngine", "to_underlay_config"]
