"""Shared-prompt attention on cuda, where it runs ``flex_attention`` compiled (the cpu tests cover the
eager SDPA path and the eager flex forward): forward and backward of the compiled flex path equal the
per-group SDPA path in fp32 and a float64 reference within bf16 rounding, with and without a sliding
window, on a GRPO layout of prompts longer than flex's 128-token blocks; and a tiny Qwen3's log-probs
and gradients through ``shared_prompt_forward`` on cuda equal ``packed_forward`` of the unshared batch.

Run on the GPU host: ``bash scripts/test_gpu.sh -k shared_prompts``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from underlay.interfaces import TokenBatch

pytestmark = pytest.mark.gpu


def _batch(
    g: torch.Generator, vocab: int, prompts: tuple[int, ...], n: int, resp: tuple[int, int]
) -> TokenBatch:
    rows: list[torch.Tensor] = []
    groups: list[int] = []
    for gi, p in enumerate(prompts):
        prompt = torch.randint(0, vocab, (p,), generator=g)
        for _ in range(n):
            r = int(torch.randint(resp[0], resp[1] + 1, (1,), generator=g))
            rows.append(torch.cat([prompt, torch.randint(0, vocab, (r,), generator=g)]))
            groups.append(gi)
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        attn[i, : len(r)] = 1
    return TokenBatch(ids, attn, attn.clone(), prompt_groups=torch.tensor(groups))


def _attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Any, impl: str, window: Any) -> Any:
    from underlay.ops.prompt_sharing import shared_prefix_attention

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = shared_prefix_attention(q, k, v, layout, window=window, impl=impl)  # type: ignore[arg-type]
    out.backward(torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out))
    return [out.detach(), q.grad, k.grad, v.grad]


def _err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max() / y.double().abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("window", [None, (96, 0)])
def test_compiled_flex_equals_sdpa_forward_and_backward(window: Any) -> None:
    from underlay.ops.prompt_sharing import share_prompts

    g = torch.Generator().manual_seed(0)
    batch = _batch(g, 1000, prompts=(300, 170), n=4, resp=(20, 200)).to(torch.device("cuda"))
    layout = share_prompts(batch.input_ids, batch.attention_mask, batch.prompt_groups)  # type: ignore[arg-type]
    n = layout.total_tokens
    q = torch.randn(n, 8, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    k, v = (torch.randn(n, 2, 64, device="cuda") for _ in range(2))
    ref = _attn(q.double(), k.double(), v.double(), layout, "sdpa", window)
    sdpa = _attn(q, k, v, layout, "sdpa", window)
    flex = _attn(q, k, v, layout, "flex", window)
    assert _err(flex, sdpa) < 1e-4 and _err(flex, ref) < 1e-4, (_err(flex, sdpa), _err(flex, ref))
    flex16 = _attn(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout, "flex", window)
    assert _err(flex16, ref) < 3e-2, _err(flex16, ref)


def test_shared_prompt_forward_on_cuda_equals_packed_forward() -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from underlay.models import packed_forward, prepare_model
    from underlay.models.shared_prompts import shared_prompt_forward
    from underlay.ops import unpad
    from underlay.ops.prompt_sharing import share_prompts

    cfg = Qwen3Config(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).cuda().float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() == 2 else p.add_(0.1 * torch.randn_like(p))
    prepare_model(model)
    g = torch.Generator().manual_seed(2)
    batch = _batch(g, 1000, prompts=(260, 140, 33), n=3, resp=(1, 150)).to(torch.device("cuda"))
    runs = []
    for shared in (True, False):
        model.zero_grad()
        if shared:
            layout = share_prompts(batch.input_ids, batch.attention_mask, batch.prompt_groups)  # type: ignore[arg-type]
            out = shared_prompt_forward(model, layout)
        else:
            out = packed_forward(model, unpad(batch.input_ids, batch.attention_mask))
        assert out.log_probs is not None and out.entropy is not None
        w = torch.linspace(-1, 2, out.log_probs.numel(), device="cuda")
        ((out.log_probs * w).sum() + (out.entropy * w).sum()).backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        runs.append([out.log_probs.detach(), out.entropy.detach(), *grads])
    assert len(runs[0]) == len(runs[1]) > 2
    assert _err(runs[0], runs[1]) < 1e-4, _err(runs[0], runs[1])
