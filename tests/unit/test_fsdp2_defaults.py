"""The fsdp2 auto options: per-device speed defaults, the memory estimate against peaks recorded on the
H200, and the memory policy's choice for real model shapes on made-up device sizes (pure functions;
the shapes come from the real Hugging Face modules built on the meta device)."""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import cache
from typing import Any

import pytest

from underlay.engines.fsdp2.defaults import (
    AUTO_COMPILE_BUDGET,
    MEMORY_MARGIN_BYTES,
    MEMORY_MARGIN_FRACTION,
    ModelShape,
    choose_memory_policy,
    device_defaults,
    estimate_memory,
    resolve,
    usable_bytes,
)
from underlay.engines.fsdp2.options import FSDP2Options

GiB = 1 << 30
H200 = 143771 * (1 << 20)  # memory.total of the lent H200 (nvidia-smi), bytes
H100 = 81559 * (1 << 20)
TOLERANCE = 0.15  # the estimate is within 15% of every recorded peak (measured: within 2%)


@cache
def shape_of(name: str) -> ModelShape:
    """ModelShape of a full-size model built on the meta device (no memory, no download)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    from underlay.engines.fsdp2 import _build
    from underlay.engines.fsdp2._auto import model_shape
    from underlay.interfaces import ModelConfig

    cfgs: dict[str, Any] = {
        "qwen2-1.5b": lambda: Qwen2Config(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
        "llama-3.2-1b": lambda: LlamaConfig(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=True,
        ),
        "qwen3-4b": lambda: Qwen3Config(
            vocab_size=151936,
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
        "qwen3-8b": lambda: Qwen3Config(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
        ),
    }
    cfg = cfgs[name]()
    model = _build.build_model(ModelConfig(hf_config=cfg), cfg, meta=True)
    return model_shape(model, cfg)


def test_model_shapes_count_the_real_parameters() -> None:
    q2, q4, q8 = shape_of("qwen2-1.5b"), shape_of("qwen3-4b"), shape_of("qwen3-8b")
    assert 1.50e9 < q2.params < 1.56e9 and q2.layers == 28 and not q2.qk_norm
    assert 4.00e9 < q4.params < 4.05e9 and q4.qk_norm and q4.head_dim == 128
    assert 8.15e9 < q8.params < 8.25e9 and q8.trainable == q8.params
    assert q8.root_params == 2 * 151936 * 4096 + 4096  # untied embeddings and head, final norm


def test_device_defaults_per_device_type() -> None:
    cuda = device_defaults("cuda", inductor_ok=True, fused_adamw_ok=True)
    assert (cuda.compile, cuda.fused_adamw, cuda.compile_memory_budget) == (
        "layer",
        True,
        AUTO_COMPILE_BUDGET,
    )
    no_triton = device_defaults("cuda", inductor_ok=False, fused_adamw_ok=True)
    assert no_triton.compile is False and no_triton.compile_memory_budget is None
    assert "triton" in no_triton.reasons["compile"]
    cpu = device_defaults("cpu", inductor_ok=None, fused_adamw_ok=True)
    assert (cpu.compile, cpu.fused_adamw, cpu.compile_memory_budget) == (False, False, None)
    npu = device_defaults("npu", fused_adamw_ok=True)
    assert npu.compile is False and npu.fused_adamw is True
    assert device_defaults("npu", fused_adamw_ok=False).fused_adamw is False
    for d in (cuda, no_triton, cpu, npu):
        assert set(d.reasons) == {"compile", "fused_adamw", "compile_memory_budget"}


# peaks recorded by benchmarks.gpu.bench_fsdp2 on the H200 (the latest in benchmarks/results/fsdp2.md;
# the others in its git history), 16384-token micro-batches, parameters kept unsharded
RECORDED = [
    ("qwen2-1.5b", "none", 0.85, 47.99),
    ("qwen2-1.5b", "none", None, 59.55),
    ("qwen2-1.5b", "full", 0.85, 29.28),
    ("qwen3-4b", "none", 0.85, 111.6),
]


@pytest.mark.parametrize(("model", "recompute", "budget", "peak_gib"), RECORDED)
def test_estimate_matches_recorded_peaks(
    model: str, recompute: Any, budget: float | None, peak_gib: float
) -> None:
    e = estimate_memory(
        shape_of(model),
        tokens=16384,
        recompute=recompute,
        keep_unsharded=True,
        optimizer_offload=False,
        compiled=True,
        compile_memory_budget=budget,
    )
    assert abs(e.total / GiB - peak_gib) <= TOLERANCE * peak_gib, (model, e.describe(), peak_gib)


def test_estimate_parts_follow_the_settings() -> None:
    s = shape_of("qwen3-4b")
    kw: dict[str, Any] = dict(tokens=16384, compiled=True, compile_memory_budget=0.85)
    base = estimate_memory(s, recompute="none", keep_unsharded=True, optimizer_offload=False, **kw)
    assert base.master_params == 4 * s.params and base.optimizer_state == 8 * s.trainable
    off = estimate_memory(s, recompute="none", keep_unsharded=True, optimizer_offload=True, **kw)
    # offloaded: three streamed chunks, each at least the largest parameter's state (the embedding)
    streamed = 3 * max(1 << 30, 8 * s.vocab * s.hidden)
    assert off.optimizer_state == streamed < base.optimizer_state / 3
    assert off.total == base.total - base.optimizer_state + streamed
    dp4 = estimate_memory(s, recompute="none", keep_unsharded=True, optimizer_offload=False, dp=4, **kw)
    assert dp4.model_state == pytest.approx(base.model_state / 4, rel=1e-6)
    full = estimate_memory(s, recompute="full", keep_unsharded=True, optimizer_offload=False, **kw)
    assert full.activations < base.activations / 5
    act_off = estimate_memory(
        s, recompute="none", keep_unsharded=True, optimizer_offload=False, activation_offload=True, **kw
    )
    assert act_off.activations * s.layers == base.activations * 2  # two layers stay on the device
    resharded = estimate_memory(s, recompute="none", keep_unsharded=False, optimizer_offload=False, **kw)
    assert resharded.unsharded_params < base.unsharded_params / 5
    eager = estimate_memory(
        s,
        recompute="none",
        keep_unsharded=True,
        optimizer_offload=False,
        tokens=16384,
        compiled=False,
        compile_memory_budget=None,
    )
    assert eager.activations > 2 * base.activations  # the old defaults (eager) ran out of memory here
    assert eager.total > usable_bytes(H200)


@pytest.mark.parametrize(
    ("model", "device", "tokens", "expected"),
    [
        ("qwen2-1.5b", H200, 16384, ("none", True, False)),
        ("llama-3.2-1b", H200, 16384, ("none", True, False)),
        ("qwen3-4b", H200, 16384, ("none", True, False)),  # issue 23: trains with the defaults
        ("qwen3-4b", H100, 16384, ("full", False, False)),
        ("qwen3-4b", H200, 65536, ("full", True, False)),
        ("qwen3-8b", H200, 16384, ("full", True, True)),  # model state alone does not fit: offload
        ("qwen3-8b", H200, 8192, ("none", True, True)),
    ],
)
def test_memory_policy_choice(model: str, device: int, tokens: int, expected: tuple[str, bool, bool]) -> None:
    p = choose_memory_policy(
        shape_of(model), device_total=device, tokens=tokens, compiled=True, compile_memory_budget=0.85
    )
    assert (p.recompute, p.keep_unsharded, p.optimizer_offload) == expected, p.reason
    assert p.fits and p.estimate.total <= usable_bytes(device) and "usable" in p.reason
    # per-step gradient sync is opt-in: the policy keeps one reduce per micro-batch
    assert p.grad_sync == "per_micro_batch" and p.estimate.accumulated_grads == 0, p.reason


def test_per_step_grad_sync_costs_the_unsharded_gradients_beyond_one_rank() -> None:
    s = shape_of("qwen3-4b")
    kw: dict[str, Any] = dict(
        tokens=16384, recompute="none", keep_unsharded=True, optimizer_offload=False, compiled=True
    )
    kw["compile_memory_budget"] = 0.85
    for dp in (1, 8):
        per_mb = estimate_memory(s, dp=dp, **kw)
        per_step = estimate_memory(s, dp=dp, grad_sync="per_step", **kw)
        assert per_mb.accumulated_grads == 0 and per_mb.grads == 4 * s.trainable // dp
        # the fp32 unsharded gradients of the whole model (4 B per trainable parameter) in place of
        # the sharded ones until the last backward
        assert per_step.grads + per_step.accumulated_grads == 4 * s.trainable
        assert per_step.total == per_mb.total + per_step.accumulated_grads
    assert estimate_memory(s, grad_sync="per_step", **kw).accumulated_grads == 0
    host = estimate_memory(s, grad_sync="per_step", cpu_offload=True, **kw)
    assert host.grads == 0 and host.accumulated_grads == 4 * s.trainable  # sharded grads on the host
    assert "accumulated_grads" in host.describe()


def test_memory_policy_counts_per_step_sync_when_asked() -> None:
    s = shape_of("qwen3-8b")
    kw: dict[str, Any] = dict(tokens=8192, compiled=True, compile_memory_budget=0.85, dp=8)
    fixed: dict[str, Any] = dict(recompute="none", keep_unsharded=True, optimizer_offload=False)
    per_mb = estimate_memory(s, **fixed, **kw)
    per_step = estimate_memory(s, grad_sync="per_step", **fixed, **kw)
    assert per_step.accumulated_grads == 4 * s.trainable - 4 * s.trainable // 8
    # a device whose usable bytes lie between the two estimates
    usable = (per_mb.total + per_step.total) // 2
    device = int((usable + MEMORY_MARGIN_BYTES) / (1 - MEMORY_MARGIN_FRACTION)) + 1
    assert per_mb.total <= usable_bytes(device) < per_step.total
    p = choose_memory_policy(s, device_total=device, **kw)
    assert (p.recompute, p.keep_unsharded, p.optimizer_offload, p.grad_sync) == (
        "none",
        True,
        False,
        "per_micro_batch",
    ), p.reason
    assert "grad_sync=per_micro_batch" in p.reason
    roomy = choose_memory_policy(s, device_total=2 * device, **kw)
    assert (roomy.recompute, roomy.grad_sync) == ("none", "per_micro_batch"), roomy.reason  # opt-in
    # the user's per_step is kept and its unsharded gradients counted: recomputation gives way
    given = choose_memory_policy(s, device_total=device, grad_sync="per_step", **kw)
    assert given.grad_sync == "per_step" and given.fits and given.recompute == "full", given.reason


def test_memory_policy_obeys_the_user_and_reports_what_does_not_fit() -> None:
    s = shape_of("qwen3-8b")
    p = choose_memory_policy(
        s,
        device_total=H200,
        tokens=16384,
        compiled=True,
        compile_memory_budget=0.85,
        recompute="none",
        optimizer_offload=False,
        keep_unsharded=True,
    )
    assert (p.recompute, p.keep_unsharded, p.optimizer_offload) == ("none", True, False)
    assert not p.fits and "nothing fits" in p.reason
    multi_node = choose_memory_policy(
        shape_of("qwen2-1.5b"),
        device_total=H200,
        tokens=16384,
        compiled=True,
        compile_memory_budget=0.85,
        unsharded_allowed=False,
    )
    assert multi_node.keep_unsharded is False and multi_node.recompute == "none"


def test_resolve_fills_only_the_auto_fields() -> None:
    s = shape_of("qwen2-1.5b")
    kw: dict[str, Any] = dict(shape=s, device_total=H200, tokens=16384, inductor_ok=True, fused_adamw_ok=True)
    r = resolve(FSDP2Options(), device_type="cuda", recompute="auto", single_node=True, **kw)
    assert r.options == FSDP2Options(
        reshard_after_forward=False,
        fused_adamw=True,
        compile="layer",
        compile_memory_budget=0.85,
        optimizer_offload=False,
        grad_sync="per_micro_batch",
        single_device=True,
    )
    assert r.recompute == "none" and r.memory is not None and r.memory.fits
    assert set(r.reasons) == {
        "single_device",
        "compile",
        "fused_adamw",
        "compile_memory_budget",
        "reshard_after_forward",
        "optimizer_offload",
        "grad_sync",
        "recompute",
    }
    assert "memory policy" in r.reasons["grad_sync"] and "grad_sync=per_micro_batch" in r.reasons["grad_sync"]
    given = FSDP2Options(
        compile=False,
        fused_adamw=False,
        reshard_after_forward=True,
        optimizer_offload=True,
        grad_sync="per_micro_batch",
    )
    r = resolve(given, device_type="cuda", recompute="full", single_node=True, **kw)
    assert r.options == replace(given, single_device=False)  # resharded: FSDP2 at one rank too
    assert (
        r.recompute == "full"
        and r.memory is None
        and {v for k, v in r.reasons.items() if k != "single_device"} <= {"given", "not compiling"}
    )
    r = resolve(FSDP2Options(), device_type="cpu", recompute="auto", single_node=False, **kw)
    assert r.options.compile is False and r.options.reshard_after_forward is True
    assert "more than one node" in r.reasons["reshard_after_forward"]
    r = resolve(
        FSDP2Options(), device_type="cuda", recompute="auto", single_node=True, **{**kw, "inductor_ok": False}
    )
    assert r.options.compile is False and "triton" in r.reasons["compile"]


def test_compile_warmup_is_accounted_once_and_a_silent_auto_compile_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from torch._dynamo.utils import counters

    from underlay.engines.fsdp2._auto import CompileWarmup

    w = CompileWarmup()
    with caplog.at_level(logging.INFO, logger="underlay.engines.fsdp2"):
        token = w.start()
        w.stop(token, step=0, auto=True)  # the first call may compile nothing: its layers resolve kernels
        token = w.start()
        counters["stats"]["unique_graphs"] += 2  # what torch.compile counts when it compiles graphs
        w.stop(token, step=1, auto=True)
        token = w.start()
        w.stop(token, step=2, auto=True)
    counters["stats"]["unique_graphs"] -= 2
    assert w.as_dict()["steps"] == 1 and w.as_dict()["graphs"] == 2
    assert "compiled no graph" not in caplog.text and caplog.text.count("one-time warm-up") == 1
    caplog.clear()
    silent = CompileWarmup()  # nothing compiled in two calls: logged once, as a fallback to eager
    with caplog.at_level(logging.INFO, logger="underlay.engines.fsdp2"):
        for step in range(3):
            silent.stop(silent.start(), step=step, auto=True)
    assert caplog.text.count("compiled no graph") == 1 and "compile=False" in caplog.text


def test_single_device_only_at_one_rank_with_unsharded_parameters() -> None:
    """The world-size-1 path is chosen at world size 1 when the parameters stay unsharded; FSDP2 at
    more ranks, with cpu_offload, or when the memory policy reshards; a given value is kept."""
    s = shape_of("qwen2-1.5b")
    kw: dict[str, Any] = dict(shape=s, tokens=16384, inductor_ok=True, fused_adamw_ok=True, single_node=True)
    one = resolve(FSDP2Options(), device_type="cuda", recompute="auto", device_total=H200, **kw)
    assert one.options.single_device is True and "world size 1" in one.reasons["single_device"]
    two = resolve(
        FSDP2Options(), device_type="cuda", recompute="auto", device_total=H200, world_size=2, dp=2, **kw
    )
    assert two.options.single_device is False and "world size 2" in two.reasons["single_device"]
    off = resolve(
        FSDP2Options(), device_type="cuda", recompute="auto", device_total=H200, cpu_offload=True, **kw
    )
    assert off.options.single_device is False and "cpu_offload" in off.reasons["single_device"]
    small = resolve(FSDP2Options(), device_type="cuda", recompute="auto", device_total=24 * GiB, **kw)
    assert small.options.reshard_after_forward is True and small.options.single_device is False
    assert "resharded" in small.reasons["single_device"]
    # given True: the memory estimate keeps the compute copy (parameters unsharded) whatever it costs
    given = resolve(
        FSDP2Options(single_device=True), device_type="cuda", recompute="auto", device_total=24 * GiB, **kw
    )
    assert given.options.single_device is True and given.options.reshard_after_forward is False
    assert given.reasons["single_device"] == "given"
