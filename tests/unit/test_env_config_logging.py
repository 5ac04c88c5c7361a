"""The UNDERLAY_* table, config files with dotted overrides, rank-aware logging."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from underlay.interfaces import ConfigError, EngineConfig, ProfilerConfig
from underlay.parallel.logging import setup_logging
from underlay.utils import env
from underlay.utils.config_files import load_config

_SRC = Path(__file__).resolve().parents[2] / "src"


def test_every_underlay_variable_in_src_is_in_the_table() -> None:
    """Each UNDERLAY_* name in src/ is in the table, and each table entry is read somewhere in src/."""
    found: dict[str, set[str]] = {}
    for path in _SRC.rglob("*.py"):
        for name in re.findall(r"UNDERLAY_[A-Z0-9_]+", path.read_text()):
            found.setdefault(name, set()).add(path.relative_to(_SRC).as_posix())
    missing = {n: sorted(p) for n, p in found.items() if n not in env.ENV_VARS}
    assert not missing, f"read in src but not in underlay.utils.env.ENV_VARS: {missing}"
    used_elsewhere = {n for n, paths in found.items() if paths - {"underlay/utils/env.py"}}
    assert set(env.ENV_VARS) <= used_elsewhere, set(env.ENV_VARS) - used_elsewhere


def test_registry_kind_variables_are_in_the_table() -> None:
    from underlay import registry

    assert set(registry.ENV_VARS.values()) | {registry.PLUGIN_ENV} <= set(env.ENV_VARS)


def test_env_get_and_describe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UNDERLAY_LOG_LEVEL", raising=False)
    assert env.get("UNDERLAY_LOG_LEVEL") == "INFO"
    monkeypatch.setenv("UNDERLAY_LOG_LEVEL", " debug ")
    assert env.get("UNDERLAY_LOG_LEVEL") == "debug"
    rows = {r["name"]: r for r in env.describe()}
    assert rows["UNDERLAY_LOG_LEVEL"]["value"] == " debug "
    assert rows["UNDERLAY_DEVICE"]["means"] and set(rows) == set(env.ENV_VARS)
    with pytest.raises(ConfigError, match="UNDERLAY_NOPE"):
        env.get("UNDERLAY_NOPE")


def test_info_lists_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from underlay.cli import main

    monkeypatch.setenv("UNDERLAY_CACHE", "/tmp/underlay-cache")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in env.ENV_VARS:
        assert name in out
    assert re.search(r"UNDERLAY_CACHE\s+'/tmp/underlay-cache'", out)


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
