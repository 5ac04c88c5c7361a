"""FSDP2 engine on real 2-process gloo groups: sharded steps against a plain float64 torch reference,
checkpoint resume (also on 1 rank from 2), offload exactness, weight streaming, HF export/load, LoRA,
Ulysses sp, and the bad-input errors. Each spawned job runs many checks and returns their figures, so
the suite pays for three process spawns only."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import ChildFailure, run_distributed
from tests.distributed import _fsdp_helpers as H

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

TOL = 2e-5  # fp32 engine vs float64 reference


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    """Full parameters under the names of the transformers module (fused experts stay fused; the
    checkpoint names that ``iter_weights`` yields are covered by the conformance suites)."""
    from underlay.engines.fsdp2._build import hf_name

    return {hf_name(n): t.detach().cpu().clone() for n, t in engine.named_full_parameters()}


def _step(engine: Any, batch: Any, loss_fn: Any = H.pg_loss) -> tuple[Any, Any]:
    res = engine.forward_backward(batch, loss_fn)
    return res, engine.optimizer_step()


def _snapshot(engine: Any) -> list[torch.Tensor]:
    """Local shards of every parameter, gradient and optimizer-state tensor, cloned (plain tensors on
    the world-size-1 path)."""
    out: list[torch.Tensor] = []
    for p in engine.model.parameters():
        out.append(H.local(p).detach().clone())
        if p.grad is not None:
            out.append(H.local(p.grad).detach().clone())
    for state in engine.optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                out.append((v.to_local() if hasattr(v, "to_local") else v).detach().clone())
    return out


def _equivalence(
    rank: int, world: int, hf_config: Any, kind: str = "causal_lm", uneven: bool = False, **cfg: Any
) -> dict[str, float]:
    """One sharded step on this rank's data share vs the float64 reference on the whole batch (ranks
    of one Ulysses group share their data)."""
    import copy

    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.interfaces import ModelConfig
    from underlay.registry import get_device

    if kind == "value":
        cfg["model"] = ModelConfig(hf_config=hf_config, kind="value")
    ec = H.engine_config(hf_config, **cfg)
    engine = FSDP2Engine(ec, get_device("cpu"))
    ulysses = engine.layout.ulysses
    gb = H.global_batch(11)
    loss_fn = H.value_loss if kind == "value" else H.pg_loss
    local = H.shard(gb, rank // ulysses, world // ulysses)
    if uneven:  # rank 0 one sequence, rank 1 the rest: rank 0 runs empty micro-batches
        local = gb.select([0] if rank == 0 else list(range(1, gb.batch_size)))
    res, st = _step(engine, local, loss_fn)
    ref = H.reference_model(copy.deepcopy(hf_config), 0, ec.model.lora, kind)
    loss, norm, ref_w = H.reference_step(ref, gb, ec, loss_fn, kind)
    return {
        "loss": abs(res.metrics["loss"] - loss),
        "norm": abs(st.grad_norm - norm),
        "weights": H.max_diff(_weights(engine), ref_w),
        "micro_batches": float(res.num_micro_batches),
        "loss_tokens": float(res.loss_tokens - int(gb.loss_mask.sum())),
    }


def _write_tokenizer(path: Path) -> None:
    """A tiny word-level tokenizer built locally (nothing downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(
        WordLevel({f"w{i}": i for i in range(H.VOCAB - 1)} | {"[UNK]": H.VOCAB - 1}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))


def job_pair(rank: int, world: int, root: str) -> dict[str, Any]:
    """Everything that needs 2 ranks."""
    from underlay.checkpoint import CheckpointManager
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader
    from underlay.interfaces import CheckpointError, ConfigError, LoraConfig, ParallelConfig
    from underlay.registry import get_device

    dev = get_device("cpu")
    out: dict[str, Any] = {}
    base = Path(root)
    ec = H.engine_config(H.llama_config())
    engine = FSDP2Engine(ec, dev)
    ref = H.reference_model(H.llama_config(), 0)
    gb1, gb2 = H.global_batch(1), H.global_batch(2)
    local1, local2 = H.shard(gb1, rank, world), H.shard(gb2, rank, world)

    # inference, in input order, against the padded float64 forward
    inf = engine.infer(local1, with_entropy=True)
    with torch.no_grad():
        ref_out = H.reference_outputs(ref, local1)
    out["infer_logp"] = float((inf.log_probs.double() - ref_out.log_probs).abs().max())
    out["infer_entropy"] = float((inf.entropy.double() - ref_out.entropy).abs().max())
    # weight streaming before any step equals the unsharded state dict; small buckets split it
    buckets = list(engine.iter_weights(bucket_bytes=8 << 10))
    out["buckets"] = len(buckets)
    out["bucket_max_bytes"] = max(
        sum(t.numel() * t.element_size() for _, t in b) for b in buckets if len(b) > 1
    )
    out["iter_init"] = H.max_diff({n: t for b in buckets for n, t in b}, H.merged_weights(ref))
    out["iter_names"] = sorted(n for b in buckets for n, _ in b) == sorted(ref.state_dict())

    # step 1: sharded, micro-batched == single-process reference
    res, st = _step(engine, local1)
    loss, norm, ref_w = H.reference_step(ref, gb1, ec)
    out["step_loss"] = abs(res.metrics["loss"] - loss)
    out["step_norm"] = abs(st.grad_norm - norm)
    out["step_weights"] = H.max_diff(_weights(engine), ref_w)
    out["micro_batches"] = res.num_micro_batches
    out["loss_tokens_ok"] = res.loss_tokens == int(gb1.loss_mask.sum())

    manager = CheckpointManager(base / "ckpt", engine, max_to_keep=2)
    torch.manual_seed(100 + rank)  # per-rank RNG streams
    manager.save(1, {"step": 1, "tag": "after-one"})
    draw_after_save = torch.rand(4)

    # step 2 with an offload/onload round trip between backward and the optimizer step
    res2 = engine.forward_backward(local2, H.pg_loss)
    before = _snapshot(engine)
    engine.offload()
    out["offloaded_grads_dropped"] = all(p.grad is None for p in engine.model.parameters())
    engine.onload()
    after = _snapshot(engine)
    out["offload_exact"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    engine.optimizer_step()
    w2 = _weights(engine)
    if rank == 0:
        torch.save({"loss2": res2.metrics["loss"], "w2": w2}, base / "expected.pt")

    # resume from step 1 on the same world: identical next step
    torch.rand(7)
    state = manager.load()
    out["rng_restored"] = torch.equal(torch.rand(4), draw_after_save)
    out["trainer_state"] = state == {"step": 1, "tag": "after-one"}
    out["global_step"] = engine.global_step
    res2b, _ = _step(engine, local2)
    out["resume_loss"] = abs(res2b.metrics["loss"] - res2.metrics["loss"])
    out["resume_weights"] = H.max_diff(_weights(engine), w2)

    # HF export in several shards, reloaded by transformers and by the weight loader
    exported = manager.export_hf(base / "hf", dtype=torch.float32, max_shard_bytes=40 << 10)
    current = _weights(engine)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        assert exported is not None
        out["export_files"] = len(list(exported.glob("*.safetensors")))
        out["export_index"] = (exported / "model.safetensors.index.json").is_file()
        hf = AutoModelForCausalLM.from_pretrained(str(exported))
        out["export_hf"] = H.max_diff(dict(hf.state_dict()), current)
        _write_tokenizer(exported / "tokenizer.json")
    from underlay.interfaces import ModelConfig

    loaded = FSDP2Engine(H.engine_config(H.llama_config(), model=ModelConfig(path=str(base / "hf"))), dev)
    out["load_hf"] = H.max_diff(_weights(loaded), current)
    again = FSDP2WeightLoader(dev).export_hf(loaded, base / "hf2")
    if rank == 0:
        assert again is not None
        out["tokenizer_copied"] = (again / "tokenizer.json").read_bytes() == (
            base / "hf" / "tokenizer.json"
        ).read_bytes()
    # a value model from a causal-LM directory: backbone loaded, the new score head from the seed
    critic = FSDP2Engine(
        H.engine_config(H.llama_config(), model=ModelConfig(path=str(base / "hf"), kind="value")), dev
    )
    cw = _weights(critic)
    out["value_backbone"] = H.max_diff(
        {k: v for k, v in cw.items() if k.startswith("model.")},
        {k: v for k, v in current.items() if k.startswith("model.")},
    )
    out["value_head_finite"] = "score.weight" in cw and bool(torch.isfinite(cw["score.weight"]).all())

    # another model: checkpoint and HF weights are refused before anything changes
    other = FSDP2Engine(H.engine_config(H.llama_config(intermediate_size=48)), dev)
    pristine = _weights(other)
    for name, fn in (
        ("ckpt_other", lambda: CheckpointManager(base / "ckpt", other).load()),
        ("hf_other", lambda: FSDP2WeightLoader(dev).load_hf(other, base / "hf")),
    ):
        try:
            fn()
            out[name] = "no error"
        except CheckpointError as exc:
            out[name] = str(exc)
    out["other_unchanged"] = H.max_diff(_weights(other), pristine) == 0.0
    try:  # 6 q heads / 3 kv heads cannot be split over 2 Ulysses ranks
        FSDP2Engine(
            H.engine_config(
                H.llama_config(hidden_size=48, num_attention_heads=6, num_key_value_heads=3),
                parallel=ParallelConfig(ulysses=2),
            ),
            dev,
        )
        out["sp_heads"] = "no error"
    except ConfigError as exc:
        out["sp_heads"] = str(exc)

    # LoRA: only adapters train; merged weights stream; adapters export alone
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    le = FSDP2Engine(H.engine_config(H.llama_config(), lora=lora), dev)
    base_before = {n: p.to_local().clone() for n, p in le.model.named_parameters() if "lora_" not in n}
    lora_before = {n: p.to_local().clone() for n, p in le.model.named_parameters() if "lora_" in n}
    _step(le, local1)
    out["lora_base_same"] = all(
        torch.equal(p.to_local(), base_before[n]) for n, p in le.model.named_parameters() if "lora_" not in n
    )
    out["lora_changed"] = all(
        not torch.equal(p.to_local(), lora_before[n]) for n, p in le.model.named_parameters() if "lora_B" in n
    )
    lref = H.reference_model(H.llama_config(), 0, lora)
    _, _, lref_w = H.reference_step(lref, gb1, H.engine_config(H.llama_config(), lora=lora))
    out["lora_merged"] = H.max_diff(_weights(le), lref_w)
    adir = FSDP2WeightLoader(dev).export_adapters(le, base / "adapters")
    lora_merged = _weights(le)  # collective: every rank
    if rank == 0:
        assert adir is not None
        from safetensors.torch import load_file

        tensors = load_file(str(adir / "adapter_model.safetensors"))
        out["adapter_tensors"] = len(tensors)
        out["adapter_config"] = (adir / "adapter_config.json").is_file()
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            base_model = AutoModelForCausalLM.from_config(H.llama_config(), dtype=torch.float32)
        merged = PeftModel.from_pretrained(base_model, str(adir)).merge_and_unload()
        out["adapter_reload"] = H.max_diff(dict(merged.state_dict()), lora_merged)

    # Qwen3-MoE and a value model: the same step equivalence
    moe = _equivalence(rank, world, H.qwen3_moe_config())
    out.update({f"moe_{k}": v for k, v in moe.items()})
    val = _equivalence(rank, world, H.llama_config(classifier_dropout=0.0), kind="value")
    out.update({f"value_{k}": v for k, v in val.items()})
    # Ulysses 2 (both ranks consume the same data) and HSDP (replicate 2 x shard 1)
    usp = _equivalence(rank, world, H.llama_config(), parallel=ParallelConfig(ulysses=2))
    out.update({f"sp_{k}": v for k, v in usp.items()})
    # 4 q heads / 1 kv head over 2 Ulysses ranks: the kv head is repeated (the one head rule accepts it)
    mqa = _equivalence(rank, world, H.llama_config(num_key_value_heads=1), parallel=ParallelConfig(ulysses=2))
    out.update({f"mqa_{k}": v for k, v in mqa.items()})
    hsdp = _equivalence(rank, world, H.llama_config(), parallel=ParallelConfig(dp_replicate=2))
    out.update({f"hsdp_{k}": v for k, v in hsdp.items()})
    uneven = _equivalence(rank, world, H.llama_config(), uneven=True, max_tokens=12)
    out.update({f"uneven_{k}": v for k, v in uneven.items()})
    tied = _equivalence(rank, world, H.qwen2_tied_config())
    out.update({f"tied_{k}": v for k, v in tied.items()})
    # activation checkpointing and CPUOffloadPolicy change memory, not the step
    ac = _equivalence(rank, world, H.llama_config(), recompute="full")
    out.update({f"ac_{k}": v for k, v in ac.items()})
    os.environ["UNDERLAY_COMPILE_BACKEND"] = "aot_eager"  # dynamo + autograd tracing, no C++ build
    # compile=True (layer parts: norms, attention, dense MLPs) on a dense model, whose MLPs it compiles;
    # the whole-layer compile on the MoE model (its sparse block is compiled only there)
    comp = _equivalence(rank, world, H.llama_config(), options={"compile": True})
    out.update({f"compiled_{k}": v for k, v in comp.items()})
    whole = _equivalence(rank, world, H.qwen3_moe_config(), options={"compile": "layer"})
    out.update({f"layer_{k}": v for k, v in whole.items()})
    off = _equivalence(rank, world, H.llama_config(), cpu_offload=True)
    out.update({f"cpuoff_{k}": v for k, v in off.items()})
    # reshard_after_forward=False keeps the parameters unsharded from one micro-batch to the next (one
    # all-gather per step); compiled whole layers. Two steps, so the second forward must see the update.
    out.update(_kept_unsharded_two_steps(rank, world))
    return out


def _kept_unsharded_two_steps(rank: int, world: int) -> dict[str, float]:
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.registry import get_device

    results = []
    for options in ({}, {"reshard_after_forward": False, "compile": "layer"}):
        engine = FSDP2Engine(
            H.engine_config(H.llama_config(), max_tokens=12, options=options), get_device("cpu")
        )
        losses = []
        for seed in (3, 4):
            res, _ = _step(engine, H.shard(H.global_batch(seed), rank, world))
            losses.append(res.metrics["loss"])
        unsharded = [p for p in engine.model.parameters() if type(p).__name__ != "DTensor"]
        results.append((losses, _weights(engine), res.num_micro_batches, len(unsharded)))
    (base_l, base_w, _, _), (kept_l, kept_w, mbs, left_unsharded) = results
    return {
        "kept_loss": max(abs(a - b) for a, b in zip(base_l, kept_l)),
        "kept_weights": H.max_diff(kept_w, base_w),
        "kept_micro_batches": float(mbs),
        "kept_left_unsharded": float(left_unsharded),
    }


def job_single(rank: int, world: int, root: str, killed_root: str) -> dict[str, Any]:
    """1 rank: resume the 2-rank checkpoint, the latest of a save killed midway, layout errors."""
    from underlay.checkpoint import CheckpointManager, latest
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.interfaces import CheckpointError, ConfigError, OptimConfig, ParallelConfig
    from underlay.registry import get_device, get_engine

    dev = get_device("cpu")
    out: dict[str, Any] = {}
    base = Path(root)
    engine = get_engine(H.engine_config(H.llama_config()))  # through the registry
    out["registry_engine"] = type(engine).__name__
    state = CheckpointManager(base / "ckpt", engine).load(base / "ckpt" / "step_1")
    out["trainer_state"] = state["tag"]
    expected = torch.load(base / "expected.pt", weights_only=True)
    res, _ = _step(engine, H.global_batch(2))
    out["resume1_loss"] = abs(res.metrics["loss"] - expected["loss2"])
    out["resume1_weights"] = H.max_diff(_weights(engine), expected["w2"])

    # a non-finite grad norm skips the update: parameters and optimizer state unchanged, grads zeroed
    before = _snapshot(engine)
    engine.forward_backward(H.global_batch(3), lambda o, b, c: (H.pg_loss(o, b, c)[0] * math.nan, {}))
    st = engine.optimizer_step()
    out["nan_skipped"] = st.skipped and not st.finite
    out["nan_grads_zeroed"] = all(p.grad is None for p in engine.model.parameters())
    after = _snapshot(engine)
    out["nan_unchanged"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))

    # the LR schedule advances and is restored by load_checkpoint
    sched = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    e1 = FSDP2Engine(H.engine_config(H.llama_config(), optim=sched), dev)
    _step(e1, H.global_batch(4))
    lrs = [e1.lr_scheduler_step() for _ in range(3)]
    (base / "sched").mkdir()
    e1.save_checkpoint(base / "sched")
    e2 = FSDP2Engine(H.engine_config(H.llama_config(), optim=sched), dev)
    e2.load_checkpoint(base / "sched")
    out["lrs"] = lrs
    out["lr_resumed"] = (e1.lr_scheduler_step(), e2.lr_scheduler_step(), e2.global_step)

    killed = CheckpointManager(killed_root, engine)
    out["killed_latest"] = str(latest(killed_root))
    out["killed_state"] = killed.load()["step"]
    try:
        killed.load(Path(killed_root) / "step_4")
        out["incomplete"] = "no error"
    except CheckpointError as exc:
        out["incomplete"] = str(exc)
    for name, par in (("tp", ParallelConfig(tp=2)), ("replicate", ParallelConfig(dp_replicate=2))):
        try:
            FSDP2Engine(H.engine_config(H.llama_config(), parallel=par), dev)
            out[name] = "no error"
        except ConfigError as exc:
            out[name] = str(exc)
    return out


def job_killed(rank: int, world: int, root: str) -> None:
    """Save steps 1-3 (rotation keeps 2), then die inside the engine write of step 4."""
    from underlay.checkpoint import CheckpointManager
    from underlay.engines.fsdp2.engine import FSDP2Engine
    from underlay.registry import get_device

    engine = FSDP2Engine(H.engine_config(H.llama_config()), get_device("cpu"))
    manager = CheckpointManager(root, engine, max_to_keep=2)
    for step in (1, 2, 3):
        _step(engine, H.global_batch(step))
        manager.save(step, {"step": step})
    original = engine.save_checkpoint

    def dying(directory: Path) -> None:
        original(directory)
        os._exit(3)

    engine.save_checkpoint = dying  # type: ignore[method-assign]
    manager.save(4, {"step": 4})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp2")
    killed = tmp_path_factory.mktemp("killed")
    with pytest.raises(ChildFailure):
        run_distributed(job_killed, 1, str(killed), timeout_s=240)
    pair = run_distributed(job_pair, 2, str(root), timeout_s=240)
    single = run_distributed(job_single, 1, str(root), str(killed), timeout_s=240)
    return {"pair": pair, "single": single[0], "killed": killed}


def test_sharded_step_equals_reference(runs: dict[str, Any]) -> None:
    for r in runs["pair"]:
        assert r["micro_batches"] >= 2, "the test batch must be split into several micro-batches"
        assert r["loss_tokens_ok"]
        assert r["step_loss"] < TOL and r["step_norm"] < TOL and r["step_weights"] < TOL, r


def test_moe_value_tied_sp_hsdp_ac_offload_steps(runs: dict[str, Any]) -> None:
    for r in runs["pair"]:
        for p in ("moe", "value", "uneven", "tied", "sp", "mqa", "hsdp", "ac", "compiled", "layer", "cpuoff"):
            assert r[f"{p}_loss"] < TOL and r[f"{p}_norm"] < TOL and r[f"{p}_weights"] < TOL, (p, r)
            assert r[f"{p}_loss_tokens"] == 0
        assert r["uneven_micro_batches"] >= 3, "rank 0 must run (empty) micro-batches it has no data for"
        assert r["kept_loss"] < TOL and r["kept_weights"] < TOL, r
        assert r["kept_micro_batches"] >= 2 and r["kept_left_unsharded"] == 0, r


def test_infer_and_iter_weights(runs: dict[str, Any]) -> None:
    for r in runs["pair"]:
        assert r["infer_logp"] < TOL and r["infer_entropy"] < TOL
        assert r["iter_init"] == 0.0 and r["iter_names"]
        assert r["buckets"] > 3 and r["bucket_max_bytes"] <= 8 << 10


def test_resume_identical(runs: dict[str, Any]) -> None:
    for r in runs["pair"]:
        assert r["trainer_state"] and r["global_step"] == 1 and r["rng_restored"]
        assert r["resume_loss"] == 0.0 and r["resume_weights"] == 0.0
    s = runs["single"]
    assert s["trainer_state"] == "after-one"
    assert s["resume1_loss"] < 1e-6 and s["resume1_weights"] < 1e-6


def test_non_finite_norm_skips_step(runs: dict[str, Any]) -> None:
    s = runs["single"]
    assert s["registry_engine"] == "FSDP2Engine"
    assert s["nan_skipped"] and s["nan_grads_zeroed"] and s["nan_unchanged"]


def test_lr_schedule_steps_and_resumes(runs: dict[str, Any]) -> None:
    from underlay.interfaces import OptimConfig
    from underlay.ops import build_lr_scheduler

    cfg = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=cfg.lr)
    sched = build_lr_scheduler(opt, cfg)
    expected = []
    for _ in range(3):
        opt.step()
        sched.step()
        expected.append(opt.param_groups[0]["lr"])
    lrs = runs["single"]["lrs"]
    assert lrs == pytest.approx(expected) and lrs[2] < lrs[1]
    a, b, step = runs["single"]["lr_resumed"]
    assert a == b and step == 1


def test_offload_onload_exact(runs: dict[str, Any]) -> None:
    for r in runs["pair"]:
        assert r["offloaded_grads_dropped"] and r["offload_exact"]


def test_export_and_load_hf(runs: dict[str, Any]) -> None:
    r0 = runs["pair"][0]
    assert r0["export_files"] > 1 and r0["export_index"]
    assert r0["export_hf"] == 0.0
    assert r0["tokenizer_copied"]
    for r in runs["pair"]:
        assert r["load_hf"] == 0.0
        assert r["value_backbone"] == 0.0 and r["value_head_finite"]


def test_lora_trains_adapters_only(runs: dict[str, Any]) -> None:
    for r in runs["pair"]:
        assert r["lora_base_same"] and r["lora_changed"]
        assert r["lora_merged"] < TOL
    r0 = runs["pair"][0]
    assert r0["adapter_tensors"] == 8 and r0["adapter_config"]
    assert r0["adapter_reload"] < 1e-6, "peft must rebuild the merged weights from the exported adapters"


def test_bad_inputs_rejected_before_state_changes(runs: dict[str, Any]) -> None:
    r = runs["pair"][0]
    assert "another model" in r["ckpt_other"]
    assert "shape mismatch" in r["hf_other"]
    assert r["other_unchanged"]
    assert "ulysses=2 and num_kv_heads=3" in r["sp_heads"] and "choose ulysses in [1, 3, 6]" in r["sp_heads"]
    s = runs["single"]
    assert "cannot run {'tp': 2}" in s["tp"] and "UNDERLAY_ENGINE=mcore" in s["tp"]
    assert "not divisible by" in s["replicate"]
    assert "COMPLETE" in s["incomplete"]


def test_killed_save_leaves_previous_loadable(runs: dict[str, Any]) -> None:
    from underlay.checkpoint import complete_checkpoints

    killed = runs["killed"]
    assert [s for s, _ in complete_checkpoints(killed)] == [2, 3]
    assert not (killed / "step_4.tmp").exists()  # the restarted manager removed the dead save's leftovers
    s = runs["single"]
    assert s["killed_latest"].endswith("step_3") and s["killed_state"] == 3
    assert not math.isnan(s["resume1_loss"])
