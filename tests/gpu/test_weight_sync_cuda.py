"""Colocated weight sync over a CUDA IPC bucket: fsdp2 engine -> HFRolloutWorker process, bit-exact.

Run on the GPU host: ``UNDERLAY_DEVICE=cuda pytest -q -m gpu tests/gpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_colocated_cuda_ipc_sync_is_bit_exact(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu/bench_weight_sync.py"), "--device", "cuda"]
    cmd += ["--size", "tiny", "--bucket-mb", "1", "--repeats", "2", "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "weight_sync_colocated_cuda.json").read_text())
    assert result["bit_exact"] and result["buckets"] >= 1
