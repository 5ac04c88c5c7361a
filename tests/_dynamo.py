"""Helpers for tests that assert what ``torch.compile`` compiled.

Such assertions read process-wide state: dynamo's code caches and per-code execution strategies, its
config, transformers' class patches. ``ran_in_fresh_interpreter`` runs a test in a pytest process of its
own, so that nothing an earlier test in the suite's process left behind decides the outcome;
``dynamo_report`` is the message of an assertion that expected graphs and found none (a graph break or
a swallowed compile error leaves the code eager and the backend uncalled)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

_INSIDE = "UNDERLAY_TEST_FRESH_INTERPRETER"


def ran_in_fresh_interpreter(request: pytest.FixtureRequest, timeout_s: float = 500.0) -> bool:
    """Run the calling test (``request.node``) in a new pytest process and fail unless it passed there;
    return ``True`` then, and the caller returns. Inside that process return ``False``: the caller runs
    its body. Usage: ``if ran_in_fresh_interpreter(request): return`` as a test's first line."""
    if os.environ.get(_INSIDE) == "1":
        return False
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid]
    env = dict(os.environ, **{_INSIDE: "1"})
    proc = subprocess.run(
        cmd, cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout, proc.stdout[-2000:]
    return True


def dynamo_report() -> str:
    """Dynamo's graph-break and unsupported-feature counters (since the last ``counters.clear()``),
    plus the settings that make it fall back to eager silently."""
    from torch._dynamo.utils import counters

    cfg = torch._dynamo.config
    return (
        f"graph_break={dict(counters['graph_break'])} unimplemented={dict(counters['unimplemented'])} "
        f"stats={dict(counters['stats'])} suppress_errors={cfg.suppress_errors} disable={cfg.disable} "
        f"grad_enabled={torch.is_grad_enabled()} threads={torch.get_num_threads()}"
    )
