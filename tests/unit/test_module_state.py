"""No module-level mutable flags in src/underlay: module state that functions change is a declared cache.

A module-level name that a function rebinds (``global``) or mutates (``d[k] = v``, ``d.update(...)``,
``obj.attr = v``, ``lst.append(...)``, ...) is process-wide state. Settings must not live there (a kernel
or engine option is a constructor argument; a user choice is an environment variable read through
``underlay.utils.env``); the only module state allowed is a cache of facts that cannot change within the
process (a class built once, a hardware property, a probe of the install), or the backend registry, whose
``reset()``/``override()`` the tests use. Each one is listed in :data:`ALLOWED` with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

_SRC = Path(__file__).resolve().parents[2] / "src"

ALLOWED: dict[tuple[str, str], str] = {
    ("underlay/registry.py", "_state"): "the backend registry: selections, built instances, plugins; "
    "reset() and override() (tests use both), guarded by _lock",
    ("underlay/backends/cuda/_logprob_triton.py", "_SMS"): "multiprocessor count per CUDA device index "
    "(a hardware property)",
    ("underlay/backends/cuda/_logprob_triton.py", "_OUT_DTYPE_OK"): "whether this torch's mm takes "
    "out_dtype, per device type (a property of the install)",
    ("underlay/launch/ray.py", "_REMOTE"): "the Ray actor class of _RankWorker, made once (ray.remote)",
    ("underlay/models/_compat.py", "_DISPATCHES"): "per model class: whether its forward dispatches "
    "attention through transformers' AttentionInterface (read from the class source)",
    ("underlay/models/tiled_mlp.py", "_TUPLE_RETURNS"): "per MLP class: whether its forward returns a "
    "tuple (read from the class source)",
    ("underlay/models/vision.py", "_VALUE_CLASSES"): "the value-model class made once per backbone class",
    ("underlay/engines/mcore/layers.py", "CoreAttention"): "megatron's CoreAttention subclass, built on "
    "first use because megatron is imported lazily (a functools.cache would do the same)",
    ("underlay/ops/flex.py", "_FLEX"): "torch.compile(flex_attention), compiled once on first "
    "use (a compiled function, not a setting)",
}
"""``(path under src/, module-level name)`` -> why the mutation is a cache, not a setting."""

_MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "add",
        "update",
        "setdefault",
        "pop",
        "popitem",
        "clear",
        "remove",
        "discard",
    }
)


def _root(node: ast.expr) -> str | None:
    """The name at the root of ``a.b[c].d``, or ``None``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def module_state_mutations(source: str) -> set[str]:
    """Module-level names of ``source`` that a function rebinds through ``global`` or mutates in place
    (item or attribute assignment or deletion, augmented assignment, a mutating method call), the root
    name of a chain such as ``_state.selections.clear()`` counting; names a function binds locally (a
    parameter or an assignment) shadow the module's."""
    tree = ast.parse(source)
    module_names: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        module_names |= {t.id for t in targets if isinstance(t, ast.Name)}
    found: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        declared_global = {n for g in ast.walk(fn) if isinstance(g, ast.Global) for n in g.names}
        found |= declared_global
        args = fn.args
        local = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        local |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        local |= {
            n.id
            for n in ast.walk(fn)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id not in declared_global
        }
        candidates = module_names - local
        for node in ast.walk(fn):
            roots: list[str | None] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
                roots = [_root(t) for t in targets if isinstance(t, (ast.Attribute, ast.Subscript))]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(
                node.target, (ast.Attribute, ast.Subscript)
            ):
                roots = [_root(node.target)]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS
            ):
                roots = [_root(node.func.value)]
            found |= {r for r in roots if r in candidates}
    return found


def test_module_state_is_only_declared_caches() -> None:
    found = {
        (path.relative_to(_SRC).as_posix(), name)
        for path in _SRC.rglob("*.py")
        for name in module_state_mutations(path.read_text())
    }
    undeclared = sorted(found - set(ALLOWED))
    assert not undeclared, (
        f"module-level state changed at run time: {undeclared}; make it an option of the object that "
        "uses it, or, for a cache of facts that cannot change in the process, add it to ALLOWED with why"
    )
    stale = sorted(set(ALLOWED) - found)
    assert not stale, f"ALLOWED lists state that no longer exists: {stale}"


def test_the_checker_finds_each_kind_of_mutation() -> None:
    """Negative controls: each way of changing module state is found; locals and reads are not."""
    cases = {
        "FLAG = False\ndef on():\n    global FLAG\n    FLAG = True\n": {"FLAG"},
        "CACHE = {}\ndef put(k):\n    CACHE[k] = 1\n": {"CACHE"},
        "ITEMS = []\ndef add(x):\n    ITEMS.append(x)\n": {"ITEMS"},
        "class S: pass\nSTATE = S()\ndef f():\n    STATE.mode = 'x'\n": {"STATE"},
        "class S: pass\nSTATE = S()\ndef f():\n    STATE.seen.clear()\n": {"STATE"},
        "COUNTS = {'a': 0}\ndef f():\n    COUNTS['a'] += 1\n": {"COUNTS"},
        "CACHE = {}\ndef f():\n    del CACHE['k']\n": {"CACHE"},
        "CACHE = {}\ndef f(CACHE):\n    CACHE['k'] = 1\n": set(),  # a parameter shadows it
        "CACHE = {}\ndef f():\n    CACHE = {}\n    CACHE['k'] = 1\n": set(),  # a local
        "TABLE = {'a': 1}\ndef f():\n    return TABLE.get('a')\n": set(),  # a read
    }
    for source, want in cases.items():
        assert module_state_mutations(source) == want, source
