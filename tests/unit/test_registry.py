"""Selection rules of the backend registry: environment, arguments, overrides, plugins, errors."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import underlay
from underlay import cli, registry
from underlay.interfaces import (
    AttentionSpec,
    BackendUnavailable,
    ConfigError,
    IncompatibleBackends,
    PluginError,
    UnknownBackend,
)
from underlay.registry import BackendSpec

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


@pytest.fixture
def plugin_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Put the in-repo plugin distributions on sys.path, as `pip install` would."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    yield
    for mod in [m for m in sys.modules if m.startswith(("underlay_testplugin", "underlay_brokenplugin"))]:
        del sys.modules[mod]


def test_auto_picks_cpu_here_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UNDERLAY_DEVICE", raising=False)
    sel = registry.resolve("device")
    if registry.probe("device", "cuda").available:
        pytest.skip("a GPU is visible; auto picks cuda")
    assert (sel.name, sel.source) == ("cpu", "auto")
    assert "cuda" in sel.reason  # the skipped candidates are part of the reason
    assert underlay.get_device().name == "cpu"


def test_unknown_device_lists_valid_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERLAY_DEVICE", "tpu")
    with pytest.raises(UnknownBackend) as err:
        underlay.get_device()
    text = str(err.value)
    assert "'tpu'" in text
    for name in ("auto", "cpu", "cuda", "npu"):
        assert name in text


def test_info_exits_nonzero_on_unknown_device(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("UNDERLAY_DEVICE", "tpu")
    assert cli.main(["info"]) != 0
    assert "unknown device backend 'tpu'" in capsys.readouterr().err


@pytest.mark.skipif(torch.version.cuda is not None, reason="this host may have CUDA")
def test_cuda_without_cuda_is_unavailable_with_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERLAY_DEVICE", "cuda")
    with pytest.raises(BackendUnavailable) as err:
        underlay.get_device()
    assert err.value.reason and "CUDA" in err.value.reason
    assert "cpu" in err.value.available
    assert "Available device backends here: cpu" in str(err.value)


def test_explicit_argument_conflicting_with_environment_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERLAY_ATTENTION", "torch")
    with pytest.raises(ConfigError, match="'eager' by argument but 'torch' by environment"):
        underlay.get_attention("eager")
    assert underlay.get_attention("torch").name == "torch"  # agreeing is fine


def test_override_beats_environment_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERLAY_ATTENTION", "torch")
    with registry.override(attention="eager"):
        assert registry.resolve("attention").name == "eager"
        assert registry.resolve("attention").source == "override"
    assert registry.resolve("attention").name == "torch"
    with pytest.raises(ConfigError, match="unknown kinds"), registry.override(gpu="x"):
        pass


def test_selection_and_instances_are_cached_until_reset() -> None:
    a = underlay.get_device("cpu")
    assert underlay.get_device("cpu") is a
    registry.reset()
    assert underlay.get_device("cpu") is not a


def test_weight_loader_follows_engine() -> None:
    assert registry.resolve("weight_loader").name == registry.resolve("engine").name == "fsdp2"


def test_profiler_defaults_to_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UNDERLAY_PROFILER", raising=False)
    sel = registry.resolve("profiler")
    assert (sel.name, sel.source) == ("off", "default")


def test_device_restricted_backend_is_incompatible_when_named() -> None:
    registry.register(
        BackendSpec(
            "engine", "accelonly", "underlay.engines.fsdp2.engine:FSDP2Engine", devices=("cuda", "npu")
        ),
        replace=True,
    )
    try:
        with (
            registry.override(device="cpu"),
            pytest.raises(IncompatibleBackends, match="'accelonly' works only"),
        ):
            registry.resolve("engine", "accelonly")
        with registry.override(device="cpu"):  # auto never picks it on cpu
            assert registry.resolve("engine", "auto").name != "accelonly"
    finally:
        registry._state.extra = [s for s in registry._state.extra if s.name != "accelonly"]
        registry._state.specs.clear()


def test_attention_auto_honours_supports() -> None:
    spec = AttentionSpec(torch.float64, 16, 4, 2, "cpu", layout="varlen")
    kernel = underlay.get_attention(spec=spec)
    assert kernel.supports(spec) == ()


def test_unavailable_target_import_failure_names_target() -> None:
    registry.register(
        BackendSpec("attention", "ghost", "underlay.backends.portable.nonexistent:Ghost"), replace=True
    )
    try:
        with pytest.raises(
            BackendUnavailable, match=r"importing underlay\.backends\.portable\.nonexistent:Ghost"
        ):
            underlay.get_attention("ghost")
    finally:
        registry._state.extra = [s for s in registry._state.extra if s.name != "ghost"]
        registry._state.specs.clear()


def test_register_rejects_clash_and_bad_specs() -> None:
    with pytest.raises(ConfigError, match="already registered"):
        registry.register(BackendSpec("device", "cpu", "x.y:Z"))
    with pytest.raises(ConfigError):
        BackendSpec("device", "auto", "x.y:Z")
    with pytest.raises(ConfigError):
        BackendSpec("gpu", "x", "x.y:Z")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        BackendSpec("device", "x", "no_colon")


# ------------------------------------------------------------------------------------------ plugins


def test_plugin_not_loaded_unless_allowed(plugin_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UNDERLAY_PLUGINS", raising=False)
    with pytest.raises(UnknownBackend):
        underlay.get_device("hostsim")
    assert "underlay_testplugin" not in sys.modules


def test_plugin_selected_by_entry_point(plugin_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERLAY_PLUGINS", "testplugin")
    names = [s.name for s in registry.backends("device")]
    assert "hostsim" in names
    assert "underlay_testplugin.device" not in sys.modules  # target imported only once selected
    dev = underlay.get_device("hostsim")
    assert dev.name == "hostsim"
    assert "underlay_testplugin.device" in sys.modules
    spec = next(s for s in registry.backends("device") if s.name == "hostsim")
    assert spec.origin == "testplugin"
    row = next(r for r in registry.info()["backends"]["device"] if r["name"] == "hostsim")
    assert row["available"] and row["origin"] == "testplugin"


def test_broken_plugin_names_itself_and_its_exception(
    plugin_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNDERLAY_PLUGINS", "brokenplugin")
    with pytest.raises(PluginError) as err:
        underlay.get_device()
    assert "brokenplugin" in str(err.value)
    assert "ImportError" in str(err.value) and "libfoo" in str(err.value)


def test_allow_list_naming_missing_plugin(plugin_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERLAY_PLUGINS", "testplugin,nosuchplugin")
    with pytest.raises(PluginError, match="nosuchplugin"):
        registry.backends("device")
