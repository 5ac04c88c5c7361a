"""The ``Profiler`` protocol."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["Profiler"]

F = TypeVar("F", bound=Callable[..., Any])


@runtime_checkable
class Profiler(Protocol):
    """Step-scheduled profiler with named ranges.

    ``start()`` begins a profiling session, ``step()`` marks the end of one training step, ``stop()``
    ends the session and flushes output. Only configured ranks and steps record; elsewhere every call
    is a cheap no-op (under 1 microsecond for ``range`` when off; on a rank that never records,
    ``annotate`` returns the function itself). Backends that write files put one per run of consecutive
    recorded steps in ``ProfilerConfig.output_dir``, named ``rank{r}_step{s}.*``; the contract is
    ``tests/conformance/test_profiler_contract.py``.
    """

    @property
    def name(self) -> str:
        """Registry name: ``"off"``, ``"torch"``, ``"nvtx"``, ``"mstx"``."""

    @property
    def enabled(self) -> bool:
        """Whether this rank records anything at all."""

    def start(self) -> None:
        """Begin profiling (idempotent)."""

    def stop(self) -> None:
        """End profiling and write the output (idempotent)."""

    def step(self) -> None:
        """Advance the step counter; recording follows the configured schedule."""

    def range(self, name: str) -> AbstractContextManager[None]:
        """Context that marks ``name`` around its body in the trace."""

    def annotate(self, name: str | None = None) -> Callable[[F], F]:
        """Decorator marking every call of a sync or async function as a range (default: its qualname)."""
