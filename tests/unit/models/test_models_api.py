"""Boundary checks and helpers of underlay.models and the Ulysses size checks (its import cost: test_imports)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.models._tiny import clone, padded_batch, tiny_model
from underlay.interfaces import IGNORE_INDEX, ConfigError, InvalidInput, PackedBatch, UnknownBackend
from underlay.models import (
    SUPPORTED_ARCHITECTURES,
    TESTED_TRANSFORMERS,
    check_transformers_version,
    cu_seqlens_from_position_ids,
    next_token_labels,
    packed_forward,
    prepare_model,
    shift_to_tokens,
)
from underlay.ops.packing import unpad
from underlay.parallel.ulysses import validate_sp


def test_supported_architectures_and_version_range() -> None:
    for arch in ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gemma2", "deepseek_v3", "gpt_oss"):
        assert arch in SUPPORTED_ARCHITECTURES
    assert TESTED_TRANSFORMERS == (">=4.56", "<6")
    assert check_transformers_version() is True
    with pytest.warns(UserWarning, match=r"4\.40\.0"):
        assert check_transformers_version("4.40.0") is False
    with pytest.warns(UserWarning, match="tested with transformers"):
        assert check_transformers_version("6.1.0") is False


def test_capability_inspection_accepts_an_unlisted_architecture() -> None:
    """No allow-list: GPT-2 (not in the verified list) dispatches attention through the
    AttentionInterface and takes position ids, so it is accepted and its packed forward is exact."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.unit.models._tiny import VOCAB, logprob_kernel, reference_logprobs

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0)
    cfg.eos_token_id = 0
    ref = GPT2LMHeadModel(cfg).eval()
    ref.set_attn_implementation("eager")
    model = prepare_model(clone(ref), attention="eager")
    ids, mask = padded_batch([9, 3, 7], 10)
    packed = unpad(ids, mask)
    out = packed_forward(model, packed, logprob_kernel=logprob_kernel())
    assert out.log_probs is not None
    expected, _ = reference_logprobs(ref, ids, mask)
    from underlay.ops.packing import pad

    torch.testing.assert_close(pad(out.log_probs, packed).double(), expected, atol=2e-5, rtol=0)


def test_prepare_model_rejects_bad_settings() -> None:
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="tiled_mlp_tiles=0"):
        prepare_model(model, tiled_mlp_tiles=0)
    with pytest.raises(UnknownBackend, match="no_such_kernel"):
        prepare_model(model, attention="no_such_kernel")
    with pytest.raises(ConfigError, match="attention_dropout=0.1"):
        prepare_model(tiny_model("qwen3", attention_dropout=0.1))
    assert model.config._attn_implementation == "eager"  # nothing changed by the failed calls


def test_packed_forward_rejects_bad_input() -> None:
    ref = tiny_model("llama")
    ids, mask = padded_batch([4, 3], 4)
    packed = unpad(ids, mask)
    with pytest.raises(ConfigError, match="prepare_model"):
        packed_forward(ref, packed)
    model = prepare_model(clone(ref), attention="eager")
    with pytest.raises(InvalidInput, match="temperature=0"):
        packed_forward(model, packed, temperature=0.0)
    bad = PackedBatch(
        packed.input_ids,
        torch.tensor([0, 3, 5], dtype=torch.int32),
        3,
        packed.indices,
        packed.position_ids,
        2,
        4,
    )
    with pytest.raises(InvalidInput, match="end at T=7"):
        packed_forward(model, bad)
    two = prepare_model(tiny_model("llama", value=True), attention="eager")
    two.score = torch.nn.Linear(64, 2)
    with pytest.raises(ConfigError, match="num_labels=1"):
        packed_forward(two, packed)


def test_validate_sp() -> None:
    validate_sp(4, 2, 2)  # kv heads divisible by sp
    validate_sp(4, 1, 2)  # sp divisible by kv heads: kv repeated
    validate_sp(8, 2, 4)
    validate_sp(8, 8, 1)
    with pytest.raises(
        ConfigError, match=r"ulysses=3 does not divide the number of attention heads 4.*\[1, 2, 4\]"
    ):
        validate_sp(4, 2, 3)
    with pytest.raises(ConfigError, match="kv heads must divide ulysses"):
        validate_sp(6, 3, 2)
    with pytest.raises(ConfigError, match="ulysses=0"):
        validate_sp(4, 2, 0)


def test_label_and_shift_helpers() -> None:
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    assert next_token_labels(ids, cu).tolist() == [6, 7, IGNORE_INDEX, IGNORE_INDEX, 10, IGNORE_INDEX]
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], requires_grad=True)
    shifted = shift_to_tokens(x, cu)
    assert shifted.tolist() == [0.0, 1.0, 2.0, 0.0, 0.0, 5.0]
    shifted.sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    cu2, longest = cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 0, 1]]))
    assert cu2.tolist() == [0, 3, 4, 6] and cu2.dtype == torch.int32 and longest == 3
    cu3, _ = cu_seqlens_from_position_ids(torch.tensor([3, 4, 0, 1]))  # a continued first sequence
    assert cu3.tolist() == [0, 2, 4]
