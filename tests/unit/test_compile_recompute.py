"""``compile="layer"`` with ``recompute="full"``: the recomputation in backward must run the graph the
forward ran (issue 23; the H200 failed with ``CheckpointError`` on Qwen2.5-VL).

The GPU's failure needs two things the CPU does not have by itself, both reproduced here:

- transformers <= 5.17 (the GPU host's) checkpoints a decoder layer around ``Module.__call__``, so a
  compiled layer forward ran inside an eager ``torch.utils.checkpoint`` and the recomputation called it
  again; newer transformers checkpoint inside the class forward. :func:`_old_transformers_checkpointing`
  restores the old structure for a test.
- on CUDA the recomputation runs on the autograd engine's device thread, whose dynamo guard state can
  differ from the main thread's (the intra-op thread count is one of dynamo's global-state guards); a
  failing guard recompiles there, outside the engine's ``compile_memory_budget``, and the new graph can
  save other tensors. The tests change the thread count between forward and backward: the same guard
  failure on the one CPU thread.

The structural guarantee checked: no graph is compiled (nor looked up) while autograd runs the backward,
the layers do compile whole (one checkpointed region each), and the gradients equal the eager,
non-recomputed model's. A kernel offering a traceable varlen call keeps the attention inside the
compiled layer, as CUDA's ``varlen_attn`` does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests._dynamo import dynamo_report
from tests.unit.models._tiny import clone, logprob_kernel, padded_batch, tiny_model, tiny_vl_model, vl_batch
from underlay.engines.fsdp2.parallelize import apply_activation_checkpointing, compile_layer_parts
from underlay.models import packed_forward, prepare_model
from underlay.ops import unpad

pytestmark = pytest.mark.slow  # two tiny models compiled whole (aot_eager): about 40 s each on 2 loaded cores


def _traced_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: Any,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float | None,
) -> torch.Tensor:
    """Packed attention ``[T, H, D]`` with the sequence boundaries ``cu`` read in-graph (a block-diagonal
    mask over SDPA; no host read, so dynamo keeps it inside the layer's graph like CUDA's varlen_attn)."""
    pos = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu[1:].to(torch.int64), pos, right=True)
    keep = seq[:, None] == seq[None, :]
    if causal:
        keep = keep & (pos[:, None] >= pos[None, :])
    assert window is None
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=keep, scale=scale
    )
    return out.transpose(0, 1)


@contextlib.contextmanager
def _old_transformers_checkpointing() -> Iterator[None]:
    """transformers <= 5.17's ``GradientCheckpointingLayer``: checkpoint ``Module.__call__`` (hooks and
    the instance ``forward`` included) instead of the class forward."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.gradient_checkpointing and self.training:
            body = functools.partial(torch.nn.Module.__call__, self, **kwargs)
            return self._gradient_checkpointing_func(body, *args)
        return torch.nn.Module.__call__(self, *args, **kwargs)

    def unwrap(cls: type) -> dict[type, Any]:
        saved = {}
        for sub in cls.__subclasses__():
            inner = getattr(sub.__dict__.get("forward"), "__wrapped__", None)
            if inner is not None:
                saved[sub] = sub.__dict__["forward"]
                sub.forward = inner  # type: ignore[attr-defined]
            saved.update(unwrap(sub))
        return saved

    wrapped = unwrap(GradientCheckpointingLayer)
    GradientCheckpointingLayer.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        del GradientCheckpointingLayer.__call__
        for sub, forward in wrapped.items():
            sub.forward = forward  # type: ignore[attr-defined]


@pytest.fixture
def traceable_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    from underlay.backends.portable.attention import TorchAttention

    monkeypatch.setattr(TorchAttention, "traceable_varlen", lambda self, spec: _traced_block_attention)


def _recording_backend(graphs: list[tuple[bool, bool]]) -> Any:
    def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        region = any("checkpoint" in str(node.target) for node in gm.graph.nodes)
        graphs.append((region, torch._C._current_graph_task_id() != -1))  # (whole layer, in backward)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    return backend


def _train(
    model: torch.nn.Module, batches: list[tuple[Any, Any]], flip_threads: bool
) -> dict[str, torch.Tensor]:
    model.train()
    threads = torch.get_num_threads()
    try:
        for packed, mm in batches:
            out = packed_forward(model, packed, logprob_kernel=logprob_kernel(), multimodal=mm)
            assert out.log_probs is not None
            loss = (out.log_probs * torch.linspace(-1, 1, out.log_probs.numel())).sum()
            # the backward sees another dynamo global state than the forward; the forwards all see the
            # same one, so the layers compile once and any lookup in a backward fails its guard
            if flip_threads:
                torch.set_num_threads(threads + 1)
            loss.backward()
            torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(model: torch.nn.Module, batches: list[tuple[Any, Any]], old_structure: bool) -> None:
    ref = clone(model)
    prepare_model(model, attention="torch")
    prepare_model(ref, attention="torch")
    graphs: list[tuple[bool, bool]] = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with _old_transformers_checkpointing() if old_structure else contextlib.nullcontext():
        apply_activation_checkpointing(model, "full")
        compile_layer_parts(model, backend=_recording_backend(graphs), scope="layer", dynamic=True)
        grads = _train(model, batches, flip_threads=True)
    expected = _train(ref, batches, flip_threads=False)
    assert not any(in_backward for _, in_backward in graphs), graphs
    # the layers compiled whole (checkpointed region)
    assert any(region for region, _ in graphs), (graphs, dynamo_report())
    assert grads.keys() == expected.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name], rtol=1e-9, atol=1e-9, msg=name)


def test_compiled_recomputed_text_layers_never_compile_in_backward(traceable_attention: None) -> None:
    """Ten micro-batches of distinct token counts (more than dynamo's recompile limit)."""
    batches = []
    for n in range(10):
        ids, mask = padded_batch([3 + n, 2 + (n % 3)], 3 + n)
        batches.append((unpad(ids, mask), None))
    _check(tiny_model("llama").double(), batches, old_structure=True)


def test_compiled_recomputed_vision_language_layers_never_compile_in_backward(
    traceable_attention: None,
) -> None:
    """Qwen2.5-VL with images in some micro-batches (3-D rotary positions), old transformers structure."""
    ids, mask, mm = vl_batch()
    with_images = (
        unpad(ids[:2], mask[:2]),
        {k: v.double() if v.is_floating_point() else v for k, v in mm.items()},
    )
    text = unpad(ids[2:], mask[2:])
    batches = [with_images, (text, None), with_images]
    _check(tiny_vl_model("qwen2_5_vl").double(), batches, old_structure=True)
