"""A CPU platform for verl, registered through verl's platform plugin API (``VERL_PLATFORM=cpu``).

verl 0.9.1 resolves its device once per process through ``verl.plugin.platform.get_platform()``:
``VERL_PLATFORM`` names a class registered with ``PlatformRegistry.register``; without it, it probes
the registered accelerators and falls back to nvidia, so on a CPU-only host ``get_device_name()``
says ``"cuda"`` and ``initialize_global_process_group_ray`` asks for ``cpu:gloo,cuda:nccl``. It ships
no CPU platform. :class:`CPUPlatform` is one: device ``cpu``, process groups on gloo, Ray actors
without accelerator resources, :mod:`underlay.integrations.verl.cpu_device` as the device module.

Importing ``underlay.integrations.verl`` registers it under the name ``"cpu"``; it is chosen only
when ``VERL_PLATFORM=cpu`` is set (:meth:`CPUPlatform.is_platform_available` is False, so verl's
auto-detection on accelerator hosts is unchanged). verl's own ways to import the integration in every
process it starts: ``VERL_USE_EXTERNAL_MODULES=underlay.integrations.verl`` (read by ``import verl``)
or the ``verl.plugins`` entry point underlay declares. Nothing of verl is patched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from verl.plugin.platform import PlatformBase, PlatformRegistry

from underlay.integrations.verl import cpu_device

__all__ = ["PLATFORM_NAME", "CPUPlatform"]

PLATFORM_NAME = "cpu"
"""The ``VERL_PLATFORM`` value that selects :class:`CPUPlatform`."""


@PlatformRegistry.register(platform=PLATFORM_NAME)
class CPUPlatform(PlatformBase):  # type: ignore[misc]
    """verl's ``PlatformBase`` for the host CPU: ``device_name`` ``"cpu"``, communication backend
    ``"gloo"``, Ray resource ``"CPU"`` with no accelerator options, profiler and NVTX hooks as no-ops
    (verl's contract for platforms without a device profiler), no CUDA runtime and no IPC."""

    @property
    def device_name(self) -> str:
        """``"cpu"``: the torch device type tensors and process groups use."""
        return "cpu"

    @property
    def vendor_name(self) -> str:
        """``"cpu"``: no accelerator vendor."""
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        """:mod:`underlay.integrations.verl.cpu_device` (verl's ``get_torch_device()``)."""
        return cpu_device

    def is_available(self) -> bool:
        """Always True: the host CPU is there."""
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        """False: verl's auto-detection never picks the CPU; ``VERL_PLATFORM=cpu`` selects it."""
        return False

    def current_device(self) -> int:
        """0, the only CPU device index."""
        return 0

    def device_count(self) -> int:
        """1: torch addresses the host as one ``cpu`` device."""
        return 1

    def set_device(self, device_index: int) -> None:
        """Accept index 0 only (``InvalidInput`` otherwise)."""
        cpu_device.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        """No-op: CPU kernels complete before they return."""

    def manual_seed(self, seed: int) -> None:
        """Seed torch's global generator."""
        cpu_device.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed torch's global generator (the only device)."""
        cpu_device.manual_seed_all(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """No-op: the settings (``expandable_segments:...``) configure CUDA's caching allocator only."""

    def empty_cache(self) -> None:
        """No-op: nothing cached to release."""

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        """``(None, None)``: no compute capability (verl's value for "not applicable")."""
        return None, None

    def communication_backend_name(self) -> str:
        """``"gloo"``: torch's CPU collective backend."""
        return "gloo"

    def visible_devices_envvar(self) -> str:
        """``"CUDA_VISIBLE_DEVICES"``: verl reads it for device ids; on the CPU it stays unset."""
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        """No range markers on the CPU: yields at once."""
        yield

    def profiler_start(self) -> None:
        """No device profiler on the CPU: no-op (verl's platform contract)."""

    def profiler_stop(self) -> None:
        """No device profiler on the CPU: no-op (verl's platform contract)."""

    def ray_resource_name(self) -> str:
        """``"CPU"``: Ray's resource for host cores."""
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        """``{}``: a CPU actor asks Ray for no accelerator (its placement-group bundle holds its CPUs)."""
        return {}

    def ray_noset_envvars(self) -> list[str]:
        """``[]``: Ray sets no visible-devices variable for CPU actors."""
        return []

    def is_ipc_supported(self) -> bool:
        """False: no device IPC handles on the CPU."""
        return False

    def cudart(self) -> Any:
        """None: no CUDA runtime."""
        return None
