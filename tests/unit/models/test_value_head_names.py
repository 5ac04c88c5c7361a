"""Value models whose token-classification head is named ``classifier`` (GPT-2, GPT-BigCode, GPT-NeoX,
Falcon) run through ``packed_forward`` exactly as transformers' own ``*ForTokenClassification``
forward: per-token values and gradients in float64; a model with both a ``score`` and a ``classifier``
head is refused as ambiguous."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import torch
from torch import nn

from underlay.interfaces import ConfigError

FAMILIES = ["gpt2", "gpt_bigcode", "gpt_neox", "falcon"]


def _value_model(model_type: str) -> nn.Module:
    """The matrix's tiny config of ``model_type`` as a float64 token-classification model with one
    label, weights moved off their init."""
    from transformers import AutoModelForTokenClassification

    from underlay.models import coverage

    cfg = coverage.tiny_config(model_type)
    cfg.num_labels = 1
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(cfg, attn_implementation="eager").double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 9), generator=g)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for i, n in enumerate((9, 4, 6)):
        mask[i, :n] = 1
    return ids * mask, mask


@pytest.mark.parametrize("model_type", FAMILIES)
def test_classifier_head_equals_transformers(model_type: str) -> None:
    from underlay.models import prepare_model
    from underlay.models.forward import packed_forward
    from underlay.ops import pad, unpad

    ref = _value_model(model_type)
    assert isinstance(ref.classifier, nn.Linear) and getattr(ref, "score", None) is None
    mine = prepare_model(copy.deepcopy(ref), attention="eager")
    ids, mask = _batch(ref.config.vocab_size)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0] * mask
    packed = unpad(ids, mask)
    out = packed_forward(mine, packed)
    assert out.values is not None and out.log_probs is None
    got = pad(out.values, packed)
    # packed_forward returns fp32 values: compare at fp32 resolution of the float64 reference
    scale = float(want.abs().max())
    assert float((got.double() - want).abs().max()) <= 1e-6 * max(scale, 1.0), (got, want)
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * mask
    (want * w).sum().backward()
    (got.double() * w).sum().backward()
    grads = dict(mine.named_parameters())
    for name, p in ref.named_parameters():
        assert p.grad is not None and grads[name].grad is not None, name
        tol = 1e-5 * max(float(p.grad.abs().max()), 1.0)
        assert float((p.grad - grads[name].grad).abs().max()) <= tol, name


def test_score_and_classifier_together_are_ambiguous() -> None:
    from underlay.models import prepare_model
    from underlay.models.forward import packed_forward
    from underlay.ops import unpad

    ref = _value_model("gpt2")
    ref.score = nn.Linear(ref.config.hidden_size, 1).double()
    mine = prepare_model(ref, attention="eager")
    ids, mask = _batch(ref.config.vocab_size)
    with pytest.raises(ConfigError, match="both a 'score' and a 'classifier'"):
        packed_forward(mine, unpad(ids, mask))
