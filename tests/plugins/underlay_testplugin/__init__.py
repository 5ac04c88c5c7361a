"""A tiny third-party backend package: what a plugin author ships (see docs/backends.md).

It registers one device backend, ``hostsim``: the host CPU presented under another name, implementing
the whole ``Device`` protocol, so the conformance suite runs against it like any built-in device.
"""

from __future__ import annotations

from underlay.interfaces import ProbeResult
from underlay.registry import BackendSpec


def _probe() -> ProbeResult:
    # A real plugin checks its package and hardware here, cheaply and without side effects.
    return ProbeResult.ok()


def register() -> list[BackendSpec]:
    """Entry point of the group ``underlay.backends``: the backends this package provides."""
    return [
        BackendSpec(
            kind="device",
            name="hostsim",
            target="underlay_testplugin.device:HostSimDevice",
            priority=-10,
            description="test plugin: the host CPU under another name",
            probe=_probe,
        )
    ]
