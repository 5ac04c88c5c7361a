"""The full Qwen-VL processor through ``underlay.data.load_processor`` where torchvision loads.

transformers' Qwen-VL processors need torchvision for their video processor, and no torchvision loads
with the project's CPU torch, so the CPU suite only covers the refusal. On the GPU image (torch with a
matching torchvision) this checks the success path: the tiny Qwen2.5-VL directory of the tests loads as
an ``AutoProcessor``; one prompt with two images of different sizes expands each image placeholder
into grid / merge^2 tokens; the processor saved with ``save_pretrained`` (what an export copies)
reloads with the same outputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.models._tiny import IMAGE_TOKEN, save_vl_source
from underlay.data.tokenizer import load_processor

pytestmark = pytest.mark.gpu


def test_qwen_vl_processor_expands_images_and_reloads(tmp_path: Path) -> None:
    try:
        import torchvision  # noqa: F401  (the point of the test: the path with torchvision present)
    except Exception as exc:  # a torchvision built for another torch fails with more than ImportError
        pytest.skip(f"torchvision does not load here: {exc!r}")
    from PIL import Image

    proc = load_processor(save_vl_source(tmp_path / "vl"))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((8, 12), (16, 8))]
    text = [
        "t5 <|vision_start|><|image_pad|><|vision_end|> t6 <|vision_start|><|image_pad|><|vision_end|> t7"
    ]
    out = proc(text=text, images=images, return_tensors="pt")
    grid = out["image_grid_thw"]
    placeholders = int((out["input_ids"] == IMAGE_TOKEN).sum())
    assert placeholders == int((grid.prod(-1) // 4).sum())  # merge 2 x 2
    assert int(out["pixel_values"].shape[0]) == int(grid.prod(-1).sum())
    proc.save_pretrained(str(tmp_path / "saved"))
    again = load_processor(tmp_path / "saved")(text=text, images=images, return_tensors="pt")
    for key in out:
        assert torch.equal(out[key], again[key]), key
