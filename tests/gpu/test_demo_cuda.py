"""``UNDERLAY_DEVICE=cuda underlay demo`` on one GPU: the same miniature GRPO loop as on CPU.

``run_demo`` itself raises ``CheckpointError`` when the resumed step differs beyond the accelerator
tolerance or the HF export's logits differ from the engine's; the test also checks what it reports.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_demo_runs_on_cuda_resumes_and_exports(tmp_path: Path) -> None:
    from underlay.demo import DemoConfig, run_demo

    summary = run_demo(DemoConfig(out_dir=str(tmp_path / "demo"), progress=False))
    hist = summary["history"]
    assert summary["world_size"] == 1 and len(hist) >= 2
    assert all(h["tokens_per_s"] > 0 for h in hist)
    assert summary["device"] == "cuda"
    # the redone step after the checkpoint reload: same prompts, loss and grad norm equal or within the
    # accelerator tolerance
    assert summary["resume"]["ok"], summary["resume"]
    assert summary["export"]["max_abs_logit_diff"] <= 1e-2, summary["export"]
