"""Tiny float64 models of any model type of :mod:`underlay.models.coverage` (every parameter and
floating buffer moved off its init) and the exactness check of one row: underlay's packed forward
against transformers' own eager forward of each sequence alone."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.unit.models._f64 import packed, sequences
from underlay.models import coverage, packed_forward, prepare_model
from underlay.ops.packing import pad
from underlay.registry import get_logprob_kernel

LENGTHS = [5, 9, 3]
"""Sequence lengths of every row's check (one packed batch; also packed as two micro-batches)."""
TOL = 2e-5
"""Tolerance against transformers in float64: packed_forward returns fp32 log-probs and entropies
(the float64 model's head runs the fp32 log-prob kernel), so errors of ~1e-6 are rounding."""


def _row_at_a_time(product: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``product`` computed one row of its first operand at a time for float64 operands of >= 2 dims,
    so no row's result depends on the rows next to it."""

    def rows(a: torch.Tensor, b: torch.Tensor, *rest: Any) -> torch.Tensor:
        if a.dtype != torch.float64 or a.dim() < 2 or a.shape[-2] <= 1:
            return product(a, b, *rest)
        return torch.cat([product(a[..., i : i + 1, :], b, *rest) for i in range(a.shape[-2])], dim=-2)

    return rows


def _addmm_row_at_a_time(addmm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``addmm(input, mat1, mat2)`` one row of ``mat1`` at a time for float64 operands (transformers'
    ``Conv1D``, gpt2's projections, calls it); ``input`` broadcasts, or is sliced with the row."""

    def rows(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *rest: Any, **kw: Any) -> torch.Tensor:
        if a.dtype != torch.float64 or a.shape[0] <= 1:
            return addmm(bias, a, b, *rest, **kw)
        per_row = bias.dim() == 2 and bias.shape[0] == a.shape[0]
        return torch.cat(
            [
                addmm(bias[i : i + 1] if per_row else bias, a[i : i + 1], b, *rest, **kw)
                for i in range(a.shape[0])
            ]
        )

    return rows


@contextlib.contextmanager
def row_invariant_products() -> Iterator[None]:
    """Inside the block every float64 ``F.linear`` / ``matmul`` / ``@`` / ``addmm`` is computed a row at a time
    (slow), so a token's result cannot depend on which other tokens share its products: MKL's float64
    gemm sums the trailing ``M mod 4`` rows of a product in another order than its 4-row blocks
    (``test_packing_ulp.py`` proves it), a library fact below underlay's
    packing that the packing comparison must not see. Restored on exit."""
    saved = [(F, "linear"), (torch, "matmul"), (torch.Tensor, "matmul"), (torch.Tensor, "__matmul__")]
    saved += [(torch, "addmm")]
    originals = [getattr(owner, name) for owner, name in saved]
    try:
        for (owner, name), fn in zip(saved, originals):
            setattr(owner, name, _addmm_row_at_a_time(fn) if name == "addmm" else _row_at_a_time(fn))
        yield
    finally:
        for (owner, name), fn in zip(saved, originals):
            setattr(owner, name, fn)


def tiny_model(model_type: str, seed: int = 0) -> nn.Module:
    """The float64 eager causal LM of ``model_type`` at :func:`coverage.tiny_config` sizes, every
    parameter and floating buffer perturbed by N(0, 0.2^2), in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(
            coverage.tiny_config(model_type), attn_implementation="eager"
        ).double()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.state_dict().items():
            if b.is_floating_point() and name not in params:
                b.add_(torch.randn_like(b) * 0.2)
    return model.eval()


def _reference(
    model: nn.Module, seqs: list[torch.Tensor], temperature: float
) -> list[dict[str, torch.Tensor]]:
    out = []
    for ids in seqs:
        logits = model(input_ids=ids[None]).logits[0].double()[:-1] / temperature
        lsm = logits.log_softmax(-1)
        lp = torch.cat([lsm.new_zeros(1), lsm.gather(-1, ids[1:, None])[:, 0]])
        ent = torch.cat([lsm.new_zeros(1), -(lsm.exp() * lsm).sum(-1)])
        out.append({"log_probs": lp, "entropy": ent})
    return out


def _underlay(
    model: nn.Module, seqs: list[torch.Tensor], temperature: float
) -> list[dict[str, torch.Tensor]]:
    batch = packed(seqs)
    out = packed_forward(model, batch, temperature=temperature, logprob_kernel=get_logprob_kernel("torch"))
    assert out.log_probs is not None and out.entropy is not None
    lp, ent = pad(out.log_probs, batch), pad(out.entropy, batch)
    return [{"log_probs": lp[i, : s.numel()], "entropy": ent[i, : s.numel()]} for i, s in enumerate(seqs)]


def _objective(per_seq: list[dict[str, torch.Tensor]], weights: list[torch.Tensor]) -> torch.Tensor:
    return sum(((d["log_probs"] + 0.5 * d["entropy"]) * w).sum() for d, w in zip(per_seq, weights))  # type: ignore[return-value]


def check_row(model_type: str) -> dict[str, float]:
    """Max abs differences of one row: log-probs and entropies at T=1 and T=0.7, the gradient of a
    weighted sum of both (relative to each gradient's largest entry), and two packings (all three
    sequences at once, then 1 + 2) of the log-probs, computed with row-invariant float64 products
    (``row_invariant_products``: the packing logic alone decides, not the BLAS's row blocking)."""
    ref = tiny_model(model_type)
    mine = prepare_model(copy.deepcopy(ref), attention="eager")
    seqs = sequences(LENGTHS)
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, generator=g, dtype=torch.float64) for n in LENGTHS]
    diffs: dict[str, float] = {}
    for temperature in (1.0, 0.7):
        a, b = _reference(ref, seqs, temperature), _underlay(mine, seqs, temperature)
        for key in ("log_probs", "entropy"):
            diffs[f"{key}@{temperature}"] = max(float((x[key] - y[key]).abs().max()) for x, y in zip(a, b))
        if temperature == 1.0:
            _objective(a, weights).backward()
            _objective(b, weights).backward()
            # with autograd on, as the engine's forward_backward (no_grad takes other paths in some MoE
            # blocks, whose fp32 routers then show the same BLAS effect one precision lower)
            with row_invariant_products():
                one = _underlay(mine, seqs, 1.0)
                split = _underlay(mine, seqs[:1], 1.0) + _underlay(mine, seqs[1:], 1.0)
            diffs["packings"] = max(
                float((x["log_probs"] - y["log_probs"]).abs().max()) for x, y in zip(split, one)
            )
    grads = dict(mine.named_parameters())
    diffs["grads"] = max(  # relative to the largest entry of each reference gradient (at least 1)
        float((p.grad - grads[n].grad).abs().max() / p.grad.abs().max().clamp(min=1.0))
        for n, p in ref.named_parameters()
        if p.grad is not None and grads[n].grad is not None
    )
    return diffs


def packing_diff(model_type: str, lengths: list[int]) -> float:
    """Max abs difference of the float64 log-probs of ``sequences(lengths)`` between one packed
    micro-batch of all of them and two (the first sequence, then the rest), through the prepared
    :func:`tiny_model` of ``model_type`` (no gradients), with the platform's products (wrap it in
    ``row_invariant_products`` for row-invariant ones)."""
    model = prepare_model(tiny_model(model_type), attention="eager")
    seqs = sequences(lengths)
    with torch.no_grad():
        one = _underlay(model, seqs, 1.0)
        two = _underlay(model, seqs[:1], 1.0) + _underlay(model, seqs[1:], 1.0)
    return max(float((x["log_probs"] - y["log_probs"]).abs().max()) for x, y in zip(one, two))
