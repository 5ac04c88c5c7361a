"""The UNDERLAY_* table, config files with dotted overrides, rank-aware logging."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

from underlay.interfaces import ConfigError, EngineConfig, ProfilerConfig
from underlay.parallel.logging import setup_logging
from underlay.utils import env
from underlay.utils.config_files import load_config

_ROOT = Path(__file__).resolve().parents[2]
_SRC = _ROOT / "src"
_ENV_MODULE = "underlay/utils/env.py"

# ---- the rules: every environment read goes through underlay.utils.env, of a declared variable -------

_WRITES = {"update", "setdefault", "pop"}
"""``os.environ`` methods a launcher may call to prepare a process, as statements (their value unused)."""


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _direct_reads(source: str) -> list[int]:
    """Lines that read the process environment without ``underlay.utils.env``: any use of ``os.environ``
    (or ``environ`` imported from ``os``) other than a write (``os.environ[k] = v``, ``del os.environ[k]``,
    or ``update``/``setdefault``/``pop`` called as a statement), and any ``os.getenv``/``os.environb``."""
    tree = ast.parse(source)
    os_names, environ_names, getenv_names = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for a in node.names:
                if a.name in ("environ", "environb"):
                    environ_names.add(a.asname or a.name)
                elif a.name in ("getenv", "getenvb"):
                    getenv_names.add(a.asname or a.name)
    parent = _parents(tree)
    bad: list[int] = []
    for node in ast.walk(tree):
        is_os_attr = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        is_os_attr = is_os_attr and node.value.id in os_names  # type: ignore[attr-defined]
        if (is_os_attr and node.attr in ("getenv", "getenvb", "environb")) or (  # type: ignore[attr-defined]
            isinstance(node, ast.Name) and node.id in getenv_names
        ):
            bad.append(node.lineno)  # type: ignore[attr-defined]
            continue
        environ = (is_os_attr and node.attr == "environ") or (  # type: ignore[attr-defined]
            isinstance(node, ast.Name) and node.id in environ_names and isinstance(node.ctx, ast.Load)
        )
        if not environ:
            continue
        up = parent.get(node)
        if isinstance(up, ast.Subscript) and isinstance(up.ctx, (ast.Store, ast.Del)):
            continue
        if isinstance(up, ast.Attribute) and up.attr in _WRITES:
            call = parent.get(up)
            if isinstance(call, ast.Call) and call.func is up and isinstance(parent.get(call), ast.Expr):
                continue
        bad.append(node.lineno)  # type: ignore[attr-defined]
    return bad


def _accessor_names(source: str) -> list[tuple[int, str | None]]:
    """``(line, variable name)`` of every call of an ``underlay.utils.env`` accessor (``get``,
    ``get_optional``, ``get_int``, ``get_float``, ``get_bool``); the name is the literal argument or the
    module-level string constant it names, ``None`` when it is computed."""
    tree = ast.parse(source)
    modules: set[str] = set()
    functions: set[str] = set()
    constants: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if isinstance(t, ast.Name) and isinstance(node.value.value, str):
                    constants[t.id] = node.value.value
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "underlay.utils":
            modules |= {a.asname or a.name for a in node.names if a.name == "env"}
        elif isinstance(node, ast.ImportFrom) and node.module == "underlay.utils.env":
            functions |= {a.asname or a.name for a in node.names if a.name.startswith("get")}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "underlay.utils.env" and a.asname}
    out: list[tuple[int, str | None]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        f = node.func
        via_module = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules
        if not (via_module and f.attr.startswith("get")) and not (  # type: ignore[union-attr]
            isinstance(f, ast.Name) and f.id in functions
        ):
            continue
        arg = node.args[0]
        name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
        if isinstance(arg, ast.Name):
            name = constants.get(arg.id)
        out.append((node.lineno, name))
    return out


def _sources(*roots: Path) -> dict[str, str]:
    return {
        p.relative_to(_ROOT).as_posix(): p.read_text()
        for root in roots
        if root.exists()
        for p in root.rglob("*.py")
    }


def test_src_reads_the_environment_only_through_utils_env() -> None:
    """Nothing in src/ but underlay/utils/env.py reads os.environ or calls os.getenv (writes that prepare
    a process are allowed), and every accessor call names a declared variable."""
    reads, undeclared = {}, {}
    for path, text in _sources(_SRC).items():
        if path.endswith(_ENV_MODULE):
            continue
        if lines := _direct_reads(text):
            reads[path] = lines
        bad = [
            (line, name)
            for line, name in _accessor_names(text)
            if name is not None and name not in env.ENV_VARS
        ]
        if bad:
            undeclared[path] = bad
    assert not reads, f"read the environment through underlay.utils.env instead: {reads}"
    assert not undeclared, f"declare these in underlay.utils.env.ENV_VARS: {undeclared}"


def test_every_underlay_variable_is_declared_and_every_declared_one_is_read() -> None:
    """Each UNDERLAY_* name in src/ is in the table; each table entry is a string constant somewhere in
    src/ outside the table (the code that reads it). Tests, benchmarks and examples name only declared
    variables (or the test harness's own UNDERLAY_TEST_*), so a switch that stopped existing cannot
    linger in them doing nothing."""
    found: dict[str, set[str]] = {}
    literals: set[str] = set()
    for path, text in _sources(_SRC).items():
        for name in re.findall(r"\bUNDERLAY_[A-Z0-9_]+\b", text):
            found.setdefault(name, set()).add(path)
        if not path.endswith(_ENV_MODULE):
            literals |= {
                n.value
                for n in ast.walk(ast.parse(text))
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            }
    missing = {n: sorted(p) for n, p in found.items() if n not in env.ENV_VARS}
    assert not missing, f"named in src but not in underlay.utils.env.ENV_VARS: {missing}"
    assert set(env.ENV_VARS) <= literals, f"declared but read nowhere: {set(env.ENV_VARS) - literals}"
    outside: dict[str, set[str]] = {}
    for path, text in _sources(_ROOT / "tests", _ROOT / "benchmarks", _ROOT / "examples").items():
        for name in re.findall(r"\bUNDERLAY_[A-Z0-9_]+\b", text):
            if name not in env.ENV_VARS and not name.startswith("UNDERLAY_TEST_"):
                outside.setdefault(name, set()).add(path)
    assert not outside, f"set or named but not a declared variable (gone?): {outside}"


def test_the_rules_catch_violations() -> None:
    """Negative controls of the two checkers above, on small sources."""
    flagged = {
        "import os\nx = os.environ.get('A')\n": [2],
        "import os\nif 'A' in os.environ:\n    pass\n": [2],
        "import os\ny = dict(os.environ)\n": [2],
        "import os as o\no.getenv('A')\n": [2],
        "from os import environ as e\nx = e['A']\n": [2],
        "from os import getenv\nx = getenv('A')\n": [2],
        "import os\nx = os.environ.setdefault('A', '1')\n": [2],
        "import os\nenv = os.environ.copy()\n": [2],
    }
    for source, lines in flagged.items():
        assert _direct_reads(source) == lines, source
    allowed = (
        "import os\nos.environ.update(A='1')\nos.environ.setdefault('B', '2')\nos.environ['C'] = '3'\n"
        "del os.environ['C']\nos.environ.pop('B', None)\nos.getpid()\n"
    )
    assert _direct_reads(allowed) == []
    src = (
        "from underlay.utils import env as _e\nfrom underlay.utils.env import get_bool\nN = 'RANK'\n"
        "_e.get('RANK')\n_e.get_int(N)\nget_bool('UNDERLAY_" + "MISSING')\n_e.get_optional(f())\n"
    )
    assert _accessor_names(src) == [(4, "RANK"), (5, "RANK"), (6, "UNDERLAY_" + "MISSING"), (7, None)]


def test_registry_kind_variables_are_in_the_table() -> None:
    from underlay import registry

    assert set(registry.ENV_VARS.values()) | {registry.PLUGIN_ENV} <= set(env.ENV_VARS)


def test_env_accessors(monkeypatch: pytest.MonkeyPatch) -> None:
    unknown = "UNDERLAY_" + "NOPE"
    for name in (
        "UNDERLAY_LOG_LEVEL",
        "LOCAL_RANK",
        "UNDERLAY_PEAK_TFLOPS",
        "UNDERLAY_MCORE_CPU_FIXTURE",
        "RANK",
    ):
        monkeypatch.delenv(name, raising=False)
    assert env.get("UNDERLAY_LOG_LEVEL") == "INFO" and env.get_optional("UNDERLAY_LOG_LEVEL") is None
    monkeypatch.setenv("UNDERLAY_LOG_LEVEL", " debug ")
    assert env.get("UNDERLAY_LOG_LEVEL") == "debug" == env.get_optional("UNDERLAY_LOG_LEVEL")
    monkeypatch.setenv("UNDERLAY_LOG_LEVEL", "  ")
    assert env.get("UNDERLAY_LOG_LEVEL") == "INFO" and env.get_optional("UNDERLAY_LOG_LEVEL") is None
    assert env.get("LOCAL_RANK") == "" and env.get_int("LOCAL_RANK") is None
    assert env.get_int("RANK") == 0  # the table's default
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert env.get_int("LOCAL_RANK", minimum=0) == 3
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK='-1' is not an integer >= 0"):
        env.get_int("LOCAL_RANK", minimum=0)
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK='x' is not an integer"):
        env.get_int("LOCAL_RANK")
    assert env.get_float("UNDERLAY_PEAK_TFLOPS") is None
    monkeypatch.setenv("UNDERLAY_PEAK_TFLOPS", "989.5")
    assert env.get_float("UNDERLAY_PEAK_TFLOPS", positive=True) == 989.5
    for bad in ("0", "-1", "nan", "inf", "fast"):
        monkeypatch.setenv("UNDERLAY_PEAK_TFLOPS", bad)
        with pytest.raises(ConfigError, match=f"UNDERLAY_PEAK_TFLOPS='{bad}' is not a finite number > 0"):
            env.get_float("UNDERLAY_PEAK_TFLOPS", positive=True)
    assert env.get_bool("UNDERLAY_MCORE_CPU_FIXTURE") is False
    for value, want in (("1", True), ("TRUE", True), ("on", True), ("0", False), ("No", False)):
        monkeypatch.setenv("UNDERLAY_MCORE_CPU_FIXTURE", value)
        assert env.get_bool("UNDERLAY_MCORE_CPU_FIXTURE") is want, value
    monkeypatch.setenv("UNDERLAY_MCORE_CPU_FIXTURE", "2")
    with pytest.raises(ConfigError, match=r"UNDERLAY_MCORE_CPU_FIXTURE='2' is not one of 1, true, yes, on"):
        env.get_bool("UNDERLAY_MCORE_CPU_FIXTURE")
    for accessor in (env.get, env.get_optional, env.get_int, env.get_float, env.get_bool):
        with pytest.raises(ConfigError, match=unknown):
            accessor(unknown)


def test_describe_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERLAY_LOG_LEVEL", " debug ")
    rows = {r["name"]: r for r in env.describe()}
    assert set(rows) == set(env.ENV_VARS)
    assert (
        rows["UNDERLAY_LOG_LEVEL"]["value"] == " debug " and rows["UNDERLAY_LOG_LEVEL"]["owner"] == "underlay"
    )
    assert rows["RANK"]["owner"] == "torchrun" and rows["TRITON_INTERPRET"]["owner"] == "triton"
    for row in rows.values():
        assert row["means"] and row["values"] and row["owner"], row
        assert row["owner"] == "underlay" or not str(row["name"]).startswith("UNDERLAY_"), row
    # underlay's own first, then the rest
    owners = [r["owner"] for r in env.describe()]
    assert owners == sorted(owners, key=lambda o: o != "underlay")


def test_info_lists_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from underlay.cli import main

    monkeypatch.setenv("UNDERLAY_CACHE", "/tmp/underlay-cache")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("environment (") : out.index("\ndevice  ->")]
    rows = [line.split()[0] for line in section.splitlines()[1:] if line.strip()]
    assert rows == list(env.ENV_VARS)
    assert re.search(
        r"UNDERLAY_CACHE\s+'/tmp/underlay-cache'\s+default '~/.cache/underlay/files'\s+underlay\s", out
    )
    assert re.search(r"WANDB_MODE\s+'disabled'\s+default 'offline'\s+wandb\s", out)
    assert re.search(r"MLFLOW_TRACKING_URI\s+<unset>\s+no default\s+mlflow\s", out)


def _yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "engine.yaml"
    p.write_text(text)
    return p


def test_yaml_with_dotted_overrides(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        "model:\n  path: /models/x\n  lora:\n    rank: 4\noptim:\n  lr: 3.0e-4\nparallel:\n  tp: 1\n",
    )
    cfg = load_config(
        EngineConfig, path, ["optim.lr=1e-5", "model.lora.target_modules=[q_proj]", "parallel.tp=2"]
    )
    assert cfg.optim.lr == 1e-5 and cfg.model.path == "/models/x" and cfg.parallel.tp == 2
    assert cfg.model.lora is not None and cfg.model.lora.rank == 4
    assert cfg.model.lora.target_modules == ("q_proj",)
    assert load_config(EngineConfig, path) == load_config(EngineConfig, str(path))


def test_dictconfig_and_mapping_sources() -> None:
    from omegaconf import OmegaConf

    data = {"model": {"path": "/m"}, "optim": {"lr": 2e-5, "weight_decay": "${optim.lr}"}}
    cfg = load_config(EngineConfig, OmegaConf.create(data))
    assert cfg.optim.weight_decay == 2e-5
    plain = load_config(ProfilerConfig, {"steps": [1, 2]}, ["ranks=[0,1]"])
    assert plain.steps == (1, 2) and plain.ranks == (0, 1)


def test_errors_name_the_key_path(tmp_path: Path) -> None:
    base = {"model": {"path": "/m"}}
    with pytest.raises(ConfigError, match=r"^optim\.lrr: unknown key; did you mean 'lr'\?"):
        load_config(EngineConfig, base, ["optim.lrr=1e-5"])
    with pytest.raises(ConfigError, match=r"^model\.lora\.rank: "):
        load_config(EngineConfig, base, ["model.lora.rank=0"])
    with pytest.raises(ConfigError, match=r"^steps: "):
        load_config(ProfilerConfig, {"steps": [-1]})
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(EngineConfig, base, ["optim.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(EngineConfig, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"^optim: expected a mapping"):
        load_config(EngineConfig, {**base, "optim": 3})


def test_setup_logging_rank_prefix_level_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    before = list(root.handlers), root.level
    try:
        monkeypatch.setenv("RANK", "3")
        monkeypatch.setenv("UNDERLAY_LOG_LEVEL", "DEBUG")
        setup_logging(file=tmp_path / "logs" / "train.log")
        setup_logging(file=tmp_path / "logs" / "train.log")  # idempotent: still one pair of handlers
        assert root.level == logging.DEBUG
        logging.getLogger("underlay.test").debug("hello %d", 7)
        err = capsys.readouterr().err
        assert err.count("hello 7") == 1 and "[rank 3] DEBUG underlay.test: hello 7" in err
        assert "[rank 3]" in (tmp_path / "logs" / "train.rank3.log").read_text()
        setup_logging(level="INFO", rank_zero_only=True, file=tmp_path / "r{rank}" / "x.log")
        logging.getLogger("underlay.test").info("dropped on rank 3")
        assert "dropped" not in capsys.readouterr().err
        assert "[rank 3] INFO underlay.test: dropped on rank 3" in (tmp_path / "r3" / "x.log").read_text()
        monkeypatch.setenv("RANK", "0")
        logging.getLogger("underlay.test").info("kept on rank 0")
        assert "[rank 0] INFO underlay.test: kept on rank 0" in capsys.readouterr().err
        with pytest.raises(ConfigError, match="LOUD"):
            setup_logging(level="LOUD")
        monkeypatch.setenv("UNDERLAY_LOG_LEVEL", "chatty")
        with pytest.raises(ConfigError, match="UNDERLAY_LOG_LEVEL='chatty'"):
            setup_logging()
    finally:
        for h in list(root.handlers):
            if h not in before[0]:
                root.removeHandler(h)
                h.close()
        root.setLevel(before[1])
