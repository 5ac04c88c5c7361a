"""The architectures added by capability inspection on real 2-process gloo groups, in one spawn: Ulysses
sp=2 equals one process for each of them (log-probs, entropy, summed parameter gradients), and a 2-rank
FSDP2 step equals the float64 single-process step for a dense (Gemma 2: softcaps, alternating sliding
windows, unfused softcapped head) and an MoE model (Mixtral), whose HF exports transformers reloads with
equal logits; Qwen2.5-VL with images under Ulysses equals one process."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H
from tests.distributed.test_ulysses import _check_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

TOL = 2e-5  # fp32 engine vs float64 reference
FSDP_ARCHS = ("gemma2", "mixtral")


def _fsdp_step_and_export(rank: int, world: int, arch: str, root: Path) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from tests.unit.models._tiny import tiny_config
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader
    from underlay.registry import get_device

    hf_config = tiny_config(arch)
    ec = H.engine_config(hf_config)
    engine = FSDP2Engine(ec, get_device("cpu"))
    gb = H.global_batch(11)
    res = engine.forward_backward(H.shard(gb, rank, world), H.pg_loss)
    st = engine.optimizer_step()
    ref = H.reference_model(copy.deepcopy(hf_config), 0)
    loss, norm, ref_w = H.reference_step(ref, gb, ec, mask_keys=False)  # right-padded batch
    weights = {n: t.detach().cpu().clone() for b in engine.iter_weights(1 << 29) for n, t in b}
    # iter_weights yields checkpoint names (Mixtral: per-expert block_sparse_moe.*): map the modules' too
    ref_w = dict(engine.weight_map.to_hf(ref_w.items()))
    out = {
        "loss": abs(res.metrics["loss"] - loss),
        "norm": abs(st.grad_norm - norm),
        "weights": H.max_diff(weights, ref_w),
        "micro_batches": float(res.num_micro_batches),
    }
    exported = FSDP2WeightLoader(get_device("cpu")).export_hf(engine, root / arch, dtype=torch.float32)
    if rank == 0:
        assert exported is not None
        reloaded = AutoModelForCausalLM.from_pretrained(str(exported), attn_implementation="eager")
        out["export_weights"] = H.max_diff(
            dict(engine.weight_map.to_hf(reloaded.state_dict().items())), weights
        )
        # the reloaded model against the reference after the same step (float64 -> fp32 weights)
        ref_f32 = copy.deepcopy(ref).float()
        batch = H.global_batch(5)
        with torch.no_grad():
            a = reloaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            b = ref_f32(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        keep = batch.attention_mask.bool()
        out["export_logits"] = float((a - b)[keep].abs().max())
    dist.barrier()
    return out


def _check_vl_ulysses() -> None:
    """Qwen2.5-VL with images under sp=2 (sequence split after the vision features are merged, each
    rank encoding one of the two images; 31 tokens padded to 32) equals one process, in float64 (the
    ranks sum each image's gradient contributions in another order than one process, which in fp32
    moves the patch embedding's gradient, whose terms reach 1e2, by 2e-4); Qwen3-VL (deepstack) is
    refused for sp."""
    from tests.unit.models._tiny import clone, logprob_kernel, tiny_vl_model, vl_batch
    from underlay.interfaces import ConfigError
    from underlay.models import packed_forward, prepare_model
    from underlay.ops.packing import unpad

    ref = tiny_vl_model("qwen2_5_vl").double()
    ids, mask, mm = vl_batch()
    mm = {k: v.double() if v.is_floating_point() else v for k, v in mm.items()}
    packed = unpad(ids, mask)
    g = torch.Generator().manual_seed(11)
    w1, w2 = (torch.randn(packed.total_tokens, generator=g, dtype=torch.float64) for _ in range(2))

    def run(group: Any | None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        model = prepare_model(clone(ref), attention="eager", sp_group=group)
        out = packed_forward(model, packed, logprob_kernel=logprob_kernel(), multimodal=mm)
        assert out.log_probs is not None and out.entropy is not None
        ((out.log_probs * w1).sum() + (out.entropy * w2).sum()).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return [out.log_probs.detach(), out.entropy.detach()], grads

    single, single_grads = run(None)
    split, split_grads = run(dist.group.WORLD)
    for a, b in zip(split, single):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    assert split_grads.keys() == single_grads.keys() and any(".visual." in n for n in split_grads)
    for name, grad in split_grads.items():
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, single_grads[name], atol=1e-10, rtol=1e-9, msg=name)
    with pytest.raises(ConfigError, match="deepstack"):
        prepare_model(tiny_vl_model("qwen3_vl"), sp_group=dist.group.WORLD)


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    from tests.unit.models._tiny import NEW_ARCHS

    for arch in NEW_ARCHS:  # Ulysses: kv heads == sp (deepseek_v3: 4 == q heads)
        _check_model(arch, 4, 2, False)
    _check_model("gpt_oss", 4, 1, False)  # kv heads < sp: repeated; sinks sliced per head group
    _check_model("deepseek_v3", 4, 4, True)  # value model with latent attention
    _check_vl_ulysses()
    return {arch: _fsdp_step_and_export(rank, world, arch, Path(root)) for arch in FSDP_ARCHS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("coverage")
    return run_distributed(_worker, 2, str(root), timeout_s=380)


def test_fsdp2_step_equals_float64_reference_dense_and_moe(runs: list[dict[str, Any]]) -> None:
    for per_rank in runs:
        for arch in FSDP_ARCHS:
            r = per_rank[arch]
            assert r["micro_batches"] >= 2, (arch, r)
            assert r["loss"] < TOL and r["norm"] < TOL and r["weights"] < TOL, (arch, r)


def test_exports_reload_with_equal_logits(runs: list[dict[str, Any]]) -> None:
    for arch in FSDP_ARCHS:
        r = runs[0][arch]
        assert r["export_weights"] == 0.0, (arch, r)
        assert r["export_logits"] < 1e-4, (arch, r)
