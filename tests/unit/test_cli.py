"""``underlay info`` and ``python -m underlay info --json`` as a script would use them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from underlay import cli


def test_python_m_underlay_info_json() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNDERLAY_")}
    out = subprocess.run(
        [sys.executable, "-m", "underlay", "info", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    data = json.loads(out.stdout)
    assert data["selected"]["device"]["name"] in {s["name"] for s in data["backends"]["device"]}
    assert set(data["backends"]) == {
        "device",
        "engine",
        "attention",
        "logprob",
        "quant",
        "profiler",
        "weight_loader",
    }
    cpu = next(r for r in data["backends"]["device"] if r["name"] == "cpu")
    assert cpu["available"] is True
    assert data["versions"]["torch"]


def test_info_text_lists_every_kind(capsys: object) -> None:
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out  # type: ignore[attr-defined]
    for kind in ("device", "engine", "attention", "logprob", "quant", "profiler", "weight_loader"):
        assert f"\n{kind}  ->" in text


def test_info_shows_the_fsdp2_auto_defaults_per_device(capsys: object) -> None:
    """The engine section lists what fsdp2's auto options become on cuda, npu and cpu, with reasons,
    and that recompute='auto' is supported."""
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out  # type: ignore[attr-defined]
    fsdp2 = text[text.index("fsdp2        prio") :]
    assert "recompute: auto: yes; none: yes; full: yes; selective: no" in fsdp2
    for device in ("cuda", "npu", "cpu"):
        assert f"auto defaults on {device}:" in fsdp2
    cuda = fsdp2[fsdp2.index("auto defaults on cuda:") : fsdp2.index("auto defaults on npu:")]
    assert "compile = 'layer': cuda: whole decoder layers compiled" in cuda
    assert "fused_adamw = True" in cuda and "compile_memory_budget = 0.85" in cuda
    assert "optimizer_offload = 'auto'" in cuda and "recompute = 'auto'" in cuda
    assert "grad_sync = 'auto': 'per_micro_batch'; 'per_step' is opt-in" in cuda
    cpu = fsdp2[fsdp2.index("auto defaults on cpu:") :]
    assert "compile = False: cpu" in cpu and "fused_adamw = False" in cpu
    assert "option optimizer_offload (bool | None, default None)" in fsdp2
    assert "option grad_sync (" in fsdp2 and "'per_step' (once per forward_backward" in fsdp2
