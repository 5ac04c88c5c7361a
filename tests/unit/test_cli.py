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
