"""The ``flex`` attention kernel on cuda: soft-capped, windowed attention (Gemma 2) runs fused by default.

- ``auto`` picks ``flex`` for Gemma 2's softcap (flash-attn 2 where installed, which takes softcaps
  itself) and ``torch`` for a plain or windowed case; the fsdp2 memory estimate of the Gemma-2-2B shape
  at the defaults books no ``[S, S]`` attention scores.
- At the Gemma-2-2B attention shape (8 heads, 4 kv heads, head dim 256, softcap 50, window 4096) on
  mixed packed lengths up to 4096, bf16 flex output and q/k/v gradients match the float64 eager
  reference within bf16 tolerance, with a fraction of eager's peak memory.
- A tiny Gemma 2 model (windows of 16 tokens, softcaps) through ``prepare_model`` + ``packed_forward``
  in bf16: log-probs and parameter gradients with ``flex`` are as close to the fp32 reference as the
  bf16 ``eager`` kernel's (forward + backward), and every attention layer ran on ``flex``.
- As the fsdp2 engine drives it (``tests/gpu/_flex_layouts.py``: a new packed layout per call, gradients,
  eager non-reentrant checkpointing, the settings a layer compiled with ``dynamic=True`` leaves on): 12
  layouts compile at most 4 graphs, and one process runs several head shapes.

Run on the GPU host: ``bash scripts/test_gpu.sh -k flex``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from underlay import registry
from underlay.backends.portable.attention import EagerAttention
from underlay.interfaces import AttentionSpec

pytestmark = pytest.mark.gpu

_CUDA = torch.device("cuda")


def _gemma2_spec(**kw: Any) -> AttentionSpec:
    base: dict[str, Any] = dict(
        dtype=torch.bfloat16, head_dim=256, num_heads=8, num_kv_heads=4, device_type="cuda", softcap=50.0
    )
    base.update(kw)
    return AttentionSpec(**base)


def _softcap_kernel() -> str:
    """The kernel ``auto`` picks for a softcap: flex, unless flash-attn 2 (which has one) is installed."""
    return "flash_attn" if registry.probe("attention", "flash_attn").available else "flex"


def test_auto_picks_flex_for_softcaps_and_torch_otherwise() -> None:
    assert registry.get_attention("flex", spec=_gemma2_spec()).name == "flex"
    assert registry.get_attention(spec=_gemma2_spec()).name == _softcap_kernel()
    assert registry.get_attention(spec=_gemma2_spec(window=(4095, 0))).name == _softcap_kernel()
    plain = registry.get_attention(spec=_gemma2_spec(softcap=None)).name
    assert plain not in ("flex", "eager"), plain
    windowed = registry.get_attention(spec=_gemma2_spec(softcap=None, window=(4095, 0))).name
    assert windowed not in ("flex", "eager"), windowed


def test_gemma2_2b_memory_estimate_books_no_eager_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Gemma2Config

    from underlay.engines.fsdp2 import _build
    from underlay.engines.fsdp2._auto import model_shape
    from underlay.interfaces import ModelConfig

    monkeypatch.delenv("UNDERLAY_ATTENTION", raising=False)  # the defaults
    cfg = Gemma2Config(attention_dropout=0.0)  # the 2B shape
    model = _build.build_model(ModelConfig(hf_config=cfg), cfg, meta=True)
    assert model_shape(model, cfg, device_type="cuda").eager_attention_layers == 0


def _rel(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    g, r = got.double(), ref.double()
    err = (g - r).abs().max().item() / max(r.abs().max().item(), 1e-30)
    l2 = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
    return err, l2


def _peak_of(fn: Any) -> tuple[int, Any]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def test_gemma2_2b_attention_shape_matches_eager_fp64() -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [1, 4096, 17, 1500, 3000, 777, 2048]
    total, hq, hk, d = sum(lens), 8, 4, 256
    q, k, v = (
        (torch.randn(total, h, d, generator=gen, dtype=torch.float64) * 2).to(_CUDA, torch.bfloat16)
        for h in (hq, hk, hk)
    )
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=_CUDA)
    dout = torch.randn(total, hq, d, generator=gen, dtype=torch.float64).to(_CUDA, torch.bfloat16)
    opts: dict[str, Any] = {"causal": True, "window": (4095, 0), "scale": 224**-0.5, "softcap": 50.0}
    flex = registry.get_attention("flex")

    def run(kernel: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xs = tuple(x.detach().requires_grad_(True) for x in xs)
        out = kernel.varlen(*xs, cu, cu, max(lens), max(lens), **opts)
        grads = torch.autograd.grad(out, xs, grad_outputs=dout.to(out.dtype))  # (no fp64 copies)
        return (out.detach(), *grads)

    run(flex, q, k, v)  # compile once, outside the measurement
    flex_peak, got = _peak_of(lambda: run(flex, q, k, v))
    eager = EagerAttention(registry.get_device())
    eager_peak, _ = _peak_of(lambda: run(eager, q, k, v))
    want = run(eager, q.double(), k.double(), v.double())
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
        err, l2 = _rel(g, r)
        assert err <= 4e-2 and l2 <= 2e-2, f"{name}: max rel {err:.3g}, l2 {l2:.3g}"
    assert flex_peak * 4 < eager_peak, (flex_peak, eager_peak)


def test_gemma2_tiny_model_flex_vs_eager_bf16() -> None:
    from tests.gpu.test_models_bf16_cuda import batch, build, cosine, errs, flat_grad
    from underlay.models import packed_forward, prepare_model
    from underlay.models.attention import ROUTE_ATTR
    from underlay.ops.packing import pad, unpad

    ref = build("gemma2", False, False, _CUDA)  # fp32, windows of 16, attention + final softcaps
    ids, mask = batch(False, _CUDA, ref.config.vocab_size)
    keep = mask.bool()
    packed = unpad(ids, mask)
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)).to(_CUDA)

    def run(
        model: torch.nn.Module, attention: str | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module]:
        ours = prepare_model(model, attention=attention)
        ours.zero_grad(set_to_none=True)
        out = packed_forward(ours, packed)
        assert out.log_probs is not None
        lp = pad(out.log_probs, packed)
        (lp * w).sum().backward()
        return lp.detach(), flat_grad(ours), ours

    ref_lp, ref_g, _ = run(copy.deepcopy(ref), "eager")
    eager_lp, eager_g, _ = run(copy.deepcopy(ref).to(torch.bfloat16), "eager")
    flex_lp, flex_g, flex_model = run(copy.deepcopy(ref).to(torch.bfloat16), "flex")

    names = {
        k.name
        for m in flex_model.modules()
        if (route := getattr(m, ROUTE_ATTR, None)) is not None
        for k in route._kernels.values()
    }
    assert names == {"flex"}, names
    flex_max, flex_mean = errs(flex_lp, ref_lp, keep)
    eager_max, eager_mean = errs(eager_lp, ref_lp, keep)
    assert flex_mean <= 1.5 * eager_mean + 2e-3, (flex_mean, eager_mean)
    assert flex_max <= 1.5 * eager_max + 2e-2, (flex_max, eager_max)
    assert cosine(flex_g, ref_g) >= 0.99 and cosine(flex_g, ref_g) >= cosine(eager_g, ref_g) - 0.01


def test_many_packed_layouts_with_gradients_under_checkpoint() -> None:
    """The engine's use: a new packed layout every micro-batch (here 12, more than dynamo's recompile
    limit of 8), gradients, each call under eager non-reentrant checkpointing. Every layout runs, and
    the compiled flex function does not compile a graph per layout."""
    from tests.gpu._flex_layouts import random_layouts, run_layouts

    res = run_layouts(random_layouts(12, seed=1))
    assert res["error"] is None and res["ran"] == 12, res
    assert res["graphs"] <= 4, res


def test_short_packed_streams_after_long_ones() -> None:
    """Packed streams shorter than 128 tokens (where inductor would pick flex's decoding kernel, which
    found no valid configuration once the length was symbolic) run with gradients after long ones in
    the same process, down to a single token."""
    from tests.gpu._flex_layouts import run_layouts

    layouts = [(2000, 300), (1500, 700), (92,), (2500,), (5, 7), (1,), (1800, 40), (127,), (64, 64)]
    res = run_layouts(layouts)
    assert res["error"] is None and res["ran"] == len(layouts), res


def test_one_process_runs_flex_at_several_head_shapes() -> None:
    """Head count and head dim stay static in the process-wide compiled flex: after layouts at one head
    shape, another head shape (and the first again) still compiles and runs with gradients, under the
    engine's settings (automatic dynamic shapes would otherwise make the head dim symbolic)."""
    from tests.gpu._flex_layouts import random_layouts, run_layouts

    for heads, dim in (((4, 2), 64), ((8, 4), 256), ((4, 2), 64)):
        res = run_layouts(random_layouts(3, seed=dim, max_len=1500), heads=heads, dim=dim)
        assert res["error"] is None and res["ran"] == 3, (heads, dim, res)
