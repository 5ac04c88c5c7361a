"""Profiler backends selected through the registry: off, torch (on cpu), nvtx and mstx availability."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from underlay import registry
from underlay.backends.portable.profiler import OffProfiler, TorchProfiler
from underlay.interfaces import BackendUnavailable, ConfigError, Profiler, ProfilerConfig

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("UNDERLAY_PROFILER", "UNDERLAY_DEVICE", "RANK"):
        monkeypatch.delenv(var, raising=False)


def _names(trace: Path) -> set[str]:
    """Names of all events of a chrome trace (plain or gzipped JSON)."""
    if trace.suffix == ".gz":
        import gzip

        data = json.loads(gzip.decompress(trace.read_bytes()))
    else:
        data = json.loads(trace.read_text())
    return {str(e["name"]) for e in data["traceEvents"] if "name" in e}


def _work(prof: Profiler, n_steps: int, label: str = "work") -> None:
    a = torch.randn(16, 16, dtype=torch.float64)
    prof.start()
    for i in range(n_steps):
        with prof.range(f"{label}{i}"):
            a = torch.tanh(a @ a.T / 16)
        prof.step()
    prof.stop()


def test_default_is_off_and_off_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "prof"
    prof = registry.get_profiler({"steps": [0, 1], "ranks": [], "output_dir": str(out)})
    assert isinstance(prof, OffProfiler) and isinstance(prof, Profiler)
    assert prof.name == "off" and not prof.enabled
    assert prof.range("a") is prof.range("b")

    def f(x: float) -> float:
        return x * 2

    assert prof.annotate("f")(f) is f and prof.annotate()(f) is f
    _work(prof, 3)
    assert not out.exists()


def test_torch_trace_holds_only_configured_steps(tmp_path: Path) -> None:
    cfg = ProfilerConfig(steps=(2, 3, 5), warmup=1, output_dir=str(tmp_path), ranks=(0,))
    prof = registry.get_profiler(cfg, name="torch")
    assert isinstance(prof, TorchProfiler) and prof.enabled

    @prof.annotate("annotated_fn")
    def helper(x: torch.Tensor) -> torch.Tensor:
        return x.sum()

    a = torch.randn(8, 8, dtype=torch.float64)
    prof.start()
    for i in range(7):
        with prof.range(f"work{i}"):
            helper(a @ a)
        prof.step()
    prof.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0_step2.json", "rank0_step5.json"]
    assert prof.traces == [tmp_path / "rank0_step2.json", tmp_path / "rank0_step5.json"]
    first, second = (_names(p) for p in prof.traces)
    assert {n for n in first if n.startswith("work")} == {"work2", "work3"}
    assert {n for n in second if n.startswith("work")} == {"work5"}
    assert "annotated_fn" in first and "annotated_fn" in second


def test_torch_steps_count_from_construction_and_empty_steps_record_all(tmp_path: Path) -> None:
    prof = registry.get_profiler(ProfilerConfig(steps=(), output_dir=str(tmp_path / "a")), name="torch")
    prof.step()  # step 0 runs before start()
    _work(prof, 2)  # steps 1 and 2
    (trace,) = prof.traces  # type: ignore[attr-defined]
    assert trace.name == "rank0_step1.json"
    assert {n for n in _names(trace) if n.startswith("work")} == {"work0", "work1"}


def test_torch_chrome_gzip(tmp_path: Path) -> None:
    cfg = {"steps": [1], "warmup": 0, "output_dir": str(tmp_path), "options": {"gzip": True}}
    prof = registry.get_profiler(cfg, name="torch")
    _work(prof, 2, label="gz")
    assert [p.name for p in tmp_path.iterdir()] == ["rank0_step1.json.gz"]
    assert {n for n in _names(tmp_path / "rank0_step1.json.gz") if n.startswith("gz")} == {"gz1"}


def test_torch_tensorboard_format(tmp_path: Path) -> None:
    cfg = {"steps": [0], "warmup": 0, "format": "tensorboard", "output_dir": str(tmp_path)}
    prof = registry.get_profiler(cfg, name="torch")
    _work(prof, 2, label="tb")
    (trace,) = list(tmp_path.iterdir())
    assert trace.name.startswith("rank0_step0.") and trace.name.endswith(".pt.trace.json")
    assert {n for n in _names(trace) if n.startswith("tb")} == {"tb0"}


def test_torch_annotate_async(tmp_path: Path) -> None:
    prof = registry.get_profiler({"steps": [0], "output_dir": str(tmp_path)}, name="torch")

    @prof.annotate("async_fetch")
    async def fetch(x: torch.Tensor) -> torch.Tensor:
        await asyncio.sleep(0)
        return x.exp()

    x = torch.randn(4, dtype=torch.float64)
    prof.start()
    y = asyncio.run(fetch(x))
    prof.stop()
    torch.testing.assert_close(y, x.exp())
    assert asyncio.iscoroutinefunction(fetch)
    assert "async_fetch" in _names(tmp_path / "rank0_step0.json")


def test_torch_other_rank_and_disabled_write_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    prof = registry.get_profiler({"ranks": [0], "output_dir": str(tmp_path / "r")}, name="torch")
    assert not prof.enabled
    _work(prof, 2)
    monkeypatch.setenv("RANK", "0")
    prof = registry.get_profiler({"enabled": False, "output_dir": str(tmp_path / "d")}, name="torch")
    assert not prof.enabled
    _work(prof, 2)
    assert list(tmp_path.iterdir()) == []


def test_env_selects_backend_and_config_loads_from_omegaconf(monkeypatch: pytest.MonkeyPatch) -> None:
    from omegaconf import OmegaConf

    raw = {"steps": [1, 2], "ranks": [0, 1], "with_stack": True, "options": {"with_flops": True}}
    cfg = ProfilerConfig.load(OmegaConf.create(raw))
    assert cfg == ProfilerConfig.load(raw)
    assert cfg.steps == (1, 2) and cfg.ranks == (0, 1) and cfg.options == {"with_flops": True}
    monkeypatch.setenv("UNDERLAY_PROFILER", "torch")
    prof = registry.get_profiler(OmegaConf.create(raw))
    assert isinstance(prof, TorchProfiler) and prof.name == "torch"


def test_bad_options_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"\['with_flop'\].*'torch'.*valid options"):
        registry.get_profiler({"options": {"with_flop": True}}, name="torch")
    with pytest.raises(ConfigError, match="expected bool"):
        registry.get_profiler({"options": {"gzip": "yes"}}, name="torch")
    with pytest.raises(ConfigError, match="unknown keys"):
        registry.get_profiler({"stpes": [1]}, name="torch")


def test_range_closes_when_body_raises(tmp_path: Path) -> None:
    prof = registry.get_profiler({"steps": [0], "output_dir": str(tmp_path)}, name="torch")
    prof.start()
    with pytest.raises(ValueError, match="boom"), prof.range("failing"):
        raise ValueError("boom")
    with prof.range("after"):
        torch.ones(2).sum()
    prof.stop()
    names = _names(tmp_path / "rank0_step0.json")
    assert {"failing", "after"} <= names


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the cpu-only failure of nvtx")
def test_nvtx_unavailable_without_cuda() -> None:
    with pytest.raises(BackendUnavailable, match="nvtx.*CUDA"):
        registry.get_profiler({}, name="nvtx")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_mstx_clear_error_without_torch_npu() -> None:
    with pytest.raises(BackendUnavailable, match=r"'mstx' is unavailable.*torch_npu.*underlay\[npu\]"):
        registry.get_profiler({}, name="mstx")
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.npu.mstx import MstxProfiler

    with pytest.raises(BackendUnavailable, match="torch_npu"):
        MstxProfiler(ProfilerConfig(), CpuDevice())
    assert "torch_npu" not in sys.modules


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_torch_npu_never_imported_otherwise(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        import underlay, underlay.profiling
        from underlay import registry
        registry.get_profiler({{"steps": [0], "output_dir": {str(tmp_path)!r}}}, name="torch")
        registry.get_profiler()
        registry.info()
        try:
            registry.get_profiler({{}}, name="mstx")
        except Exception as exc:
            print(type(exc).__name__)
        print("torch_npu" in sys.modules, "underlay.backends.npu.mstx" in sys.modules)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNDERLAY_")}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-3:] == ["BackendUnavailable", "False", "False"], res.stdout


@pytest.mark.gpu
def test_nvtx_on_cuda_runs() -> None:
    prof = registry.get_profiler({"steps": [1, 2], "ranks": []}, name="nvtx")
    assert prof.name == "nvtx" and prof.enabled
    a = torch.randn(256, 256, device="cuda")

    @prof.annotate()
    def mm(x: torch.Tensor) -> torch.Tensor:
        return x @ x

    prof.start()
    for i in range(4):
        with prof.range(f"step_body{i}"):
            a = torch.tanh(mm(a))
        prof.step()
    prof.stop()
    assert torch.isfinite(a).all()
