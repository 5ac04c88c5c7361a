"""Shared-prompt packing (``ops.prompt_sharing``, ``models.shared_prompts``) equals the unshared
computation in float64: log-probs, entropy, values and parameter gradients, for random GRPO mixes
(groups of 1-4 responses of different lengths, empty responses, left and right padding, a loss mask that
is 0 on the prompt), GQA and a sliding window that crosses the prompt/response boundary; the flex
attention layout equals the SDPA one; models whose attention or positions cannot be shared exactly are
refused by name."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from tests.unit.models._tiny import VOCAB, tiny_model
from underlay.engines._core import check_token_batch
from underlay.interfaces import ConfigError, InvalidInput, TokenBatch, UnsupportedOperation
from underlay.models import packed_forward, prepare_model
from underlay.models.shared_prompts import shared_prompt_forward
from underlay.ops import unpad
from underlay.ops.prompt_sharing import share_prompts, shared_prefix_attention


def _exact_norms(model: torch.nn.Module) -> None:
    """transformers' RMSNorm computes in float32 whatever the input dtype; in float64 it must not
    (otherwise both sides carry float32 rounding that their different summation orders expose)."""

    def exact(self: Any, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon"):
            mod.forward = types.MethodType(exact, mod)  # type: ignore[method-assign]


def _model(arch: str, value: bool = False, **over: Any) -> torch.nn.Module:
    """``_tiny.tiny_model`` in float64, norms and biases moved off their init values, exact norms,
    prepared for underlay."""
    model = tiny_model(arch, value=value, seed=1, **over).double()  # (eval: the value head's dropout)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    _exact_norms(model)
    prepare_model(model)
    return model


def _grpo_batch(g: torch.Generator) -> TokenBatch:
    """Random groups (1-3) of 1-4 responses (0-5 tokens) to a 1-6-token prompt; rows randomly left- or
    right-padded; loss mask on the responses only."""
    rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    groups: list[int] = []
    for gi in range(int(torch.randint(1, 4, (1,), generator=g))):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            resp = torch.randint(0, VOCAB, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g)
            rows.append((prompt, resp))
            groups.append(gi)
    width = max(len(p) + len(r) for p, r in rows) + 2
    b = len(rows)
    ids = torch.zeros(b, width, dtype=torch.long)
    attn, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        n = len(p) + len(r)
        at = int(torch.randint(0, width - n + 1, (1,), generator=g))
        ids[i, at : at + n] = torch.cat([p, r])
        attn[i, at : at + n] = 1
        loss[i, at + len(p) : at + n] = 1
    return TokenBatch(ids, attn, loss, prompt_groups=torch.tensor(groups))


def _run(
    model: torch.nn.Module, batch: TokenBatch, shared: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs (unshared token order) and parameter gradients of a loss weighting every output by the
    loss mask times fixed random weights."""
    packed = unpad(batch.input_ids, batch.attention_mask)
    model.zero_grad()
    if shared:
        assert batch.prompt_groups is not None
        out = shared_prompt_forward(
            model, share_prompts(batch.input_ids, batch.attention_mask, batch.prompt_groups)
        )
    else:
        out = packed_forward(model, packed)
    weights = batch.loss_mask.reshape(-1)[packed.indices].double()
    weights = weights * torch.linspace(-1.0, 2.0, weights.numel(), dtype=torch.float64)
    fields = {k: getattr(out, k) for k in ("log_probs", "entropy", "values") if getattr(out, k) is not None}
    total = sum((t.double() * weights).sum() for t in fields.values())
    assert isinstance(total, torch.Tensor)
    total.backward()  # type: ignore[no-untyped-call]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in fields.items()}, grads


def _err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max() / (1.0 + b[k].abs().max())) for k in a)


@pytest.mark.parametrize(
    "arch,value,over",
    [
        ("llama", False, {}),
        ("mistral", False, {"sliding_window": 3}),  # the window crosses the prompt boundary
        ("qwen2", True, {}),
    ],
)
def test_shared_prompts_equal_unshared_in_float64(arch: str, value: bool, over: dict[str, Any]) -> None:
    model = _model(arch, value, **over)
    g = torch.Generator().manual_seed(7)
    computed = unshared = 0
    for _ in range(3):
        batch = _grpo_batch(g)
        shared = share_prompts(batch.input_ids, batch.attention_mask, batch.prompt_groups)  # type: ignore[arg-type]
        computed += shared.total_tokens
        unshared += shared.packed.total_tokens
        out_s, grad_s = _run(model, batch, shared=True)
        out_u, grad_u = _run(model, batch, shared=False)
        assert _err(out_s, out_u) < 1e-12, _err(out_s, out_u)
        assert _err(grad_s, grad_u) < 1e-12, _err(grad_s, grad_u)
    assert computed < unshared  # prompts were shared


def test_flex_layout_equals_sdpa_layout() -> None:
    g = torch.Generator().manual_seed(3)
    batch = _grpo_batch(g)
    layout = share_prompts(batch.input_ids, batch.attention_mask, batch.prompt_groups)  # type: ignore[arg-type]
    n = layout.total_tokens
    q = torch.randn(n, 4, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(n, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))
    for window in (None, (2, 0)):
        a = shared_prefix_attention(q, k, v, layout, window=window, impl="sdpa")
        b = shared_prefix_attention(q, k, v, layout, window=window, impl="flex")  # (no cpu backward)
        assert float((a - b).abs().max()) < 1e-12
        again = shared_prefix_attention(q, k, v, layout, window=window, impl="flex")  # cached block mask
        assert torch.equal(again, b)
    assert sorted(layout.calls.block_masks) == [("cpu", -1), ("cpu", 2)]  # one per window, reused


def test_refusals_name_the_cause() -> None:
    g = torch.Generator().manual_seed(5)
    batch = _grpo_batch(g)
    groups = batch.prompt_groups
    assert groups is not None
    layout = share_prompts(batch.input_ids, batch.attention_mask, groups)
    with pytest.raises(UnsupportedOperation, match="attention logit softcapping"):
        shared_prompt_forward(_model("gemma2"), layout)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="length-dependent rotary"):
        shared_prompt_forward(_model("llama", rope_parameters=dynamic), layout)
    with pytest.raises(InvalidInput, match="does not compute shared prompts"):
        check_token_batch(batch, VOCAB)  # an engine that does not share (mcore)
    with pytest.raises(InvalidInput, match=r"prompt_groups must be an integer tensor \[B="):
        TokenBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, prompt_groups=groups.double())
    assert torch.equal(batch.select([1, 0]).prompt_groups, groups[[1, 0]])  # type: ignore[arg-type]
