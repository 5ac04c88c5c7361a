"""Running a conformance suite's checks on a Triton backend under ``TRITON_INTERPRET=1`` (CPU hosts).

The interpreter must be switched on before triton is imported, so the checks run in a child process:
the suite's own file, executed as a script, whose ``__main__`` calls :func:`report_checks`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from underlay import registry

_ROOT = Path(__file__).resolve().parents[2]


def interpret_skip_reason(suite: str) -> str | None:
    """Why the interpreted run does not apply here (``None`` when it does): no triton, or a GPU host,
    where ``suite`` runs the Triton backend natively."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install underlay[cuda])"
    if registry.probe("device", "cuda").available:
        return f"a GPU is present: the triton backend runs natively in {suite}"
    return None


def run_interpreted(script: str) -> dict[str, str]:
    """Run ``script`` with the Triton interpreter on; its last stdout line maps check -> ``"ok"`` or the
    traceback."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT / "src"), str(_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def report_checks(checks: Mapping[str, Callable[[Any, str, torch.device], None]], backend: Any) -> None:
    """In the child: run every check on ``backend`` (registry name ``"triton"``, CPU tensors) and print
    the outcome as one JSON line."""
    out: dict[str, str] = {}
    for check, fn in checks.items():
        try:
            fn(backend, "triton", torch.device("cpu"))
            out[check] = "ok"
        except Exception:
            out[check] = traceback.format_exc()[-3000:]
    print(json.dumps(out))
