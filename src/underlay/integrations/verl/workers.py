"""verl's ``TrainingWorker`` on the CPU platform: the one line of verl 0.9.1 that cannot run there.

``TrainingWorker.__init__`` (``verl/workers/engine_workers.py:89``) calls
``initialize_global_process_group_ray(timeout_second=None)``, whose default backend string is
``f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"`` (``verl/utils/distributed.py:89``). On
:class:`~underlay.integrations.verl.platform.CPUPlatform` that is ``"cpu:gloo,cpu:gloo"``, which
``torch.distributed.init_process_group`` rejects ("Duplicate device type cpu"); no config field or
environment variable of verl changes it. :class:`CPUTrainingWorker` forms the same process group first
through the same verl function with its ``backend`` argument (``"cpu:gloo"``, what verl's own
checkpoint engines pass in ``verl/checkpoint_engine/base.py``); ``TrainingWorker.__init__`` then finds
the group initialised and skips its call. Every other line is verl's. Importing this module imports
``verl.workers.engine_workers`` (verl's trainer side: Ray, uvicorn, fastapi).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from verl.utils.device import get_device_name
from verl.utils.distributed import initialize_global_process_group_ray
from verl.workers.engine_workers import TrainingWorker

from underlay.interfaces import ConfigError

__all__ = ["CPUTrainingWorker"]


class CPUTrainingWorker(TrainingWorker):  # type: ignore[misc]
    """verl's ``TrainingWorker`` for ``VERL_PLATFORM=cpu``: ``ray.remote(CPUTrainingWorker)`` in place of
    ``ray.remote(TrainingWorker)``; same constructor (``config: TrainingWorkerConfig``), same methods.
    Raises ``ConfigError`` on any other platform (use verl's ``TrainingWorker`` there)."""

    def __init__(self, config: Any) -> None:
        device = get_device_name()
        if device != "cpu":
            raise ConfigError(
                f"CPUTrainingWorker on verl platform device {device!r}: it exists for VERL_PLATFORM=cpu only; "
                "use verl's TrainingWorker on accelerators"
            )
        if not dist.is_initialized():  # RANK/WORLD_SIZE/MASTER_* come from RayWorkerGroup's actor env
            initialize_global_process_group_ray(timeout_second=None, backend="cpu:gloo")
        super().__init__(config)
