"""prepare_model + packed_forward on tiny models of every supported architecture equal the unpatched
padded Hugging Face forward (eager attention) in log-probs, entropy, values and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.unit.models._tiny import (
    ARCHS,
    clone,
    logprob_kernel,
    padded_batch,
    reference_logprobs,
    reference_values,
    tiny_model,
)
from underlay.models import packed_forward, prepare_model
from underlay.ops.packing import pad, unpad

SEQLENS = [9, 3, 7, 1]
ATOL = 2e-5


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
def test_packed_causal_lm_matches_padded_reference(arch: str, left: bool) -> None:
    ref = tiny_model(arch)
    model = prepare_model(clone(ref), attention="eager")
    ids, mask = padded_batch(SEQLENS, 10, left=left)
    packed = unpad(ids, mask)
    temperature = 0.8
    out = packed_forward(model, packed, temperature=temperature, logprob_kernel=logprob_kernel())
    assert out.log_probs is not None and out.entropy is not None and out.values is None
    assert out.log_probs.shape == (packed.total_tokens,) and out.log_probs.dtype == torch.float32
    ref_lp, ref_ent = reference_logprobs(ref, ids, mask, temperature)
    lp, ent = pad(out.log_probs, packed), pad(out.entropy, packed)
    torch.testing.assert_close(lp.double(), ref_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=ATOL, rtol=0)
    assert ref_lp.abs().sum() > 1  # far from a trivial comparison
    # gradients of a weighted loss agree too
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (lp.double() * w).sum().backward()
    (ref_lp * w).sum().backward()
    _assert_grads_close(_grads(model), _grads(ref))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_packed_value_model_matches_padded_reference(arch: str) -> None:
    ref = tiny_model(arch, value=True)
    model = prepare_model(clone(ref), attention="eager")
    ids, mask = padded_batch(SEQLENS, 10)
    packed = unpad(ids, mask)
    out = packed_forward(model, packed)
    assert out.log_probs is None and out.values is not None
    values = pad(out.values, packed)
    expected = reference_values(ref, ids, mask)
    torch.testing.assert_close(values.double(), expected, atol=ATOL, rtol=0)
    (values.double() * expected.detach()).sum().backward()
    (expected * expected.detach()).sum().backward()
    _assert_grads_close(_grads(model), _grads(ref))


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_padded_route_matches_reference(arch: str) -> None:
    """With an attention mask the prepared model goes through kernel.padded (sliding window included)."""
    ref = tiny_model(arch)
    model = prepare_model(clone(ref), attention="eager")
    ids, mask = padded_batch([8, 5, 2], 8, left=True)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)


def test_direct_packed_call_derives_boundaries_from_position_ids() -> None:
    """Calling the prepared model itself on packed input (batch 1, restarting position ids) isolates
    the sequences, as if each ran alone."""
    ref = tiny_model("qwen3")
    model = prepare_model(clone(ref), attention="eager")
    ids, mask = padded_batch([6, 4], 6)
    packed = unpad(ids, mask)
    got = model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None]).logits[0]
    alone = torch.cat([ref(input_ids=ids[i : i + 1, :n]).logits[0] for i, n in enumerate([6, 4])])
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


def test_tied_embeddings_and_default_kernels() -> None:
    ref = tiny_model("qwen2", tie_word_embeddings=True)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    model = prepare_model(clone(ref))  # registry selection: eager/torch on cpu
    ids, mask = padded_batch([5, 7], 7)
    packed = unpad(ids, mask)
    out = packed_forward(model, packed, with_entropy=False, logprob_kernel=logprob_kernel())
    assert out.entropy is None and out.log_probs is not None
    ref_lp, _ = reference_logprobs(ref, ids, mask)
    torch.testing.assert_close(pad(out.log_probs, packed).double(), ref_lp, atol=ATOL, rtol=0)


def test_prepare_model_is_idempotent_and_keeps_parameter_names() -> None:
    ref = tiny_model("llama")
    model = clone(ref)
    names = [n for n, _ in model.named_parameters()]
    prepare_model(model, attention="eager", tiled_mlp_tiles=3)
    prepare_model(model, attention="eager", tiled_mlp_tiles=3)
    assert [n for n, _ in model.named_parameters()] == names
    assert model.config._attn_implementation == "underlay"
    ids, mask = padded_batch([6, 2, 5], 6)
    packed = unpad(ids, mask)
    out = packed_forward(model, packed, logprob_kernel=logprob_kernel())
    ref_lp, _ = reference_logprobs(ref, ids, mask)
    torch.testing.assert_close(pad(out.log_probs, packed).double(), ref_lp, atol=ATOL, rtol=0)
    prepare_model(model, attention="eager")  # tiles=None removes tiling again
    assert "forward" not in model.model.layers[0].mlp.__dict__


def test_peft_wrapped_model() -> None:
    peft = pytest.importorskip("peft")
    ref = tiny_model("llama")
    lora = peft.get_peft_model(
        clone(ref), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    prepare_model(lora, attention="eager")
    ids, mask = padded_batch([4, 6], 6)
    packed = unpad(ids, mask)
    out = packed_forward(lora, packed, logprob_kernel=logprob_kernel())
    ref_lp, _ = reference_logprobs(ref, ids, mask)  # LoRA B starts at 0: same function
    torch.testing.assert_close(pad(out.log_probs, packed).double(), ref_lp, atol=ATOL, rtol=0)
    out.log_probs.sum().backward()
    lora_grads = [p.grad for n, p in lora.named_parameters() if "lora_B" in n]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)


def test_fused_head_never_builds_vocab_logits() -> None:
    """lm_head runs the LogprobKernel in its own call: its output is per-token, never [T, vocab]."""
    model = prepare_model(tiny_model("qwen3"), attention="eager")
    seen: list[tuple[tuple[int, ...], ...]] = []
    model.lm_head.register_forward_hook(
        lambda _m, _i, out: seen.append(tuple(tuple(t.shape) for t in out if t is not None))
    )
    ids, mask = padded_batch([5, 4], 5)
    packed = unpad(ids, mask)
    packed_forward(model, packed, logprob_kernel=logprob_kernel())
    t = packed.total_tokens
    assert seen == [((t,), (t,))]


def test_peft_value_model_with_trainable_score() -> None:
    peft = pytest.importorskip("peft")
    ref = tiny_model("qwen3", value=True)
    lora = peft.get_peft_model(
        clone(ref),
        peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["score"], lora_dropout=0.0
        ),
    )
    prepare_model(lora, attention="eager")
    ids, mask = padded_batch([4, 6], 6)
    packed = unpad(ids, mask)
    out = packed_forward(lora, packed)
    assert out.values is not None
    torch.testing.assert_close(
        pad(out.values, packed).double(), reference_values(ref, ids, mask), atol=ATOL, rtol=0
    )
    out.values.sum().backward()
    score_grads = [p.grad for n, p in lora.named_parameters() if "score" in n and p.requires_grad]
    assert score_grads and all(g is not None for g in score_grads)


def test_compiled_layers_take_the_traceable_kernel_call_once_an_eager_call_resolved_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torch.compile the packed attention calls the kernel's ``traceable_varlen`` function (noted
    by the first, eager call of each layer) instead of the eager dispatch, with the same result."""
    from underlay.backends.portable.attention import TorchAttention

    calls: list[int] = []

    def offer(self: TorchAttention, spec: object) -> object:
        def traced(q, k, v, cu, max_len, causal, window, scale):  # type: ignore[no-untyped-def]
            calls.append(int(max_len))
            out = self.varlen(q, k, v, cu, cu, max_len, max_len, causal=causal, window=window, scale=scale)
            return out * torch.ones((), dtype=out.dtype)  # one more saved tensor than the eager path

        return traced

    monkeypatch.setattr(TorchAttention, "traceable_varlen", offer)
    model = prepare_model(tiny_model("llama"), attention="torch")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, mask = padded_batch(SEQLENS, 10)
    packed = unpad(ids, mask)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    # the first forward resolves the kernels (eager dispatch) and notes their offer; it is used only
    # from the next forward, so one pass and its checkpoint recomputation take one path (a switch in
    # between would make torch.utils.checkpoint see a different number of saved tensors)
    eager = packed_forward(model, packed, logprob_kernel=logprob_kernel())
    assert eager.log_probs is not None
    eager.log_probs.sum().backward()
    assert calls == []
    traced = packed_forward(model, packed, logprob_kernel=logprob_kernel())
    assert traced.log_probs is not None
    traced.log_probs.sum().backward()
    assert calls == [max(SEQLENS)] * 4  # per decoder layer: forward and recomputation
    torch.testing.assert_close(traced.log_probs, eager.log_probs, rtol=0, atol=0)
