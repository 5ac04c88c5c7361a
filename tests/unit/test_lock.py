"""``constraints/cpu.txt`` (the lock ``scripts/setup.sh`` installs from) covers every dependency of the
test environment, and this environment is that set, unless it was made from the newest releases on
purpose (``scripts/test_latest.sh`` sets ``UNDERLAY_TEST_LATEST=1``) or for another Python."""

from __future__ import annotations

import os
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCK = Path(__file__).resolve().parents[2] / "constraints" / "cpu.txt"


def _lock() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        assert m, f"constraints/cpu.txt: {line!r} is not a 'name==version' pin"
        pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def _closure(name: str, extras: set[str]) -> set[str]:
    """Every distribution that installing ``name[extras]`` pulls in, from the installed metadata."""
    seen: set[str] = set()
    todo: list[tuple[str, set[str]]] = [(name, extras)]
    while todo:
        dist, want = todo.pop()
        requires = metadata.requires(dist) or []
        for raw in requires:
            req = Requirement(raw)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (want or {""})):
                continue
            child = canonicalize_name(req.name)
            if child == canonicalize_name(name):  # self-reference through extras (underlay[test])
                todo.append((name, set(req.extras)))
                continue
            if child not in seen:
                seen.add(child)
                todo.append((req.name, set(req.extras)))
    return seen


def test_lock_pins_every_dependency_of_the_dev_environment() -> None:
    pins = _lock()
    needed = _closure("underlay", {"dev"})
    missing = sorted(needed - set(pins))
    assert not missing, f"constraints/cpu.txt lacks {missing}: refresh it with scripts/lock.sh"
    assert pins.get("torch") == "2.13.0", "the lock pins the CPU torch on local disk"


@pytest.mark.skipif(
    os.environ.get("UNDERLAY_TEST_LATEST") == "1" or sys.version_info[:2] != (3, 11),
    reason="environment made from the newest releases (UNDERLAY_TEST_LATEST=1) or not Python 3.11",
)
def test_this_environment_is_the_locked_set() -> None:
    pins = _lock()
    off = {}
    for name in sorted(_closure("underlay", {"dev"})):
        have = metadata.version(name).split("+", 1)[0]
        if pins.get(name) != have:
            off[name] = (have, pins.get(name))
    assert not off, f"installed != locked (installed, locked): {off}; run scripts/setup.sh dev"
