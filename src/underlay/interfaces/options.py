"""Typed engine options: each engine declares its ``EngineConfig.options`` as a frozen dataclass.

An options dataclass documents every field with ``field(metadata={"doc": ...})`` and validates values
in its ``__post_init__``. ``resolve_options`` turns what a user put in ``EngineConfig.options`` (a
mapping or the dataclass itself) into a validated instance; ``describe_options`` lists the fields with
their types, defaults and docs (``underlay info`` prints it for every registered engine).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from underlay.interfaces.errors import ConfigError
from underlay.interfaces.types import ProbeResult, RecomputePolicy

__all__ = ["EngineOptions", "OptionInfo", "describe_options", "option", "resolve_options"]

T = TypeVar("T")


class EngineOptions(Protocol):
    """An engine's options dataclass: its fields are the keys of ``EngineConfig.options`` (documented
    with ``option``), and it says which recompute policies the engine runs, before any engine exists
    (``underlay info`` lists both; the registry finds the class through ``BackendSpec.options``)."""

    @staticmethod
    def supports_recompute(policy: RecomputePolicy) -> ProbeResult:
        """``ProbeResult.ok()`` or the reason (and a hint) the engine does not run ``policy``."""
        ...


def option(default: Any, doc: str) -> Any:
    """A dataclass field with a default and its documentation (what ``describe_options`` prints)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class OptionInfo:
    """One option of an engine: ``name``, its type as written in the dataclass, its default, its doc."""

    name: str
    type: str
    default: Any
    doc: str


def describe_options(cls: type[Any]) -> list[OptionInfo]:
    """The fields of the options dataclass ``cls`` in declaration order. ``TypeError`` when ``cls`` is
    not a dataclass."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append(OptionInfo(f.name, str(f.type), default, str(f.metadata.get("doc", ""))))
    return out


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` matches the annotation ``hint`` (bool, int, float, str, None, Literal, unions)."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def resolve_options(cls: type[T], value: Mapping[str, Any] | T, engine: str) -> T:
    """Validated options of type ``cls`` from ``value`` (``EngineConfig.options``): a mapping of field
    names to values, or an instance of ``cls``. Raises ``ConfigError`` naming the engine for unknown
    keys (listing the valid ones), for a value whose type does not match the field's annotation, for
    an instance of another options class, and whatever the dataclass's own validation raises."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"EngineConfig.options for {engine} is a {type(value).__name__}; give a mapping or {cls.__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigError(
            f"EngineConfig.options: unknown {engine} option(s) {unknown}; {engine} accepts {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    for key, v in value.items():
        if not _type_ok(v, hints[key]):
            raise ConfigError(
                f"EngineConfig.options {key}={v!r}: {engine} expects {fields[key].type} "
                f"({fields[key].metadata.get('doc', '')})"
            )
    return cls(**dict(value))
