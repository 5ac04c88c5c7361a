"""The plugin's device: imported only once ``hostsim`` is selected."""

from __future__ import annotations

from underlay.backends.cpu.device import CpuDevice


class HostSimDevice(CpuDevice):
    """The host CPU as a plugin device named ``hostsim``."""

    @property
    def name(self) -> str:
        """``"hostsim"``."""
        return "hostsim"
