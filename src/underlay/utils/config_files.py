"""Configs from YAML files or OmegaConf/Hydra ``DictConfig`` objects, with dotted command-line overrides.

``load_config(EngineConfig, "engine.yaml", ["optim.lr=1e-5", "parallel.tp=2"])`` reads the file, applies
the overrides (values parsed as YAML: ``1e-5`` is a float, ``true`` a bool, ``[1, 2]`` a list) and builds
the frozen dataclass. Every error is a ``ConfigError`` that starts with the key path: ``optim.lr: ...``
for a value the dataclass refuses, ``optim.lrr: unknown key; did you mean 'lr'?`` for a typo. Works for
any config dataclass (``EngineConfig``, ``ProfilerConfig``, later issues' configs). OmegaConf (the
``config`` extra) is imported only when a file, a ``DictConfig`` or overrides are given.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any, TypeVar

from underlay.interfaces import ConfigError

__all__ = ["load_config", "to_plain"]

T = TypeVar("T")


def _omegaconf() -> Any:
    try:
        import omegaconf
    except ImportError as exc:
        raise ConfigError(
            "loading YAML files, DictConfig objects or dotted overrides needs omegaconf; install it with "
            "`pip install underlay[config]`"
        ) from exc
    return omegaconf


def to_plain(source: str | PathLike[str] | Mapping[str, Any] | Any | None) -> dict[str, Any]:
    """A plain nested ``dict`` from a YAML file path, a mapping or an OmegaConf container (interpolations
    resolved). ``None`` gives ``{}``. Raises ``ConfigError`` for a missing file, YAML that is not a
    mapping at the top, or a source of another type."""
    if source is None:
        return {}
    if isinstance(source, (str, PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML file")
        om = _omegaconf()
        try:
            cfg = om.OmegaConf.load(path)
        except Exception as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
        source = cfg
    if isinstance(source, Mapping):
        return {str(k): v for k, v in source.items()}
    om = _omegaconf()
    if isinstance(source, om.DictConfig):
        plain = om.OmegaConf.to_container(source, resolve=True)
        assert isinstance(plain, dict)
        return {str(k): v for k, v in plain.items()}
    raise ConfigError(
        f"a config source must be a YAML path, a mapping or an OmegaConf DictConfig, got {type(source).__name__}"
    )


def _apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    if not overrides:
        return data
    om = _omegaconf()
    for item in overrides:
        if not isinstance(item, str) or "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"override {item!r}: write it as dotted.key=value, e.g. optim.lr=1e-5")
    try:
        merged = om.OmegaConf.merge(om.OmegaConf.create(data), om.OmegaConf.from_dotlist(list(overrides)))
    except Exception as exc:
        raise ConfigError(f"overrides {list(overrides)}: {exc}") from exc
    plain = om.OmegaConf.to_container(merged, resolve=True)
    assert isinstance(plain, dict)
    return {str(k): v for k, v in plain.items()}


def _nested_dataclass(hint: Any) -> type[Any] | None:
    """The dataclass inside a field's type (``X``, ``X | None``, ``Optional[X]``), else ``None``."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                return arg
    return None


def _is_tuple(hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_tuple(a) for a in typing.get_args(hint))
    return hint is tuple or typing.get_origin(hint) is tuple


_FIELD_IN_MESSAGE = re.compile(r"^(\w+)\.(\w+)\b")


def _build(cls: type[T], data: Any, path: str) -> T:
    where = path or cls.__name__
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in data:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            full = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{full}: unknown key; {hint}valid keys of {cls.__name__}: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        sub = _nested_dataclass(hints.get(key))
        if sub is not None and isinstance(value, Mapping):
            value = _build(sub, value, full)
        elif sub is not None and value is not None and not isinstance(value, sub):
            raise ConfigError(f"{full}: expected a mapping of {sub.__name__} fields, got {value!r}")
        elif isinstance(value, list) and _is_tuple(hints.get(key)):
            value = tuple(value)
        kwargs[str(key)] = value
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        msg = str(exc)
        m = _FIELD_IN_MESSAGE.match(msg)
        if m and m.group(1) == cls.__name__ and m.group(2) in fields:
            where = f"{path}.{m.group(2)}" if path else m.group(2)
        raise ConfigError(f"{where}: {msg}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {type(exc).__name__}: {exc}") from exc


def load_config(
    cls: type[T],
    source: str | PathLike[str] | Mapping[str, Any] | Any | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Build config dataclass ``cls`` from ``source`` (a YAML path, a mapping, an OmegaConf/Hydra
    ``DictConfig``, or ``None`` for the defaults) with dotted ``overrides`` (``["optim.lr=1e-5"]``)
    applied last.

    Raises ``ConfigError`` whose message starts with the offending key path: an unknown key (with the
    closest valid name), a value the dataclass's validation refuses, a malformed override, a missing or
    invalid file, or omegaconf missing when it is needed.
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise ConfigError(f"load_config: {cls!r} is not a config dataclass")
    data = _apply_overrides(to_plain(source), overrides)
    return _build(cls, data, "")
