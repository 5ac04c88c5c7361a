"""Videos through ``VisionProcessor`` where transformers' video processor loads (torchvision) and a
video decoder exists (OpenCV or PyAV): the GPU image has both, CI has neither. A video file and a
frame list are sampled, processed into ``pixel_values_videos`` with its grid and seconds per grid,
expanded into the right number of placeholders, and the packed forward on cuda equals transformers'
padded forward.

Run on the GPU host: ``bash scripts/test_gpu.sh``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def _video_file(path: Path, frames: int, h: int, w: int) -> Path:
    cv2 = pytest.importorskip("cv2")
    out = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (w, h))
    rng = np.random.default_rng(0)
    for _ in range(frames):
        out.write(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    out.release()
    return path


def test_videos_from_files_and_frames_into_the_engine(tmp_path: Path) -> None:
    pytest.importorskip("torchvision")
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from tests.distributed import _fsdp_helpers as H
    from tests.unit.data.test_multimodal import png, write_source
    from tests.unit.models._tiny import IMAGE_TOKEN, VIDEO_TOKEN
    from underlay import registry
    from underlay.data.multimodal import VisionProcessor, VisionPromptDataset, collate_vision
    from underlay.interfaces import ModelConfig
    from underlay.models import multimodal_inputs

    src = write_source(tmp_path)
    Qwen2VLVideoProcessor(
        patch_size=2, merge_size=2, temporal_patch_size=1, min_pixels=16, max_pixels=4096
    ).save_pretrained(str(src))
    proc = VisionProcessor.from_pretrained(src, video_fps=2.0, video_max_frames=4)
    assert proc.video_processor is not None, proc.video_unavailable
    clip = _video_file(tmp_path / "clip.avi", frames=12, h=8, w=12)  # 3 s at 4 fps -> 4 frames (max)
    rows = [
        {"prompt": "t2 <video> t3", "videos": [str(clip)]},
        {"prompt": "<video> t4", "videos": [[png(8, 8, i) for i in range(3)]]},
    ]
    ds = VisionPromptDataset(rows, proc)
    s0, s1 = ds[0], ds[1]
    assert s0.videos is not None and s1.videos is not None
    # 3 frames given at 2 fps are 1.5 s: 3 samples at 2 fps (the tiny model's temporal patch is 1)
    assert s0.videos.grid_thw.tolist() == [[4, 4, 6]] and s1.videos.grid_thw.tolist()[0][0] == 3
    assert sum(t == VIDEO_TOKEN for t in s0.input_ids) == 4 * 4 * 6 // 4
    assert s0.videos.second_per_grid is not None and float(s0.videos.second_per_grid[0]) == pytest.approx(
        0.75
    )
    batch = collate_vision([s0, s1], pad_id=1)
    cfg = H.engine_config(H.llama_config(), max_tokens=512)
    engine = registry.get_engine(dataclasses.replace(cfg, model=ModelConfig(path=str(src))))
    got = engine.infer(batch).log_probs
    model = AutoModelForImageTextToText.from_pretrained(str(src), dtype=torch.float64)
    model.set_attn_implementation("eager")
    mm: dict[str, Any] = multimodal_inputs(batch) or {}
    kinds = (batch.input_ids == IMAGE_TOKEN).long() + 2 * (batch.input_ids == VIDEO_TOKEN).long()
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, mm_token_type_ids=kinds, **mm
        ).logits
    lsm = torch.log_softmax(logits, -1)
    want = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    want[:, 1:] = lsm[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    assert got is not None
    assert float((got.double().cpu() - want * batch.attention_mask).abs().max()) < 2e-5
