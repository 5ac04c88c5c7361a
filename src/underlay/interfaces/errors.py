"""Typed errors. Every message names the offending value and the fix."""

from __future__ import annotations

__all__ = [
    "BackendUnavailable",
    "CheckpointError",
    "ConfigError",
    "IncompatibleBackends",
    "InvalidInput",
    "PluginError",
    "UnderlayError",
    "UnknownBackend",
    "UnsupportedOperation",
]


class UnderlayError(Exception):
    """Base class of every error underlay raises on purpose."""


class ConfigError(UnderlayError, ValueError):
    """A configuration value is invalid or two settings contradict each other."""


class InvalidInput(UnderlayError, ValueError):
    """A tensor or argument handed to an operation violates its contract (shape, dtype, device, range).

    Raised at the boundary, before any kernel launch or state change.
    """


class UnknownBackend(UnderlayError, LookupError):
    """A backend name is not registered for that kind. The message lists the valid names."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind, self.name, self.known = kind, name, list(known)
        super().__init__(
            f"unknown {kind} backend {name!r}; valid names: {', '.join(['auto', *known]) or '(none)'}. "
            f"Set UNDERLAY_{kind.upper()} or pass one of these names."
        )


class BackendUnavailable(UnderlayError, RuntimeError):
    """A named backend exists but cannot run on this host (missing package, no hardware, ...)."""

    def __init__(self, kind: str, name: str, reason: str, available: list[str], hint: str = "") -> None:
        self.kind, self.name, self.reason, self.available = kind, name, reason, list(available)
        self.hint = hint
        text = f"{kind} backend {name!r} is unavailable: {reason}."
        if hint:
            text += f" {hint}."
        text += f" Available {kind} backends here: {', '.join(available) or '(none)'}."
        super().__init__(text)


class IncompatibleBackends(UnderlayError, RuntimeError):
    """Two selected backends cannot work together (e.g. mcore on a cpu device)."""


class PluginError(UnderlayError, RuntimeError):
    """A third-party backend plugin failed to load; the message names the plugin and its exception."""


class UnsupportedOperation(UnderlayError, RuntimeError):
    """The selected backend cannot do this operation on this hardware (e.g. CUDA memory snapshots on cpu)."""


class CheckpointError(UnderlayError, RuntimeError):
    """A checkpoint is missing, incomplete, or belongs to another model or shape."""
