"""Vision-language data end to end: rows with image files, bytes and URLs -> ``VisionSFTDataset`` ->
``pack_vision`` micro-batches -> the fsdp2 engine (loaded from the model directory), whose packed
log-probs equal transformers' own padded forward of the same rows in float64."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    import fsspec
    from transformers import AutoModelForImageTextToText

    from tests.unit.data.test_multimodal import png, write_source
    from tests.unit.models._tiny import IMAGE_TOKEN, VIDEO_TOKEN
    from underlay import registry
    from underlay.data.multimodal import VisionProcessor, VisionSFTDataset, pack_vision
    from underlay.interfaces import ModelConfig
    from underlay.models import multimodal_inputs

    src = write_source(Path(root))
    (Path(root) / "cat.png").write_bytes(png(12, 16, 1))
    with fsspec.open("memory://data/dog.png", "wb") as f:
        f.write(png(8, 20, 2))
    rows = [
        {"messages": [{"role": "user", "content": "t4"}, {"role": "assistant", "content": "t9 t5 t6"}]},
        {
            "messages": [
                {"role": "user", "content": "t2 <image> t3"},
                {"role": "assistant", "content": "t7 t8"},
            ],
            "images": [str(Path(root) / "cat.png")],
        },
        {
            "messages": [
                {"role": "user", "content": "<image> t3 <image>"},
                {"role": "assistant", "content": "t11"},
            ],
            "images": ["memory://data/dog.png", {"bytes": png(8, 8, 3)}],
        },
    ]
    proc = VisionProcessor.from_pretrained(src)
    samples = [VisionSFTDataset(rows, proc)[i] for i in range(3)]
    longest = max(len(s.input_ids) for s in samples)
    packs = pack_vision(samples, pad_id=1, max_tokens=longest + 12)  # two micro-batches
    cfg = H.engine_config(H.llama_config(), max_tokens=512)
    engine = registry.get_engine(dataclasses.replace(cfg, model=ModelConfig(path=str(src))))
    model = AutoModelForImageTextToText.from_pretrained(str(src), dtype=torch.float64)
    model.set_attn_implementation("eager")
    err = 0.0
    for batch in packs:
        got = engine.infer(batch).log_probs
        mm = multimodal_inputs(batch)
        kinds = (batch.input_ids == IMAGE_TOKEN).long() + 2 * (batch.input_ids == VIDEO_TOKEN).long()
        with torch.no_grad():
            logits = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                mm_token_type_ids=kinds,
                **(mm or {}),
            ).logits
        lsm = torch.log_softmax(logits, -1)
        want = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
        want[:, 1:] = lsm[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        want = want * batch.attention_mask
        assert got is not None
        err = max(err, float((got.double() - want).abs().max()))
    rows = [b.images.rows.tolist() if b.images is not None else None for b in packs]
    return {"err": err, "packs": [b.batch_size for b in packs], "rows": rows}


def test_vlm_rows_into_the_engine_equal_transformers_padded_forward(tmp_path: Path) -> None:
    r = run_distributed(_job, 1, str(tmp_path))[0]
    # the first micro-batch's image sits in its second row: rows are carried, not assumed
    assert r["packs"] == [2, 1] and r["rows"] == [[1], [0, 0]]
    assert r["err"] < 2e-5, r["err"]
