"""Starting the default process group from torchrun or Ray environment variables."""

from __future__ import annotations

import atexit
import datetime
import os
import socket

import torch.distributed as dist

from underlay.interfaces import ConfigError, Device
from underlay.registry import get_device
from underlay.utils import env as _env

__all__ = ["DistributedEnv", "free_port", "init_distributed", "read_env"]


class DistributedEnv:
    """Rank, local rank and world size read from the environment."""

    def __init__(
        self, rank: int, local_rank: int, world_size: int, master_addr: str, master_port: int
    ) -> None:
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.master_addr, self.master_port = master_addr, master_port

    def __repr__(self) -> str:
        return (
            f"DistributedEnv(rank={self.rank}, local_rank={self.local_rank}, world_size={self.world_size}, "
            f"master={self.master_addr}:{self.master_port})"
        )


def free_port() -> int:
    """An unused TCP port on localhost (for single-host launches)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _int_env(name: str, default: int) -> int:
    value = _env.get_int(name)
    return default if value is None else value


def read_env() -> DistributedEnv:
    """Rank and world from torchrun (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) or, under Ray, the same names set by the launcher; ``RAY_LOCAL_RANK`` is accepted
    for the local rank. Without any of them: a single process (rank 0 of 1) on a free local port."""
    world = _int_env("WORLD_SIZE", 1)
    rank = _int_env("RANK", 0)
    local = _int_env("LOCAL_RANK", _int_env("RAY_LOCAL_RANK", rank if world == 1 else 0))
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={world} must be >= 1")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    if local < 0:
        raise ConfigError(f"LOCAL_RANK={local} is negative; local ranks are >= 0")
    addr = _env.get("MASTER_ADDR")
    if world > 1 and _env.get_optional("MASTER_PORT") is None:
        raise ConfigError(
            "WORLD_SIZE > 1 but MASTER_PORT is not set; launch with torchrun or set MASTER_ADDR/PORT"
        )
    port = _int_env("MASTER_PORT", 0)
    if not 0 <= port <= 65535:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port (0..65535)")
    port = port or free_port()
    return DistributedEnv(rank, local, world, addr, port)


def init_distributed(
    device: Device | None = None, *, timeout_s: float = 1800.0, backend: str | None = None
) -> DistributedEnv:
    """Initialise the default process group with the device's collective backend (gloo on cpu, nccl on
    cuda, hccl on npu; ``backend`` overrides) and bind this process to its local device. Idempotent:
    when a group already exists it only returns the environment. A gloo group it starts and the caller
    has not destroyed is destroyed at interpreter exit. Returns the rank/world it used."""
    dev = device or get_device()
    env = read_env()
    if dev.is_accelerator:
        count = dev.device_count()
        if count < 1:
            raise ConfigError(
                f"device {dev.name!r} reports no visible devices; check {dev.visible_devices_env}"
            )
        dev.set_device(env.local_rank % count)
    if dist.is_initialized():
        return env
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    kwargs: dict[str, object] = {}
    if dev.is_accelerator:
        kwargs["device_id"] = dev.torch_device(env.local_rank % dev.device_count())
    dist.init_process_group(
        backend=backend or dev.dist_backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        **kwargs,  # type: ignore[arg-type]
    )
    if dist.get_backend() == "gloo":
        atexit.unregister(_destroy_gloo_at_exit)  # registered once however often a group is started
        atexit.register(_destroy_gloo_at_exit)
    return env


def _destroy_gloo_at_exit() -> None:
    """Destroy a gloo default group this module started, at interpreter exit, before the C++ static
    destructors run (the README example, one process with a gloo group alive at exit, once ended with
    ``std::terminate``, "terminate called without an active exception", after all its work was done;
    torch asks for ``destroy_process_group`` before exit). Local (no collective), so it cannot wait on
    other ranks; never raises. Accelerator groups (NCCL, HCCL) are left to their own shutdown:
    destroying one at exit can block on a collective that never completed."""
    try:
        if dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except Exception:  # at exit: nothing to report to, and the process is ending anyway
        pass
