"""Argument-kind checks at the boundary of the public ``ops`` functions.

``@checked`` compares every argument of a call with the function's annotations before the body runs and
raises ``InvalidInput`` naming the function, the parameter, the value and the expected kind, so a wrong
type (``None`` for a tensor, a float for a count, a scalar for a list) never escapes as a foreign
``TypeError``/``AttributeError`` from deep inside torch. What the annotations cannot say (ranges, NaN,
shapes) each function checks itself.

Matching: ``int`` is an integral number other than a bool, ``float`` any real number other than a bool,
``Sequence[X]`` any sequence other than ``str``/``bytes`` (a tensor or an array counts, its elements are
not inspected) whose elements match ``X``, ``Callable`` anything callable, ``Literal`` its values,
unions any member; unknown or generic annotations match anything.
"""

from __future__ import annotations

import collections.abc as cabc
import functools
import inspect
import math
import numbers
import types
import typing
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

from underlay.interfaces import InvalidInput

__all__ = ["checked"]

P = ParamSpec("P")
R = TypeVar("R")


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any or isinstance(hint, TypeVar):
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        seqs = [a for a in args if _depth(a)]
        if isinstance(value, torch.Tensor) and seqs and torch.Tensor in args:
            return any(_matches(value, a) for a in seqs)  # "a list or a tensor" of that shape
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if origin is cabc.Callable or hint is cabc.Callable:
        return callable(value)
    if origin in (cabc.Sequence, list, tuple) or hint in (cabc.Sequence, list, tuple):
        if isinstance(value, (str, bytes, cabc.Mapping)):
            return False
        if isinstance(value, torch.Tensor) or hasattr(value, "__array__"):
            return _array_matches(value, hint)
        if not isinstance(value, cabc.Sequence):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:  # tuple[X, Y]: fixed length
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
        inner = args[0] if args else Any
        return _bad_element(value, inner) is None
    if origin in (cabc.Mapping, dict) or hint in (cabc.Mapping, dict):
        return isinstance(value, cabc.Mapping)
    if hint is cabc.Hashable:
        return isinstance(value, cabc.Hashable)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _bad_element(value: Any, inner: Any) -> str | None:
    """The first element of the sequence ``value`` that does not match ``inner``, described; a whole
    float (``3.0``) counts as an int element."""
    for v in value:
        if inner is int and isinstance(v, numbers.Real) and not isinstance(v, (bool, numbers.Integral)):
            if math.isfinite(v) and float(v).is_integer():
                continue
            return f"{v!r} is not a whole number"
        if not _matches(v, inner):
            return f"{v!r:.40} is not {_describe(inner)}"
    return None


def _why(value: Any, hint: Any) -> str:
    """Why ``value`` fails ``hint``: the first bad element of a sequence, or its type."""
    for h in typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,):
        args = typing.get_args(h)
        if _is_seq(h) and args and isinstance(value, cabc.Sequence) and not isinstance(value, (str, bytes)):
            bad = _bad_element(value, args[0])
            if bad is not None:
                return f"element {bad}"
    if isinstance(value, torch.Tensor):  # wrong dims, or (for ints) values that are not whole numbers
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} (not a whole number or other dims)"
    return f"{repr(value)[:80]} ({type(value).__name__})"


def _is_seq(hint: Any) -> bool:
    origin = typing.get_origin(hint) or hint
    return origin in (cabc.Sequence, list, tuple)


def _depth(hint: Any) -> int:
    """Nesting depth of ``Sequence[...]`` in ``hint`` (``Sequence[Sequence[int]]``: 2)."""
    if not _is_seq(hint):
        return 0
    args = typing.get_args(hint)
    return 1 + (_depth(args[0]) if args else 0)


def _leaf(hint: Any) -> Any:
    while _is_seq(hint):
        args = typing.get_args(hint)
        hint = args[0] if args else Any
    return hint


def _array_matches(value: Any, hint: Any) -> bool:
    """A tensor or array for a ``Sequence`` hint: as many dims as the nesting, whole finite elements
    for ``int`` (read on the host), real ones for ``float``."""
    ndim = getattr(value, "ndim", None)
    if ndim != _depth(hint):
        return False
    leaf = _leaf(hint)
    if isinstance(value, torch.Tensor):
        integral = not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
        real = not value.is_complex() and value.dtype != torch.bool
    else:
        kind = getattr(getattr(value, "dtype", None), "kind", "")
        integral, real = kind in "iu" and kind != "", kind in "iuf" and kind != ""
    if leaf is int and real and not integral:  # whole floats count as ints (e.g. lengths as floats)
        t = torch.as_tensor(value)
        return bool(torch.isfinite(t).all()) and bool((t == t.round()).all())
    return integral if leaf is int else real if leaf is float else True


def _describe(hint: Any) -> str:
    text = str(hint).replace("typing.", "").replace("collections.abc.", "")
    return text.replace("torch.optim.optimizer.", "torch.optim.").replace("<class '", "").replace("'>", "")


def checked(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``fn`` so that each call's arguments are checked against its annotations first
    (``InvalidInput`` naming the parameter and the value); the annotations are resolved once."""
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    hints.pop("return", None)

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise InvalidInput(f"{fn.__name__}{sig}: {exc}") from exc
        for name, value in bound.arguments.items():
            hint = hints.get(name)
            if hint is not None and not _matches(value, hint):
                raise InvalidInput(f"{fn.__name__}: {name}: {_why(value, hint)}; expected {_describe(hint)}")
        return fn(*args, **kwargs)

    return wrapper
