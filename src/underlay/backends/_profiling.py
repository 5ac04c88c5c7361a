"""Plumbing shared by every profiler backend: the rank and step filter, the no-op range, ``annotate``.

Backends subclass :class:`ProfilerBase` and implement three hooks: ``_open(name)`` (the context of one
range while recording), ``_enter_block()``/``_leave_block()`` (a run of consecutive recorded steps starts
or ends) and optionally ``_on_start``/``_on_stop``/``_on_step``. The base class decides *when* anything
records, so that ``range``/``annotate`` behave the same under every backend.
"""

from __future__ import annotations

import abc
import functools
import inspect
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, TypeVar, cast

from underlay.interfaces import ConfigError, Device, IncompatibleBackends, InvalidInput, ProfilerConfig
from underlay.parallel.rank import current_rank

__all__ = [
    "NULL_RANGE",
    "HookRange",
    "NullRange",
    "ProfilerBase",
    "check_options",
    "identity",
    "require_device",
]

F = TypeVar("F", bound=Callable[..., Any])


class NullRange:
    """A reusable, reentrant context manager that does nothing (cheaper than a fresh ``nullcontext``)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


NULL_RANGE = NullRange()
"""The shared do-nothing range returned whenever a profiler does not record."""


def identity(fn: F) -> F:
    """The decorator that returns the function itself (``annotate`` of a profiler that never records)."""
    return fn


def require_device(backend: str, device: Device, needed: str, instead: str) -> None:
    """Raise ``IncompatibleBackends`` unless ``device.name == needed``; ``instead`` names what to use."""
    if device.name != needed:
        raise IncompatibleBackends(
            f"the {backend!r} profiler needs the {needed} device, got device {device.name!r}; use {instead}"
        )


def check_options(backend: str, options: Mapping[str, Any], allowed: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``ProfilerConfig.options`` for ``backend`` against ``allowed`` (option -> default value).

    Returns the defaults updated with ``options``. An unknown key raises ``ConfigError`` listing the valid
    ones; a value whose type differs from its default's type raises ``ConfigError`` naming both.
    """
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"ProfilerConfig.options {unknown} are not understood by the {backend!r} profiler; "
            f"valid options: {sorted(allowed) or '(none)'}"
        )
    out = dict(allowed)
    for key, value in options.items():
        default = allowed[key]
        if default is not None and type(value) is not type(default):
            raise ConfigError(
                f"ProfilerConfig.options[{key!r}]={value!r} for the {backend!r} profiler: expected "
                f"{type(default).__name__} (default {default!r})"
            )
        out[key] = value
    return out


class ProfilerBase(abc.ABC):
    """Rank/step filtering and ``annotate`` shared by the recording backends.

    Steps are counted by :meth:`step` from construction (0-based; the work before the first ``step()``
    call is step 0), whether or not the profiler is started. This rank records when
    ``config.enabled`` and ``config.ranks`` is empty or holds the rank read at construction
    (:func:`current_rank`). Between :meth:`start` and :meth:`stop` a step records when it is in
    ``config.steps`` (or always when ``config.steps`` is empty); only then does :meth:`range` open a
    backend range, otherwise it returns the shared no-op :data:`NULL_RANGE`.
    """

    _NAME = ""

    def __init__(self, config: ProfilerConfig, device: Device) -> None:
        if not isinstance(config, ProfilerConfig):
            raise InvalidInput(
                f"{type(self).__name__}: config must be a ProfilerConfig, got {type(config).__name__}; "
                "build one with ProfilerConfig.load(dict_or_omegaconf)"
            )
        self._config = config
        self._device = device
        self._rank = current_rank()
        self._enabled = bool(config.enabled) and (not config.ranks or self._rank in config.ranks)
        self._steps = frozenset(config.steps)
        self._step = 0
        self._started = False
        self._recording = False

    # -- identity and state
    @property
    def name(self) -> str:
        """Registry name of the backend."""
        return self._NAME

    @property
    def enabled(self) -> bool:
        """Whether this rank records anything at all (``config.enabled`` and the rank filter)."""
        return self._enabled

    @property
    def rank(self) -> int:
        """The global rank read at construction."""
        return self._rank

    @property
    def current_step(self) -> int:
        """Index of the step in progress (number of ``step()`` calls so far)."""
        return self._step

    @property
    def recording(self) -> bool:
        """Whether the step in progress records (started, enabled rank, configured step)."""
        return self._recording

    def _records(self, step: int) -> bool:
        return not self._steps or step in self._steps

    # -- lifecycle
    def start(self) -> None:
        """Begin the session on an enabled rank (idempotent; a no-op on other ranks)."""
        if not self._enabled or self._started:
            return
        self._started = True
        self._on_start()
        if self._records(self._step):
            self._recording = True
            self._enter_block()
            self._on_record_step()

    def stop(self) -> None:
        """End the session and flush what was recorded (idempotent)."""
        if not self._started:
            return
        if self._recording:
            self._recording = False
            self._leave_block()
        self._started = False
        self._on_stop()

    def step(self) -> None:
        """End the step in progress; the next one records if it is a configured step."""
        self._step += 1
        if not self._started:
            return
        now = self._records(self._step)
        if self._recording and not now:
            self._recording = False
            self._leave_block()
        self._on_step()
        if now and not self._recording:
            self._recording = True
            self._enter_block()
        if now:
            self._on_record_step()

    def __enter__(self) -> ProfilerBase:
        """``with prof:`` starts the session and stops it on exit."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- ranges
    def range(self, name: str) -> AbstractContextManager[None]:
        """Context marking ``name`` around its body while the step in progress records; otherwise the
        shared no-op context."""
        if self._recording:
            return self._open(name)
        return NULL_RANGE

    def annotate(self, name: str | None = None) -> Callable[[F], F]:
        """Decorator marking every call of a sync or async function as the range ``name`` (default: the
        function's ``__qualname__``). On a rank that never records it returns the function itself. For an
        ``async def`` function the range spans the awaited body; for a generator function it spans only
        the call that creates the generator."""
        if not self._enabled:
            return identity
        if name is not None and (not isinstance(name, str) or not name):
            raise InvalidInput(f"annotate(name={name!r}): name must be a non-empty str or None")
        prof = self

        def decorate(fn: F) -> F:
            label = name or getattr(fn, "__qualname__", None) or repr(fn)
            if inspect.iscoroutinefunction(fn):

                @functools.wraps(fn)
                async def awrapper(*args: Any, **kwargs: Any) -> Any:
                    with prof.range(label):
                        return await fn(*args, **kwargs)

                return cast(F, awrapper)

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                with prof.range(label):
                    return fn(*args, **kwargs)

            return cast(F, wrapper)

        return decorate

    # -- hooks for backends
    @abc.abstractmethod
    def _open(self, name: str) -> AbstractContextManager[None]:
        """The backend's context for one range named ``name`` (called only while recording)."""

    def _on_start(self) -> None:  # noqa: B027 - optional hook
        """Session begins (before the first block is entered)."""

    def _on_stop(self) -> None:  # noqa: B027 - optional hook
        """Session ends (after the last block is left)."""

    def _on_step(self) -> None:  # noqa: B027 - optional hook
        """Called at every ``step()`` of a started session, between leaving and entering blocks."""

    def _on_record_step(self) -> None:  # noqa: B027 - optional hook
        """A recorded step begins at ``self._step`` (after ``_enter_block`` when it starts a run)."""

    def _enter_block(self) -> None:  # noqa: B027 - optional hook
        """A run of consecutive recorded steps begins at ``self._step``."""

    def _leave_block(self) -> None:  # noqa: B027 - optional hook
        """The run of recorded steps that ended at ``self._step - 1`` (or at stop) is over."""


class HookRange:
    """A range whose enter and exit call two functions: ``begin(name) -> token`` and ``end(token)``."""

    __slots__ = ("_begin", "_end", "_name", "_token")

    def __init__(self, begin: Callable[[str], Any], end: Callable[[Any], Any], name: str) -> None:
        self._begin, self._end, self._name = begin, end, name
        self._token: Any = None

    def __enter__(self) -> None:
        self._token = self._begin(self._name)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._end(self._token)
