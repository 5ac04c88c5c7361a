"""No import cycle among the modules of ``underlay.engines``, counting every import (module level and
inside functions): each engine part has one direction of dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import underlay

ENGINES = Path(underlay.__file__).parent / "engines"


def _module(path: Path) -> str:
    parts = path.relative_to(ENGINES.parent.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _graph() -> dict[str, set[str]]:
    files = {_module(f): f for f in ENGINES.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            deps |= {t for t in targets if t in files and t != name}
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_cycle_inside_engines() -> None:
    graph = _graph()
    assert len(graph) > 20, sorted(graph)
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle() -> None:
    """Negative control: a two-module circle is reported."""
    assert _cycle({"a": {"b"}, "b": {"a"}, "c": set()}) == ["a", "b", "a"]
