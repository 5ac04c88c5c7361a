"""Vision-language models in the fsdp2 engine, two gaps transformers leaves, on a real 2-process gloo
group in one spawn:

- a value model (critic) of Qwen2.5-VL (``ModelConfig(kind="value")``: the VL backbone loaded from the
  policy's checkpoint plus a seed-initialised ``score`` head) with images and a video: per-token values
  equal the float64 padded forward of the same module, one step equals the float64 step, and its
  export (backbone in transformers' names plus ``score.*``) loads back into underlay with equal values
  and into transformers' ``AutoModel`` (the backbone; the head read from the file) with equal values;
- Qwen3-VL-MoE checkpoints in the hub layout (fused experts transposed against transformers' modules)
  and in ``save_pretrained``'s layout both load exactly, and the export (hub layout) reloads in
  transformers exactly;
- under Ulysses sp=2 each rank runs the vision tower on its share of the images and videos only
  (``models.shard_vision_tower``), and the causal LM's log-probs and entropy and the value model's
  values, and the summed gradients of both, equal one process.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H
from tests.distributed.test_fsdp2_vlm import vl_global_batch
from tests.unit.models._tiny import save_vl_source
from underlay.interfaces import LossContext, TokenBatch, TokenOutputs

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

TOL = 2e-5  # fp32 engine vs float64 reference
MOE_I = 24  # expert width: gate_up [E, 48, 64] and down [E, 64, 24], neither square


def _padded_values(model: Any, batch: TokenBatch) -> torch.Tensor:
    """The value model's padded forward of the whole batch (all images in one call), ``[B, S]``, 0 on
    padding, in the model's dtype."""
    from tests.unit.models._tiny import IMAGE_TOKEN, VIDEO_TOKEN
    from underlay.models import multimodal_inputs

    mm = multimodal_inputs(batch)
    assert mm is not None
    dtype = next(model.parameters()).dtype
    mm = {k: v.to(dtype) if v.is_floating_point() else v for k, v in mm.items()}
    kinds = (batch.input_ids == IMAGE_TOKEN).long() + 2 * (batch.input_ids == VIDEO_TOKEN).long()
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, mm_token_type_ids=kinds, **mm)
    return out.logits[..., 0] * batch.attention_mask


def _reference_value_step(model: Any, batch: TokenBatch, cfg: Any) -> tuple[float, float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay
    )
    values = _padded_values(model, batch)
    loss, _ = H.value_loss(TokenOutputs(None, None, values), batch, LossContext.single(batch.loss_mask))
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip))
    opt.step()
    return float(loss.detach()), norm


def _value_part(rank: int, world: int, root: Path) -> dict[str, Any]:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText

    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader, load_hf_into
    from underlay.interfaces import ModelConfig
    from underlay.models import vision_value_model
    from underlay.registry import get_device

    src = root / "source"
    cfg = AutoConfig.from_pretrained(str(src), local_files_only=True)
    base = H.engine_config(cfg, max_tokens=40)
    ec = dataclasses.replace(base, model=ModelConfig(path=str(src), kind="value", seed=4, attention="eager"))
    engine = FSDP2Engine(ec, get_device("cpu"))
    out: dict[str, Any] = {"class": type(engine.model).__name__}
    full = {n: t.detach().clone() for n, t in engine.named_full_parameters()}
    # the backbone is the policy checkpoint's (flat names in the file), the head comes from the seed
    policy = AutoModelForImageTextToText.from_pretrained(str(src), attn_implementation="eager")
    backbone = {n: p for n, p in policy.named_parameters() if n.startswith("model.")}
    out["backbone_from_policy"] = H.max_diff(backbone, {n: full[n] for n in backbone})
    ref = vision_value_model(copy.deepcopy(cfg))
    ref.load_state_dict(full)
    ref = ref.double()
    ref.set_attn_implementation("eager")
    gb = vl_global_batch(21)
    local = H.shard(gb, rank, world)
    got = engine.infer(local).values
    assert got is not None
    with torch.no_grad():
        want = _padded_values(ref, gb)[rank::world]
    out["values"] = float((got.double() - want).abs().max())
    res = engine.forward_backward(local, H.value_loss)
    st = engine.optimizer_step()
    loss, norm = _reference_value_step(ref, gb, ec)
    out["loss"], out["norm"] = abs(res.metrics["loss"] - loss), abs(st.grad_norm - norm)
    after = engine.infer(local).values
    assert after is not None
    exported = FSDP2WeightLoader(get_device("cpu")).export_hf(
        engine, root / "value_export", dtype=torch.float32
    )
    if rank == 0:
        assert exported is not None
        with safe_open(str(exported / "model.safetensors"), "pt") as f:
            names = set(f.keys())
            head_w, head_b = f.get_tensor("score.weight"), f.get_tensor("score.bias")
        out["export_names"] = sorted(
            n for n in names if not n.startswith(("model.layers.", "visual.blocks."))
        )
        out["no_lm_head"] = "lm_head.weight" not in names
        # transformers: AutoModel reloads the backbone (score.* is unexpected to it); the head by hand
        hf, info = AutoModel.from_pretrained(
            str(exported), attn_implementation="eager", output_loading_info=True
        )
        out["hf_missing"], out["hf_unexpected"] = (
            sorted(info["missing_keys"]),
            sorted(info["unexpected_keys"]),
        )
        hf_ref = vision_value_model(copy.deepcopy(cfg))
        hf_ref.model.load_state_dict(hf.state_dict())
        with torch.no_grad():
            hf_ref.score.weight.copy_(head_w)
            hf_ref.score.bias.copy_(head_b)
            hf_values = _padded_values(hf_ref.double(), gb)[0::world]
        out["hf_values"] = float((after.double() - hf_values).abs().max())
    dist.barrier()
    ec2 = dataclasses.replace(
        ec, model=ModelConfig(path=str(root / "value_export"), kind="value", attention="eager")
    )
    engine2 = FSDP2Engine(ec2, get_device("cpu"))
    report = load_hf_into(engine2, root / "value_export", strict=True)
    out["reload_missing"], out["reload_unexpected"] = list(report.missing), list(report.unexpected)
    again = engine2.infer(local).values
    assert again is not None
    out["reload_values"] = float((again - after).abs().max())
    return out


def _write_hub_layout(src: Path, dst: Path) -> None:
    """A copy of the ``save_pretrained`` directory ``src`` with the fused experts as the hub stores
    them (dims 1 and 2 swapped)."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    hub = {
        n: t.transpose(1, 2).contiguous() if n.endswith(("experts.gate_up_proj", "experts.down_proj")) else t
        for n, t in tensors.items()
    }
    save_file(hub, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(src / "config.json", dst / "config.json")


def _moe_part(rank: int, world: int, root: Path) -> dict[str, Any]:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForImageTextToText

    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader
    from underlay.interfaces import ModelConfig
    from underlay.registry import get_device

    mem, hub = root / "moe_memory_layout", root / "moe_hub_layout"
    original = AutoModelForImageTextToText.from_pretrained(str(mem))
    want = {n: p.detach() for n, p in original.named_parameters()}
    cfg = AutoConfig.from_pretrained(str(mem), local_files_only=True)
    out: dict[str, Any] = {}
    engine = None
    for label, path in (("memory", mem), ("hub", hub)):
        ec = dataclasses.replace(H.engine_config(cfg), model=ModelConfig(path=str(path), attention="eager"))
        engine = FSDP2Engine(ec, get_device("cpu"))
        out[f"load_{label}"] = H.max_diff(want, dict(engine.named_full_parameters()))
    assert engine is not None
    exported = FSDP2WeightLoader(get_device("cpu")).export_hf(
        engine, root / "moe_export", dtype=torch.float32
    )
    if rank == 0:
        assert exported is not None
        with safe_open(str(exported / "model.safetensors"), "pt") as f:
            out["export_shapes"] = {
                n.rsplit(".", 1)[-1]: tuple(f.get_slice(n).get_shape())
                for n in f.keys()  # noqa: SIM118 (a safetensors handle, not a dict)
                if n.startswith("model.language_model.layers.0.mlp.experts.")
            }
        for label, path in (("hf_hub_source", hub), ("hf_export", exported)):
            reloaded = AutoModelForImageTextToText.from_pretrained(str(path))
            out[label] = H.max_diff(want, dict(reloaded.named_parameters()))
    return out


def _sp_part(rank: int, world: int) -> dict[str, Any]:
    """Qwen2.5-VL (causal LM and value model) on four images and a video, packed, sp=2 against one
    process, in float64 (the ranks sum each image's gradient terms in another order): outputs,
    gradients summed over the group, and the vision patches each rank encoded."""
    from tests.unit.models._tiny import clone, logprob_kernel, tiny_vl_model
    from underlay.models import multimodal_inputs, packed_forward, prepare_model, vision_value_model
    from underlay.ops.packing import unpad

    batch = vl_global_batch(31)
    packed = unpad(batch.input_ids, batch.attention_mask)
    mm = multimodal_inputs(batch)
    assert mm is not None
    mm = {k: v.double() if v.is_floating_point() else v for k, v in mm.items()}
    g = torch.Generator().manual_seed(12)
    w1, w2 = (torch.randn(packed.total_tokens, generator=g, dtype=torch.float64) for _ in range(2))
    policy = tiny_vl_model("qwen2_5_vl").double()
    torch.manual_seed(6)
    critic = vision_value_model(copy.deepcopy(policy.config), dtype=torch.float64)
    out: dict[str, Any] = {}
    for label, ref in (("policy", policy), ("value", critic)):
        runs: list[tuple[list[torch.Tensor], dict[str, torch.Tensor], int]] = []
        for group in (None, dist.group.WORLD):
            model = prepare_model(clone(ref), attention="eager", sp_group=group)
            seen: list[int] = []
            hook = model.model.visual.patch_embed.register_forward_pre_hook(
                lambda _m, args, seen=seen: seen.append(int(args[0].shape[0]))
            )
            res = packed_forward(model, packed, logprob_kernel=logprob_kernel(), multimodal=mm)
            hook.remove()
            if label == "policy":
                assert res.log_probs is not None and res.entropy is not None
                outs = [res.log_probs, res.entropy]
                ((res.log_probs * w1).sum() + (res.entropy * w2).sum()).backward()
            else:
                assert res.values is not None
                outs = [res.values]
                (res.values * w1).sum().backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            runs.append(([o.detach() for o in outs], grads, sum(seen)))
        (single, single_grads, single_patches), (split, split_grads, split_patches) = runs
        diff = max(float((a - b).abs().max()) for a, b in zip(split, single))
        grad_diff = 0.0
        assert split_grads.keys() == single_grads.keys()
        for name, grad in split_grads.items():
            dist.all_reduce(grad)
            grad_diff = max(grad_diff, float((grad - single_grads[name]).abs().max()))
        out[label] = {
            "outputs": diff,
            "grads": grad_diff,
            "visual_grads": any(".visual." in n for n in split_grads),
            "patches_one_process": single_patches,
            "patches_this_rank": split_patches,
        }
    return out


def _worker(rank: int, world: int, root_s: str) -> dict[str, Any]:
    from tests.unit.models._tiny import tiny_vl_model

    root = Path(root_s)
    if rank == 0:
        save_vl_source(root / "source")
        tiny_vl_model("qwen3_vl_moe", moe_intermediate=MOE_I).save_pretrained(str(root / "moe_memory_layout"))
        _write_hub_layout(root / "moe_memory_layout", root / "moe_hub_layout")
    dist.barrier()
    return {
        "value": _value_part(rank, world, root),
        "moe": _moe_part(rank, world, root),
        "sp": _sp_part(rank, world),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("vlm_value")
    return run_distributed(_worker, 2, str(root), timeout_s=380)


def test_vlm_value_model_values_and_step_equal_float64_reference(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        v = r["value"]
        assert v["class"].startswith("FSDP") and "Qwen2_5_VLValueModel" in v["class"], v
        assert v["backbone_from_policy"] == 0.0, v
        assert v["values"] < TOL, v
        assert v["loss"] < TOL and v["norm"] < TOL, v


def test_vlm_value_model_export_reloads_in_underlay_and_transformers(runs: list[dict[str, Any]]) -> None:
    v0 = runs[0]["value"]
    assert {
        "score.weight",
        "score.bias",
        "visual.patch_embed.proj.weight",
        "model.embed_tokens.weight",
    } <= set(v0["export_names"]), v0
    assert v0["no_lm_head"], v0
    assert v0["hf_missing"] == [] and v0["hf_unexpected"] == ["score.bias", "score.weight"], v0
    assert v0["hf_values"] < 1e-5, v0
    for r in runs:
        v = r["value"]
        assert v["reload_missing"] == [] and v["reload_unexpected"] == [], v
        assert v["reload_values"] == 0.0, v


def test_qwen3_vl_moe_hub_and_memory_layouts_load_and_export_reloads(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert r["moe"]["load_memory"] == 0.0 and r["moe"]["load_hub"] == 0.0, r["moe"]
    m0 = runs[0]["moe"]
    # hub layout: gate_up [E, H, 2I], down [E, I, H] (transformers' modules: [E, 2I, H], [E, H, I])
    assert m0["export_shapes"] == {"gate_up_proj": (4, 64, 2 * MOE_I), "down_proj": (4, MOE_I, 64)}, m0
    assert m0["hf_hub_source"] == 0.0 and m0["hf_export"] == 0.0, m0


def test_vlm_ulysses_ranks_share_the_vision_tower_and_equal_one_process(runs: list[dict[str, Any]]) -> None:
    for label in ("policy", "value"):
        total = runs[0]["sp"][label]["patches_one_process"]
        # 4 images of 16 patches and a 2-frame video of 32; images and videos are separate tower
        # calls, each split by items: rank 0 encodes images 0-1 and the video, rank 1 images 2-3 and,
        # having no video, a one-merged-token dummy (2 x 2 patches) with weight 0
        assert total == 4 * 16 + 32, runs[0]["sp"]
        assert [r["sp"][label]["patches_this_rank"] for r in runs] == [32 + 32, 32 + 4], runs[0]["sp"]
        for r in runs:
            s = r["sp"][label]
            assert s["visual_grads"] and s["outputs"] < 1e-10 and s["grads"] < 1e-10, (label, s)
