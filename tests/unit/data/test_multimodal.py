"""Vision-language data: images from files, bytes, mappings and fsspec URLs through the model's image
processor into placeholders and ``VisionInputs``; the SFT loss mask; pixel limits; video sampling;
refusals naming the row, the count or the missing package. The end-to-end check against transformers
is in tests/distributed/test_vlm_data.py."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.models._tiny import IMAGE_TOKEN, save_vl_source
from underlay.data.media import load_image, load_video, sample_frame_indices
from underlay.data.multimodal import (
    VisionProcessor,
    VisionPromptDataset,
    VisionSFTDataset,
    collate_vision,
    pack_vision,
)
from underlay.interfaces import ConfigError, InvalidInput

# a Qwen2-VL style template: image parts render as vision-start, one pad token, vision-end
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|> <|image_pad|> <|vision_end|> "
    "{% elif p['type'] == 'video' %}<|vision_start|> <|video_pad|> <|vision_end|> "
    "{% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def png(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def write_source(root: Path) -> Path:
    """The tiny Qwen2.5-VL of the model tests, its PIL image processor and a tokenizer with TEMPLATE
    and the template's words (``<|im_start|>`` ... as whole tokens)."""
    src = save_vl_source(root / "src")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(src))
    return src


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_source(tmp_path_factory.mktemp("vl"))


def test_image_sources_all_decode_to_the_same_pixels(source: Path, tmp_path: Path) -> None:
    import fsspec

    data = png(12, 20, 0)
    (tmp_path / "a.png").write_bytes(data)
    with fsspec.open("memory://bucket/a.png", "wb") as f:
        f.write(data)
    ref = np.asarray(load_image(data))
    for src in (
        tmp_path / "a.png",
        str(tmp_path / "a.png"),
        f"file://{tmp_path / 'a.png'}",
        {"bytes": data},
        {"path": str(tmp_path / "a.png")},
        "memory://bucket/a.png",
        ref,
    ):
        assert np.array_equal(np.asarray(load_image(src, cache_dir=tmp_path / "cache")), ref), src
    assert torch.equal(torch.from_numpy(np.asarray(load_image(data))), torch.from_numpy(ref))
    with pytest.raises(InvalidInput, match="could not be decoded"):
        load_image(b"not an image")
    with pytest.raises(InvalidInput, match="does not exist"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(InvalidInput, match="give a path"):
        load_image(3.5)


def test_prompt_rows_expand_placeholders_by_each_images_patches(source: Path) -> None:
    proc = VisionProcessor.from_pretrained(source)
    rows = [
        {"prompt": "t2 <image> t3 <image> t4", "images": [png(8, 8, 1), png(12, 20, 2)], "answer": "x"},
        {"prompt": [{"role": "user", "content": [{"type": "text", "text": "t5"}]}], "answer": "y"},
    ]
    ds = VisionPromptDataset(rows, proc)
    s0, s1 = ds[0], ds[1]
    assert s0.images is not None and s1.images is None and s0.fields == {"answer": "x"}
    grids = s0.images.grid_thw.tolist()
    want = [t * h * w // 4 for t, h, w in grids]  # merge 2x2
    runs = [len(r) for r in "".join("I" if t == IMAGE_TOKEN else "." for t in s0.input_ids).split(".") if r]
    assert runs == want and want == [4, 15]  # 8x8 -> 4x4 patches; 12x20 -> 6x10
    assert s0.images.pixel_values.shape[0] == sum(t * h * w for t, h, w in grids)
    batch = collate_vision([s0, s1], pad_id=1)
    assert batch.images is not None and batch.images.rows.tolist() == [0, 0]
    assert int(batch.loss_mask.sum()) == 0 and batch.attention_mask[1].sum() == len(s1.input_ids)
    # pixel limits: at most 64 pixels -> at most 16 patches of 2x2 -> 4 tokens per image
    small = VisionPromptDataset(rows[:1], VisionProcessor.from_pretrained(source, max_pixels=64))
    assert small[0].images is not None and all(
        t * h * w <= 16 for t, h, w in small[0].images.grid_thw.tolist()
    )
    assert len(small[0].input_ids) < len(s0.input_ids)


def test_sft_loss_covers_assistant_turns_and_packing_counts_image_tokens(source: Path) -> None:
    proc = VisionProcessor.from_pretrained(source)
    conv = [
        {"role": "user", "content": "t2 <image> t3"},
        {"role": "assistant", "content": "t7 t8"},
        {"role": "user", "content": "<image> t9"},
        {"role": "assistant", "content": "t5"},
    ]
    ds = VisionSFTDataset([{"messages": conv, "images": [png(8, 8, 3), png(8, 12, 4)]}], proc)
    s = ds[0]
    tok = proc.tokenizer
    trained = tok.convert_ids_to_tokens([t for t, m in zip(s.input_ids, s.loss_mask) if m])
    assert trained == ["t7", "t8", "<|im_end|>", "t5", "<|im_end|>"]
    assert sum(t == IMAGE_TOKEN for t in s.input_ids) == 4 + 6
    # the whole conversation rendered at once gives the same ids
    text = proc.expand(
        proc.render(ds._messages(0, ds.rows[0])[0], add_generation_prompt=False), s.images, None
    )
    assert list(s.input_ids) == tok(text, add_special_tokens=False)["input_ids"]
    n = len(s.input_ids)
    packs = pack_vision([s, s, s], pad_id=1, max_tokens=2 * n)
    assert [b.batch_size for b in packs] == [2, 1]
    assert packs[0].images is not None and packs[0].images.rows.tolist() == [0, 0, 1, 1]
    with pytest.raises(InvalidInput, match="max_tokens"):
        pack_vision([s], pad_id=1, max_tokens=n - 1)
    with pytest.raises(InvalidInput, match=r"max_length=5"):
        VisionSFTDataset(
            [{"messages": conv, "images": [png(8, 8, 3), png(8, 12, 4)]}],
            proc,
            max_length=5,
            overlong="error",
        )
    filtered = VisionSFTDataset(
        [{"messages": conv, "images": [png(8, 8, 3), png(8, 12, 4)]}], proc, max_length=5
    )
    assert len(filtered) == 0 and filtered.filtered == 1


def test_refusals_name_the_row_and_the_cause(source: Path) -> None:
    proc = VisionProcessor.from_pretrained(source)
    with pytest.raises(InvalidInput, match=r"row 0: the messages have 2 image .* the row has 1 images"):
        VisionPromptDataset([{"prompt": "<image> <image>", "images": [png(8, 8, 0)]}], proc)
    with pytest.raises(InvalidInput, match="row 1: missing column 'prompt'"):
        VisionPromptDataset([{"prompt": "t2"}, {"q": "t3"}], proc)
    with pytest.raises(InvalidInput, match="part 0 needs type"):
        VisionSFTDataset([{"messages": [{"role": "user", "content": [{"type": "audio"}]}]}], proc)
    with pytest.raises(ConfigError, match="overlong='bogus'"):
        VisionPromptDataset([{"prompt": "t2"}], proc, overlong="bogus")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="min_pixels <= max_pixels"):
        VisionProcessor.from_pretrained(source, min_pixels=100, max_pixels=10)
    try:
        import torchvision  # noqa: F401
    except ImportError:  # transformers' video processors need torchvision: refused by name
        with pytest.raises(ConfigError, match="(?i)torchvision"):
            VisionPromptDataset(
                [{"prompt": "<video> t2", "videos": [[png(8, 8, i) for i in range(4)]]}], proc
            )


def test_video_frame_sampling_follows_fps_and_limits() -> None:
    # 30 frames at 10 fps are 3 s: 6 frames at 2 fps, first and last included
    assert sample_frame_indices(30, 10.0, fps=2.0, min_frames=2, max_frames=64, multiple=2) == [
        0,
        6,
        12,
        17,
        23,
        29,
    ]
    assert len(sample_frame_indices(1000, 30.0, fps=2.0, min_frames=2, max_frames=8, multiple=2)) == 8
    assert sample_frame_indices(1, 30.0, fps=2.0, min_frames=2, max_frames=8, multiple=2) == [0, 0]
    assert len(sample_frame_indices(7, 1.0, fps=1.0, min_frames=1, max_frames=64, multiple=2)) == 6
    with pytest.raises(ConfigError, match="min_frames"):
        sample_frame_indices(10, 1.0, fps=1.0, min_frames=4, max_frames=2)
    frames = [png(8, 8, i) for i in range(6)]
    clip = load_video(frames, fps=1.0, source_fps=2.0, min_frames=2, max_frames=64, multiple=2)
    assert clip.frames.shape == (2, 8, 8, 3) and clip.fps == pytest.approx(2 / 3)
    assert np.array_equal(clip.frames[1], np.asarray(load_image(frames[5])))
    with pytest.raises(InvalidInput, match="differ in size"):
        load_video([png(8, 8, 0), png(8, 10, 1)])
