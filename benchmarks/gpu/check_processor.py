"""The full Qwen-VL processor through ``underlay.data.load_processor`` where torchvision loads (issue 22).

transformers' Qwen-VL processors need torchvision for their video processor, and no torchvision loads
with the project's CPU torch, so the CPU suite only covers the refusal. On a host whose torch has a
matching torchvision (the GPU image), this script checks the success path: the tiny Qwen2.5-VL
directory of the tests (``tests.unit.models._tiny.save_vl_source``: model, PIL image processor, a
word-level tokenizer that knows the vision tokens) loads as an ``AutoProcessor``; processing one
prompt with two images of different sizes expands each image placeholder into grid/merge^2 tokens; the
processor saved with ``save_pretrained`` (what an export copies) reloads with the same outputs.

    PYTHONPATH=src:. python benchmarks/gpu/check_processor.py

Exits 1 when a check fails; writes ``$OUT/check_processor.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torchvision  # the point of the check: the processor path with torchvision present
    from tests.unit.models._tiny import IMAGE_TOKEN, save_vl_source

    from underlay.data.tokenizer import load_processor

    work = Path(tempfile.mkdtemp(prefix="check_processor_"))
    proc = load_processor(save_vl_source(work / "vl"))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((8, 12), (16, 8))]
    text = [
        "t5 <|vision_start|><|image_pad|><|vision_end|> t6 <|vision_start|><|image_pad|><|vision_end|> t7"
    ]
    out = proc(text=text, images=images, return_tensors="pt")
    grid = out["image_grid_thw"]
    placeholders = int((out["input_ids"] == IMAGE_TOKEN).sum())
    expected = int((grid.prod(-1) // 4).sum())  # merge 2 x 2
    proc.save_pretrained(str(work / "saved"))
    again = load_processor(work / "saved")(text=text, images=images, return_tensors="pt")
    same = all(torch.equal(out[k], again[k]) for k in out)
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "processor": type(proc).__name__,
        "video_processor": type(getattr(proc, "video_processor", None)).__name__,
        "grid": grid.tolist(),
        "placeholders": placeholders,
        "expected_placeholders": expected,
        "pixel_rows": int(out["pixel_values"].shape[0]),
        "reload_equal": same,
    }
    report["ok"] = bool(
        placeholders == expected and report["pixel_rows"] == int(grid.prod(-1).sum()) and same
    )
    print(json.dumps(report, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "check_processor.json").write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
