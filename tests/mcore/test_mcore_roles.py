"""The mcore engine refuses ``EngineConfig(role="reference")`` by name, before any work (an
inference-only build is an fsdp2 feature: ``tests/distributed/test_reference_role.py``)."""

from __future__ import annotations

import pytest

from tests.mcore._helpers import tiny_config
from underlay.interfaces import ConfigError, EngineConfig, ModelConfig

pytestmark = pytest.mark.mcore


def test_mcore_refuses_the_reference_role() -> None:
    from underlay.engines.mcore.engine import MCoreEngine
    from underlay.registry import get_device

    cfg = EngineConfig(model=ModelConfig(hf_config=tiny_config("llama")), role="reference")
    with pytest.raises(ConfigError, match="mcore: EngineConfig.role='reference' is not supported"):
        MCoreEngine(cfg, get_device("cpu"))
