"""The process-wide compiled ``flex_attention`` (``underlay.ops.flex``) compiles under its own dynamo
settings, whatever the caller's.

On the GPU, a flex call from the eager attention of a layer compiled with ``torch.compile(dynamic=True)``
(the fsdp2 engine's layers under full recompute) compiled all-dynamic (that compile keeps
``assume_static_by_default=False`` for its whole call, eager regions included) and failed in flex's
autograd. The mechanism is device-independent and checked here on the CPU (forward only: torch has no
CPU backward for flex), with the caller set up as the engine's compile scope is (``suppress_errors``
on, ``activation_memory_budget`` 0.85, a layer compiled with ``dynamic=True``): a recording backend
sees every graph the flex function compiles and the dynamo settings it was compiled under (default
shape handling, errors and an exhausted recompile limit raised, memory budget 1.0); no graph has a
symbolic head count or head dim; the outputs equal eager flex; the caller's settings are back
afterwards. Negative control: a plain ``torch.compile(flex_attention)`` compiles under the caller's
settings. (On the CPU flex's shape checks specialise every size, so the symbolic head dim itself is a
GPU-only symptom: ``tests/gpu/test_flex_attention_cuda.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from underlay.backends.portable.flex_attention import _varlen_block_mask
from underlay.ops.flex import _isolated, softcap_score_mod

_SETTINGS = (
    "assume_static_by_default",
    "automatic_dynamic_shapes",
    "suppress_errors",
    "fail_on_recompile_limit_hit",
    "recompile_limit",
    "specialize_float",
)
_FLEX_OWN = {
    "assume_static_by_default": True,
    "automatic_dynamic_shapes": True,
    "suppress_errors": False,
    "fail_on_recompile_limit_hit": True,
    "recompile_limit": 64,
    "specialize_float": True,
    "activation_memory_budget": 1.0,
}


class _Recorder:
    """A dynamo backend that notes, per compiled graph, the settings it was compiled under and which
    dims of its 4-D inputs are symbolic."""

    def __init__(self) -> None:
        self.graphs: list[list[tuple[bool, ...]]] = []
        self.settings: list[dict[str, Any]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        import torch._dynamo.config as dynamo_config
        import torch._functorch.config as functorch_config

        dims = [
            tuple(not isinstance(s, int) for s in x.shape)
            for x in example_inputs
            if isinstance(x, torch.Tensor) and x.dim() == 4
        ]
        self.graphs.append(dims)
        found = {k: getattr(dynamo_config, k) for k in _SETTINGS}
        found["activation_memory_budget"] = functorch_config.activation_memory_budget
        self.settings.append(found)
        return gm.forward


def _layouts() -> list[tuple[tuple[int, ...], int, int]]:
    """(sequence lengths, heads, head dim): lengths change every call, the head shape once."""
    return [
        ((100, 50), 4, 16),
        ((120, 80), 4, 16),
        ((60, 70, 40), 4, 16),
        ((90, 33), 2, 32),
        ((50, 150), 2, 32),
    ]


def _run(fn: Callable[..., torch.Tensor]) -> list[float]:
    """Each layout through ``fn`` from the eager attention of a layer compiled with ``dynamic=True``,
    under the engine's compile scope; the max difference to eager flex per layout."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    with (
        dynamo_config.patch(suppress_errors=True),
        functorch_config.patch(activation_memory_budget=0.85),
    ):
        return _run_layouts(fn)


def _run_layouts(fn: Callable[..., torch.Tensor]) -> list[float]:

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Any) -> torch.Tensor:
        return fn(q, k, v, score_mod=softcap_score_mod(50.0), block_mask=block, enable_gqa=True)

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Any) -> torch.Tensor:
        return attention(q * 1.0, k, v, block) + 0.0

    compiled_layer = torch.compile(layer, dynamic=True, backend="eager")
    diffs = []
    gen = torch.Generator().manual_seed(0)
    for lens, heads, dim in _layouts():
        total = sum(lens)
        q = torch.randn(1, 2 * heads, total, dim, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(1, heads, total, dim, generator=gen, dtype=torch.float64) for _ in range(2))
        block = _varlen_block_mask(lens, lens, -1, 0, torch.device("cpu"))
        got = compiled_layer(q, k, v, block)
        want = flex_attention(q, k, v, score_mod=softcap_score_mod(50.0), block_mask=block, enable_gqa=True)
        diffs.append(float((got - want).abs().max()))
    return diffs


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_flex_compiles_under_its_own_settings_below_a_dynamic_caller() -> None:
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    recorder = _Recorder()
    before = ({k: getattr(dynamo_config, k) for k in _SETTINGS}, functorch_config.activation_memory_budget)
    diffs = _run(_isolated(torch.compile(flex_attention, backend=recorder)))
    assert max(diffs) <= 1e-12, diffs
    assert recorder.settings and all(got == _FLEX_OWN for got in recorder.settings), recorder.settings
    for g in recorder.graphs:  # [B, H, S, D] inputs: H (1) and D (3) never symbolic
        assert not any(d[1] or d[3] for d in g), recorder.graphs
    after = ({k: getattr(dynamo_config, k) for k in _SETTINGS}, functorch_config.activation_memory_budget)
    assert after == before


def test_plain_compile_takes_the_callers_settings() -> None:
    """The negative control: without the wrapper the dynamic layer's and the engine scope's settings
    reach flex's compile."""
    recorder = _Recorder()
    _run(torch.compile(flex_attention, backend=recorder))
    assert recorder.settings, recorder.settings
    for got in recorder.settings:
        assert got["assume_static_by_default"] is False and got["suppress_errors"] is True, got
        assert got["activation_memory_budget"] == 0.85, got


def _dense_causal_softcap(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: tuple[int, ...], cap: float, scale: float
) -> torch.Tensor:
    """Packed causal attention with a softcap, dense in float64: the reference for flex's gradients (torch's
    own uncompiled flex compiles under dynamo's defaults, so it cannot be the reference here)."""
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.arange(doc.numel())
    keep = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    scores = cap * torch.tanh(q @ k.transpose(-1, -2) * scale / cap)
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def test_a_new_softcap_or_scale_recompiles_flex_whole_with_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Floats specialised: a process that calls flex with a second softcap or scale (two models, or the
    conformance cases before a model) compiles flex again with the new constants. Under dynamo's default
    the changed float became a tensor input: the softcap's closure float needed ``.item()`` inside flex's
    score function, the flex call broke out of the graph and ran flex's eager path under dynamo (on the
    GPU's torch 2.11: ``AssertionError: all unwrapped values must be FakeTensor``; on 2.13 the slow
    eager path). Gradients need flex's backward, which torch runs on the CPU only through a compiled
    graph's eager fallback: the CPU guard is lifted for this test; the recording backend runs the graph
    eagerly. (Negative control, run once: without ``specialize_float`` the second call breaks the graph
    at flex's higher-order op.)"""
    import torch.nn.attention.flex_attention as flex_module
    from torch._dynamo.utils import counters

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    counters.clear()
    hop_graphs: list[bool] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        hop_graphs.append(any("flex_attention" in str(n.target).lower() for n in gm.graph.nodes))
        return gm.forward

    fn = _isolated(torch.compile(flex_attention, backend=backend))
    gen = torch.Generator().manual_seed(0)
    for i, (cap, scale) in enumerate([(30.0, 0.25), (50.0, 0.25), (50.0, 0.2), (20.0, 0.3)]):
        lens = (40 + 30 * i, 70)
        total = sum(lens)
        q, k, v = (
            torch.randn(1, 2, total, 16, generator=gen, dtype=torch.float64).requires_grad_(True)
            for _ in range(3)
        )
        block = _varlen_block_mask(lens, lens, -1, 0, torch.device("cpu"))
        args = {"score_mod": softcap_score_mod(cap), "block_mask": block, "scale": scale}
        out = fn(q, k, v, **args)
        got = torch.autograd.grad(out.square().sum(), (q, k, v))
        want_out = _dense_causal_softcap(q, k, v, lens, cap, scale)
        want = torch.autograd.grad(want_out.square().sum(), (q, k, v))
        assert float((out - want_out).abs().max()) <= 1e-12, (cap, scale)
        for g, w in zip(got, want):
            assert float((g - w).abs().max()) <= 1e-10, (cap, scale)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(hop_graphs) == 4 and all(hop_graphs), hop_graphs


def test_flex_runs_its_main_kernel_at_every_query_length() -> None:
    """The compiled flex is called with ``kernel_options`` that keep inductor on flex's main Triton
    kernel (below 128 queries it otherwise lowers to its decoding kernel, which found no valid
    configuration for a short packed stream on the GPU), merged under the caller's own options, and the
    caller's dict is not modified."""
    seen: list[dict[str, Any]] = []

    def fake_compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen.append(dict(kwargs["kernel_options"]))
        return q

    call = _isolated(fake_compiled)
    q = torch.zeros(1, 2, 5, 16)
    call(q, q, q)
    own = {"WRITE_DQ": False}
    call(q, q, q, kernel_options=own)
    call(q, q, q, kernel_options={"BACKEND": "AUTO"})
    assert seen == [{"BACKEND": "TRITON"}, {"BACKEND": "TRITON", "WRITE_DQ": False}, {"BACKEND": "AUTO"}]
    assert own == {"WRITE_DQ": False}


def test_a_torch_without_the_backend_option_gets_the_older_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch releases before ``BACKEND`` (and before ``FlexKernelOptions``: 2.6, 2.7) take
    ``FORCE_USE_FLEX_ATTENTION`` for the same choice."""
    import torch.nn.attention.flex_attention as flex_module

    from underlay.ops.flex import _main_kernel

    assert _main_kernel() == {"BACKEND": "TRITON"}
    monkeypatch.delattr(flex_module, "FlexKernelOptions")
    assert _main_kernel() == {"FORCE_USE_FLEX_ATTENTION": True}
