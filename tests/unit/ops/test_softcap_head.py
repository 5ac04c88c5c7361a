"""The soft-capped head (Gemma 2/3's ``final_logit_softcapping``) goes through the fused log-prob kernel:
it saves for backward what the uncapped head saves (no ``[N, V]`` logits), through the kernel and
through ``packed_forward`` of a Gemma 2 model, and gives transformers' numbers."""

from __future__ import annotations

from typing import Any

import torch

from underlay import ops, registry
from underlay.models import packed_forward, prepare_model


def _saved_bytes(fn: Any) -> int:
    """Bytes of the distinct tensors autograd saves while ``fn()`` runs (storages counted once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_kernel_saves_no_logits_with_a_softcap() -> None:
    n, h, v = 256, 32, 20_000
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    kernel = registry.get_logprob_kernel("torch")
    plain = _saved_bytes(lambda: kernel(hidden, weight, labels))
    capped = _saved_bytes(lambda: kernel(hidden, weight, labels, softcap=30.0))
    assert capped == plain, (capped, plain)
    assert capped < n * v * 4 / 4  # a quarter of one fp32 [N, V] buffer; the unfused head saved three


def _gemma2(cap: float | None) -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=cap,
        attn_logit_softcapping=None,
        sliding_window=64,
        query_pre_attn_scalar=16,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(cfg).double()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # logits of tens: a cap of 30 bends them
    return model


def test_gemma2_head_is_fused_and_exact() -> None:
    ids = torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    saved = {}
    for cap in (None, 30.0):
        model = _gemma2(cap)
        ref_model = _gemma2(cap)
        ref_model.set_attn_implementation("eager")
        prepare_model(model, attention="eager")
        packed = ops.unpad(ids, mask)
        out: dict[str, Any] = {}

        def run(model: Any = model, packed: Any = packed, out: dict[str, Any] = out) -> None:
            out["r"] = packed_forward(model, packed, with_entropy=True)

        saved[cap] = _saved_bytes(run)
        lp = ops.pad(out["r"].log_probs, packed)
        with torch.no_grad():
            logits = ref_model(input_ids=ids, attention_mask=mask).logits
        lsm = torch.log_softmax(logits, -1)
        want = torch.zeros(ids.shape, dtype=torch.float64)
        want[:, 1:] = lsm[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        err = float(((lp.double() - want) * mask).abs().max())
        assert err < 1e-5, (cap, err)  # transformers' eager attention rounds its softmax to fp32
        if cap is not None:  # the reference's logits are capped: the check above can see the cap
            uncapped = ref_model.lm_head(
                ref_model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            )
            assert float((uncapped - logits).abs().max()) > 1.0
    tokens, vocab = int(mask.sum()), 4096
    assert abs(saved[30.0] - saved[None]) < tokens * vocab * 8 / 4, saved


def test_memory_estimate_counts_the_head_of_every_vocabulary() -> None:
    """``head_bytes`` (the head term of ``estimate_memory``) covers what the fused head saves for
    backward, capped or not, at every vocabulary size, grows with the vocabulary, and at a Gemma-2-2B
    shape stays far below the three fp32 ``[N, V]`` buffers the unfused soft-capped head saved."""
    from underlay.engines.fsdp2.defaults import HEAD_CHUNK_BYTES, ModelShape, head_bytes

    def shape(hidden: int, vocab: int) -> ModelShape:
        return ModelShape(hidden, 2, 2, 1, 16, 64, vocab, 10, 10, 4, 2)

    kernel = registry.get_logprob_kernel("torch")
    n = 64
    for hdim, v in ((32, 1000), (48, 7001), (16, 33_000)):
        hidden = torch.randn(n, hdim, requires_grad=True)
        weight = torch.randn(v, hdim, requires_grad=True)
        labels = torch.randint(0, v, (n,))
        per_token = head_bytes(shape(hdim, v), n) - HEAD_CHUNK_BYTES
        for cap in (None, 30.0):
            saved = _saved_bytes(lambda h=hidden, w=weight, y=labels, c=cap: kernel(h, w, y, softcap=c))
            assert saved - v * hdim * 4 <= per_token, (hdim, v, cap, saved)  # the weight is a parameter
    assert head_bytes(shape(32, 256_000), n) > head_bytes(shape(32, 32_000), n)
    n, v = 16384, 256_000
    assert head_bytes(shape(2304, v), n) < 3 * n * v * 4 / 10
