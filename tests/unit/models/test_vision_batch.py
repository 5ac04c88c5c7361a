"""Vision-language batches: ``VisionInputs`` / ``TokenBatch`` validation and row selection, placeholder
checks against the model config, vision patches in the micro-batch budget, zero-weight vision passes
(outputs and gradients unchanged) and the FLOPs of a batch with images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.models._tiny import (
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    VL_ARCHS,
    clone,
    logprob_kernel,
    tiny_config,
    tiny_vl_model,
    vl_batch,
)
from underlay.interfaces import InvalidInput, TokenBatch, VisionInputs
from underlay.models import (
    check_vision_batch,
    multimodal_inputs,
    packed_forward,
    patch_cost,
    prepare_model,
    sequence_costs,
)
from underlay.ops import plan_micro_batches, unpad
from underlay.ops.flops import FlopsCounter

W = 12  # pixel width of the tiny models: 3 channels * 1 frame * 2 * 2


def _media(grids: list[list[int]], rows: list[int], seed: int = 0) -> VisionInputs:
    g = torch.Generator().manual_seed(seed)
    patches = sum(t * h * w for t, h, w in grids)
    return VisionInputs(torch.randn(patches, W, generator=g), torch.tensor(grids), torch.tensor(rows))


def _batch() -> TokenBatch:
    """Rows: 0 one image, 1 text, 2 two images (4x4 and 4x8 patches), 3 a 2-frame video."""
    g = torch.Generator().manual_seed(5)

    def text(n: int) -> list[int]:
        return torch.randint(0, 140, (n,), generator=g).tolist()

    def image(tokens: int, token: int = IMAGE_TOKEN) -> list[int]:
        return [VISION_START] + [token] * tokens + [VISION_END]

    seqs = [text(2) + image(4) + text(3), text(6), image(4) + text(1) + image(8), image(8, VIDEO_TOKEN)]
    s = max(len(x) for x in seqs)
    ids = torch.zeros(4, s, dtype=torch.long)
    mask = torch.zeros(4, s, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    images = _media([[1, 4, 4], [1, 4, 4], [1, 4, 8]], [0, 2, 2])
    videos = _media([[2, 4, 4]], [3], seed=1)
    return TokenBatch(ids, mask, mask.clone(), {"adv": torch.arange(4.0)}, images=images, videos=videos)


def test_vision_inputs_validate_counts_and_order() -> None:
    with pytest.raises(InvalidInput, match="sum\\(t\\*h\\*w\\) = 16"):
        VisionInputs(torch.randn(15, W), torch.tensor([[1, 4, 4]]), torch.tensor([0]))
    with pytest.raises(InvalidInput, match="non-decreasing"):
        VisionInputs(torch.randn(32, W), torch.tensor([[1, 4, 4]] * 2), torch.tensor([1, 0]))
    with pytest.raises(InvalidInput, match=r"\[n, 3\]"):
        VisionInputs(torch.randn(16, W), torch.tensor([[4, 4]]), torch.tensor([0]))
    with pytest.raises(InvalidInput, match="rows"):
        VisionInputs(torch.randn(16, W), torch.tensor([[1, 4, 4]]), torch.tensor([0, 0]))
    media = _media([[1, 4, 4]], [3])
    assert media.grid_thw.dtype == torch.int64 and media.count == 1
    with pytest.raises(InvalidInput, match=r"out of range \[0, 2\)"):
        TokenBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.ones(2, 3), images=media)


def test_select_keeps_each_rows_images_with_it() -> None:
    batch = _batch()
    assert batch.images is not None and batch.videos is not None
    sub = batch.select([2, 0])
    assert sub.images is not None and sub.videos is None
    assert sub.images.rows.tolist() == [0, 0, 1]
    assert sub.images.grid_thw.tolist() == [[1, 4, 4], [1, 4, 8], [1, 4, 4]]
    px = batch.images.pixel_values
    torch.testing.assert_close(sub.images.pixel_values, torch.cat([px[16:64], px[:16]]), rtol=0, atol=0)
    assert torch.equal(sub.extras["adv"], torch.tensor([2.0, 0.0]))
    assert batch.select([1]).has_vision is False
    video_only = batch.select([3, 3])
    assert video_only.videos is not None and video_only.videos.rows.tolist() == [0, 1]
    assert video_only.videos.pixel_values.shape == (64, W)
    moved = batch.to(torch.device("cpu"))
    assert moved.images is not None and torch.equal(moved.images.pixel_values, px)
    mm = multimodal_inputs(batch)
    assert mm is not None and set(mm) == {
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
    }


def test_placeholder_counts_are_checked_against_the_config() -> None:
    model = tiny_vl_model("qwen2_5_vl")
    batch = _batch()
    check_vision_batch(model.config, batch)  # consistent: passes
    wrong = VisionInputs(torch.randn(48, W), torch.tensor([[1, 4, 4], [1, 4, 8]]), torch.tensor([0, 2]))
    with pytest.raises(
        InvalidInput, match="row 2: 12 image_token_id=150 placeholder tokens but its images need 8"
    ):
        check_vision_batch(
            model.config,
            TokenBatch(
                batch.input_ids, batch.attention_mask, batch.loss_mask, images=wrong, videos=batch.videos
            ),
        )
    with pytest.raises(InvalidInput, match="video_token_id=151 placeholders but TokenBatch.videos is None"):
        check_vision_batch(
            model.config,
            TokenBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, images=batch.images),
        )
    odd = VisionInputs(torch.randn(24, W), torch.tensor([[2, 3, 4]]), torch.tensor([3]))
    with pytest.raises(InvalidInput, match="multiples of the spatial_merge_size 2"):
        check_vision_batch(
            model.config,
            TokenBatch(
                batch.input_ids, batch.attention_mask, batch.loss_mask, images=batch.images, videos=odd
            ),
        )
    with pytest.raises(InvalidInput, match="a text model"):
        check_vision_batch(tiny_config("llama"), batch)


def test_vision_patches_count_in_the_micro_batch_budget() -> None:
    model = tiny_vl_model("qwen2_5_vl")
    w = patch_cost(model.config)
    assert w == pytest.approx(32 * 2 / (64 * 2))  # vision hidden x depth / text hidden x layers
    assert patch_cost(tiny_config("llama")) == 0.0
    batch = _batch()
    tokens = batch.attention_mask.sum(dim=1).tolist()
    costs = sequence_costs(model.config, batch)
    assert costs == [tokens[0] + 8, tokens[1], tokens[2] + 24, tokens[3] + 16]
    # the same 42 budget by tokens alone (44 tokens: two micro-batches) overloads one by its patches
    by_tokens = plan_micro_batches(tokens, 42)
    assert max(sum(costs[i] for i in mb) for mb in by_tokens) > 42
    plan = plan_micro_batches(costs, 42)
    assert len(plan) > len(by_tokens)
    assert max(sum(costs[i] for i in mb) for mb in plan) <= 42


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_zero_vision_passes_leave_outputs_and_gradients_unchanged(arch: str) -> None:
    ref = tiny_vl_model(arch)
    ids = torch.randint(0, 140, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    packed = unpad(ids, mask)
    runs = []
    for passes in (0, 2):
        model = clone(ref).double()
        if arch == "qwen3_vl_moe":
            model.set_experts_implementation("eager")  # grouped_mm has no float64
        model = prepare_model(model, attention="eager")
        out = packed_forward(model, packed, logprob_kernel=logprob_kernel(), zero_vision_passes=passes)
        assert out.log_probs is not None and out.entropy is not None
        (out.log_probs.double().sum() + out.entropy.double().sum()).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        runs.append((out.log_probs.detach(), grads))
    (lp0, g0), (lp2, g2) = runs
    torch.testing.assert_close(lp2, lp0, rtol=0, atol=0)
    for name, grad in g0.items():
        if grad is None:  # the vision tower: no image in the batch
            assert name.startswith("model.visual.")
            assert g2[name] is not None and not bool(g2[name].abs().sum())  # ran, with zero gradient
        else:
            torch.testing.assert_close(g2[name], grad, rtol=0, atol=0, msg=name)
    with pytest.raises(InvalidInput, match="zero_vision_passes=-1"):
        packed_forward(model, packed, zero_vision_passes=-1)


def test_flops_of_a_batch_with_images_include_the_vision_tower() -> None:
    model = tiny_vl_model("qwen2_5_vl")
    counter = FlopsCounter(model.config)
    batch = _batch()
    seqlens = batch.attention_mask.sum(dim=1)
    grids = torch.tensor([[1, 4, 4], [1, 4, 4], [1, 4, 8], [2, 4, 4]])
    assert counter.batch_flops(batch) == pytest.approx(counter.estimate_flops(seqlens, grids))
    assert counter.batch_flops(batch) > counter.estimate_flops(seqlens)
    assert counter.batch_flops(batch.select([1])) == pytest.approx(counter.estimate_flops(seqlens[1:2]))
    assert counter.achieved_tflops(seqlens, 2.0, grids) == pytest.approx(counter.batch_flops(batch) / 2e12)


def test_load_processor_of_a_vlm_directory(tmp_path: Path) -> None:
    """The processor files of a Qwen2.5-VL directory load with the tokenizer (``data.load_processor``):
    with torchvision (the Qwen-VL video processor needs it) the AutoProcessor, without it a
    ConfigError naming it; the image processor alone loads either way."""
    import importlib.util

    from transformers import AutoImageProcessor

    from tests.unit.models._tiny import save_vl_source
    from underlay.data.tokenizer import load_processor, load_tokenizer
    from underlay.interfaces import ConfigError

    src = save_vl_source(tmp_path / "vl")
    image = AutoImageProcessor.from_pretrained(str(src), local_files_only=True)
    assert image.merge_size == 2 and image.patch_size == 2
    assert load_tokenizer(src).convert_tokens_to_ids("<|image_pad|>") == IMAGE_TOKEN
    if importlib.util.find_spec("torchvision") is None:
        minor = int(torch.__version__.split(".")[1])
        with pytest.raises(ConfigError, match=rf"(?i)torchvision.*install torchvision==0\.{minor + 15}\.\*"):
            load_processor(src)
    else:
        proc = load_processor(src)
        assert proc.image_processor.merge_size == 2


def test_load_processor_names_a_torchvision_that_does_not_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torchvision built for another torch (PyPI's CUDA wheel on a CPU torch) fails inside its import
    with a RuntimeError (measured with torchvision 0.28.0 on torch 2.13.0+cpu: ``operator
    torchvision::nms does not exist``); load_processor turns it into a ConfigError with the fix."""
    import transformers

    from tests.unit.models._tiny import save_vl_source
    from underlay.data.tokenizer import load_processor
    from underlay.interfaces import ConfigError

    src = save_vl_source(tmp_path / "vl")

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("operator torchvision::nms does not exist")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", broken)
    with pytest.raises(ConfigError, match="torchvision is installed but does not load.*torchvision::nms"):
        load_processor(src)


def test_fsdp2_builds_vlm_policies_and_value_models() -> None:
    """A vision-language config builds with AutoModelForImageTextToText (vision blocks and decoder layers
    are the FSDP units); ``kind="value"`` builds ``models.vision_value_model`` (the same backbone and
    units, a ``score`` head instead of ``lm_head``)."""
    from underlay.engines.fsdp2 import _build
    from underlay.engines.fsdp2.parallelize import decoder_layers
    from underlay.interfaces import ModelConfig

    cfg = tiny_vl_model("qwen2_5_vl").config
    for kind, head in (("causal_lm", "lm_head.weight"), ("value", "score.weight")):
        mc = ModelConfig(hf_config=cfg, kind=kind)
        model = _build.build_model(mc, _build.hf_config_of(mc), meta=True)
        kinds = sorted({type(m).__name__ for m in decoder_layers(model)})
        assert kinds == ["Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"]
        names = [n for n, _ in model.named_parameters()]
        assert head in names and names[0].startswith("model.visual.")


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_vision_tower_ignores_the_text_packing_keywords(arch: str) -> None:
    """Some transformers versions forward the language model's keywords to the vision tower
    (``get_image_features(..., **kwargs)``); the text sequence's packing metadata must not reach the
    tower's attention, which would take it for the image patches' own."""
    from underlay.models.prepare import TEXT_PACKING_KEYS

    model = prepare_model(tiny_vl_model(arch).double(), attention="eager")
    tower = model.model.visual
    _, _, mm = vl_batch()
    pixels, grid = mm["pixel_values"].double(), mm["image_grid_thw"]
    bogus = torch.tensor([0, 7, 40], dtype=torch.int32)  # a text packing of 40 tokens, not 32 patches
    packing = dict(zip(TEXT_PACKING_KEYS, (bogus, bogus, 33, 33), strict=True))
    seen: dict[str, object] = {}
    block = tower.blocks[0]
    handle = block.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        with torch.no_grad():
            ref = tower(pixels, grid_thw=grid)
            seen.clear()
            out = tower(pixels, grid_thw=grid, **packing)
    finally:
        handle.remove()
    assert not set(TEXT_PACKING_KEYS) & set(seen), sorted(seen)
    ref_t = ref.pooler_output if hasattr(ref, "pooler_output") else ref[0]
    out_t = out.pooler_output if hasattr(out, "pooler_output") else out[0]
    torch.testing.assert_close(out_t, ref_t, rtol=0, atol=0)


def test_split_media_gives_contiguous_patch_balanced_shares() -> None:
    """Ulysses ranks encode contiguous runs of items balanced by patches; with fewer items than ranks
    the last ranks get none (they run a zero-weight dummy)."""
    from underlay.models.vision import split_media

    assert split_media([16, 16], 2) == [(0, 1), (1, 2)]
    assert split_media([16, 32, 16, 16], 2) == [(0, 2), (2, 4)]
    assert split_media([64, 16, 16, 16, 16], 2) == [(0, 1), (1, 5)]
    assert split_media([16], 2) == [(0, 1), (1, 1)]
    assert split_media([16, 16, 16], 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert split_media([5, 7], 1) == [(0, 2)]
    with pytest.raises(InvalidInput, match="parts=0"):
        split_media([4], 0)


def test_image_processor_outputs_feed_vision_inputs_and_the_packed_forward(tmp_path: Path) -> None:
    """Without torchvision the Qwen-VL processor cannot be built (its video processor imports it), but
    its image processor (PIL) can: its ``pixel_values`` / ``image_grid_thw`` for real images of
    different sizes, with the placeholders expanded per grid as the processor does, make a
    ``TokenBatch`` whose packed forward equals transformers' padded forward on the same inputs."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from tests.unit.models._tiny import save_vl_source

    src = save_vl_source(tmp_path / "vl")
    processor = AutoImageProcessor.from_pretrained(str(src), local_files_only=True)
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w in ((8, 8), (8, 12), (16, 8))
    ]
    feats = processor(images=images, return_tensors="pt")
    grid = feats["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4], [1, 4, 6], [1, 8, 4]]
    assert feats["pixel_values"].shape == (int(grid.prod(-1).sum()), W)
    tokens = (grid.prod(-1) // 4).tolist()  # merged 2 x 2: the processor's placeholder count per image

    def image(n: int) -> list[int]:
        return [VISION_START] + [IMAGE_TOKEN] * n + [VISION_END]

    seqs = [[5, 6, *image(tokens[0]), 7, 8, 9], [10, 11, 12], [*image(tokens[1]), 13, *image(tokens[2]), 14]]
    s = max(len(x) for x in seqs)
    ids = torch.zeros(3, s, dtype=torch.long)
    mask = torch.zeros(3, s, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1
    batch = TokenBatch(
        ids, mask, mask.clone(), images=VisionInputs(feats["pixel_values"], grid, torch.tensor([0, 2, 2]))
    )
    ref = AutoModelForImageTextToText.from_pretrained(str(src), attn_implementation="eager").float()
    check_vision_batch(ref.config, batch)
    mm = multimodal_inputs(batch)
    assert mm is not None
    model = prepare_model(clone(ref), attention="eager")
    packed = unpad(ids, mask)
    out = packed_forward(model, packed, logprob_kernel=logprob_kernel(), multimodal=mm)
    assert out.log_probs is not None
    with torch.no_grad():
        kinds = (ids == IMAGE_TOKEN).long()
        lsm = (
            ref(input_ids=ids, attention_mask=mask, mm_token_type_ids=kinds, **mm)
            .logits.double()
            .log_softmax(-1)
        )
    want = torch.zeros(ids.shape, dtype=torch.float64)
    want[:, 1:] = lsm[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    keep = mask.bool()
    keep[:, 0] = False
    got = torch.zeros(ids.shape, dtype=torch.float64)
    got[mask.bool()] = out.log_probs.double()
    torch.testing.assert_close(got[keep], want[keep], atol=2e-5, rtol=0)
