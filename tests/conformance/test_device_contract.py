"""The ``Device`` contract, run against every device backend whose probe passes on this host.

On a GPU host the same command covers cuda: ``UNDERLAY_DEVICE=cuda pytest tests/conformance``
(``UNDERLAY_DEVICE`` restricts the suite to that device).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

from underlay import registry
from underlay.interfaces import Device, Event, InvalidInput, MemoryStats, Stream, UnsupportedOperation


def _device_names() -> list[str]:
    wanted = os.environ.get("UNDERLAY_DEVICE", "").strip()
    names = [s.name for s in registry.backends("device") if registry.probe("device", s.name).available]
    if wanted and wanted != "auto":
        return [wanted]
    return names


@pytest.fixture(params=_device_names())
def device(request: pytest.FixtureRequest) -> Device:
    registry.reset()
    with registry.override(device=request.param):
        return registry.get_device()


def test_satisfies_protocol_and_identity(device: Device) -> None:
    assert isinstance(device, Device)
    assert device.name
    assert device.dist_backend in ("gloo", "nccl", "hccl")
    assert device.is_accelerator == (device.device_type != "cpu")
    if device.is_accelerator:
        assert device.visible_devices_env and device.ray_resource
    else:
        assert device.dist_backend == "gloo"
    assert isinstance(device.model_name(), str) and device.model_name()


def test_indices(device: Device) -> None:
    n = device.device_count()
    assert n >= 1
    d = device.torch_device(0)
    assert d.type == device.device_type
    device.set_device(0)
    assert device.current_index() == 0
    assert device.torch_device().type == device.device_type
    with pytest.raises(InvalidInput, match="out of range|exactly one"):
        device.torch_device(n + 3)
    with pytest.raises(InvalidInput):
        device.set_device(n + 3)


def test_memory_stats_track_allocations(device: Device) -> None:
    dev = device.torch_device(0)
    device.synchronize()
    device.empty_cache()
    device.reset_peak_memory_stats()
    before = device.memory_stats()
    assert isinstance(before, MemoryStats)
    assert before.total > 0 and 0 <= before.free <= before.total
    n = 64 * 2**20 // 4  # 64 MiB of fp32
    x = torch.randn(n, device=dev)
    x.add_(1.0)  # touch every page
    device.synchronize()
    during = device.memory_stats()
    assert during.peak_allocated >= before.allocated + n * 4 * 0.9
    assert during.allocated >= before.allocated + n * 4 * 0.9
    assert set(during.as_gib()) == {"allocated", "reserved", "peak_allocated", "total", "free"}
    del x
    device.empty_cache()
    device.reset_peak_memory_stats()
    after = device.memory_stats()
    assert after.peak_allocated < during.peak_allocated


def test_manual_seed_and_rng_state_round_trip(device: Device) -> None:
    dev = device.torch_device(0)
    device.manual_seed(1234)
    a = torch.rand(8, device=dev)
    device.manual_seed(1234)
    b = torch.rand(8, device=dev)
    assert torch.equal(a, b)
    state = device.get_rng_state()
    assert "cpu" in state and all(isinstance(v, torch.Tensor) for v in state.values())
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restored = torch.load(buf, weights_only=True)
    first = (torch.rand(5), torch.rand(5, device=dev))
    device.set_rng_state(restored)
    second = (torch.rand(5), torch.rand(5, device=dev))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    with pytest.raises(InvalidInput, match="keys"):
        device.set_rng_state({})


def test_peak_flops(device: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    value = device.peak_flops(torch.bfloat16)
    assert value is None or value > 0
    monkeypatch.setenv("UNDERLAY_PEAK_TFLOPS", "123.5")
    assert device.peak_flops(torch.bfloat16) == pytest.approx(123.5e12)
    monkeypatch.setenv("UNDERLAY_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="UNDERLAY_PEAK_TFLOPS='fast'"):
        device.peak_flops(torch.bfloat16)


def test_capability(device: Device) -> None:
    cap = device.capability()
    if device.device_type == "cuda":
        assert cap is not None and cap[0] >= 3
    elif cap is not None:
        assert len(cap) == 2


def test_streams_and_events(device: Device) -> None:
    dev = device.torch_device(0)
    s = device.new_stream()
    assert isinstance(s, Stream)
    start, end = device.new_event(), device.new_event()
    assert isinstance(start, Event)
    x = torch.randn(256, 256, device=dev)
    with device.stream(s):
        start.record(s)
        for _ in range(4):
            x = x @ x.T / 256
        end.record(s)
    s.synchronize()
    end.synchronize()
    assert start.elapsed_ms(end) >= 0.0
    device.new_stream().wait_stream(s)
    assert torch.isfinite(x).all()


def test_memory_history_and_snapshot(device: Device, tmp_path: Path) -> None:
    target = tmp_path / "snap.pickle"
    if not device.is_accelerator:
        with pytest.raises(UnsupportedOperation, match="unsupported on"):
            device.record_memory_history()
        with pytest.raises(UnsupportedOperation, match="unsupported on"):
            device.dump_memory_snapshot(str(target))
        return
    with pytest.raises(InvalidInput, match="max_entries"):
        device.record_memory_history(max_entries=0)
    device.record_memory_history(max_entries=1000)
    x = torch.randn(1 << 20, device=device.torch_device(0))
    device.dump_memory_snapshot(str(target))
    device.record_memory_history(False)
    del x
    assert target.stat().st_size > 0
