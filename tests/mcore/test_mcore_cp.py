"""Context parallelism in the mcore engine: megatron's load-balanced THD split (checked against
megatron's own RoPE position slicing, in process), and CP=2 alone, with TP=2 + sequence parallelism
with PP=2 and with PP=2 x VPP=2 on 4 gloo ranks against the float64 HF model, with two negative controls; value models
at the same CP layouts against the float64 HF token-classification model and the CP1 step (one spawn
for both); bad layouts refused before any process group exists."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from tests._dist import run_distributed
from tests.mcore import _cp_workers as W
from tests.mcore._helpers import tiny_config
from underlay.engines.mcore.config import arch_of, check_layout
from underlay.engines.mcore.context_parallel import split_packed
from underlay.interfaces import IGNORE_INDEX, ConfigError

pytestmark = pytest.mark.mcore

LP_TOL = 1e-5
LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
STEP_TOL = 1e-6


def _packed(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 100, (sum(lengths),))
    pos = torch.cat([torch.arange(n) for n in lengths])
    labels = torch.randint(0, 100, (sum(lengths),))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, labels, cu


@pytest.mark.parametrize(("cp", "multiple"), [(2, 1), (2, 2), (4, 1), (2, 3)])
def test_split_matches_megatron_rope_and_reassembles(cp: int, multiple: int) -> None:
    """For lengths shorter than 2*cp, odd and even: every rank's local positions are the ones
    megatron's THD RoPE assigns to its tokens from the padded ``cu_seqlens`` (its own
    ``_get_thd_freqs_on_this_cp_rank`` on a table of positions), the local count divides by
    ``multiple`` (tp under SP), and concatenating the ranks' tokens in rank order then indexing with
    ``real_index`` gives back the packed ids; padding carries ``IGNORE_INDEX`` labels."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    torch.manual_seed(0)
    lengths = [1, 3, 8, 5, 2, 13]
    ids, pos, labels, cu = _packed(lengths)
    pieces = []
    for rank in range(cp):
        lid, lpos, llab, split = split_packed(
            ids, pos, labels, cu, group=None, multiple=multiple, cp_rank=(cp, rank)
        )
        assert lid.numel() % multiple == 0 and lid.numel() * cp == int(split.cu_padded[-1])
        padded = (split.cu_padded[1:] - split.cu_padded[:-1]).tolist()
        assert all(p % (2 * cp) == 0 for p in padded)
        table = torch.arange(split.max_seqlen)
        local = (torch.tensor(padded) // cp).tolist()
        want = torch.cat(
            [_get_thd_freqs_on_this_cp_rank(rank, cp, x, table) for x in torch.split(lpos, local)]
        )
        assert torch.equal(lpos, want), (rank, lpos, want)
        pieces.append((lid, llab))
    gathered_ids = torch.cat([p[0] for p in pieces])
    gathered_labels = torch.cat([p[1] for p in pieces])
    assert torch.equal(gathered_ids[split.real_index], ids)
    assert torch.equal(gathered_labels[split.real_index], labels)
    pad = torch.ones(gathered_ids.numel(), dtype=torch.bool)
    pad[split.real_index] = False
    assert bool((gathered_labels[pad] == IGNORE_INDEX).all())
    assert split.cu_real[: len(lengths) + 1].tolist() == cu.tolist()


def test_split_to_a_fixed_local_length() -> None:
    """``local_length`` (virtual pipelines) pads every rank to exactly that many tokens with one
    padding sequence that the gather drops; a count below the micro-batch's own or odd is refused."""
    from underlay.engines.mcore.context_parallel import local_token_count
    from underlay.interfaces import InvalidInput

    lengths = [1, 3, 8]
    ids, pos, labels, cu = _packed(lengths)
    own = local_token_count(lengths, 2)
    assert own == (4 + 4 + 8) // 2
    for rank in range(2):
        lid, _, _, split = split_packed(ids, pos, labels, cu, group=None, cp_rank=(2, rank), local_length=12)
        assert lid.numel() == 12 and int(split.real_index.numel()) == sum(lengths)
    for bad in (own - 2, own + 1):
        with pytest.raises(InvalidInput, match=f"local_length={bad}"):
            split_packed(ids, pos, labels, cu, group=None, cp_rank=(2, 0), local_length=bad)


_CASES: list[tuple[str, int, int, int, dict[str, Any], str | None]] = [
    ("llama", 1, 1, 2, {}, None),  # CP2 x DP2: the token mean over dp x cp
    ("qwen3", 2, 1, 2, {"sequence_parallel": True}, None),  # CP2 x TP2 with sequence parallelism
    ("qwen2_tied", 1, 2, 2, {}, None),  # CP2 x PP2, tied embeddings
    # CP2 x PP2 x VPP2: every micro-batch padded to one per-rank token count by a padding sequence
    ("qwen3", 1, 2, 2, {"vpp": 2}, None),
    ("llama", 1, 1, 2, {}, "contiguous"),
    ("llama", 1, 1, 2, {}, "kv_grad_not_summed"),
]


@pytest.fixture(scope="module")
def cp_suite() -> list[tuple[list[dict[str, float]], dict[str, float]]]:
    """One 4-rank spawn for the log-prob cases ``_CASES`` and the value-model layouts
    (``_cp_workers.value_cp_cases``): per rank ``(log-prob results, value results)``."""
    results: list[tuple[list[dict[str, float]], dict[str, float]]] = run_distributed(
        W.cp_suite, 4, _CASES, timeout_s=600
    )
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_cp2_equals_hf_with_dp_tp_sp_pp_and_negative_controls(
    cp_suite: list[tuple[list[dict[str, float]], dict[str, float]]],
) -> None:
    """Packed variable-length micro-batches (24 tokens max; sequences of 1..12 tokens, some shorter
    than 2*cp and of odd length) on 4 ranks at CP2xDP2, CP2xTP2 (SP), CP2xPP2 and CP2xPP2xVPP2 (the
    interleaved schedule's fixed per-rank token count): per-token log-probs
    on every rank, the token-mean loss over dp x cp, every gradient and the grad norm
    ``optimizer_step`` reports equal the float64 HF model's.
    Negative controls: a contiguous (not load-balanced) split breaks the log-probs, and a K/V gather
    whose backward does not sum the CP ranks' gradients breaks the gradients while the forward stays
    right, each by over 100x the tolerance."""
    results = [lp for lp, _ in cp_suite]
    n_tokens = None
    for i, case in enumerate(_CASES):
        per_rank = [r[i] for r in results]
        for r in per_rank:
            assert r["cp"] == 2.0 and r["entropy_finite"] == 1.0, (case, r)
            n_tokens = r["n_tokens"] if n_tokens is None else n_tokens
            assert r["n_tokens"] == n_tokens, (case, r)  # the global loss-token count N everywhere
        negative = case[-1]
        lp = max(r["lp"] for r in per_rank)
        loss = max(r["loss"] for r in per_rank)
        grad = max(r["grad_rel"] for r in per_rank)
        if negative is None:
            assert lp < LP_TOL and loss < LOSS_TOL and grad < GRAD_TOL, (case, per_rank)
            # the reported global norm counts every gradient once (not once per CP rank)
            for r in per_rank:
                assert abs(r["norm"] - r["hf_norm"]) <= 1e-5 * r["hf_norm"], (case, r)
        elif negative == "contiguous":
            assert lp > 100 * LP_TOL, (case, per_rank)
        else:
            assert lp < LP_TOL and loss < LOSS_TOL, (case, per_rank)
            assert grad > 100 * GRAD_TOL, (case, per_rank)
    assert [r["dp"] for r in results[0]] == [2.0, 1.0, 1.0, 1.0, 2.0, 2.0]


@pytest.mark.distributed
@pytest.mark.slow
def test_value_model_cp2_equals_hf_and_cp1_step(
    cp_suite: list[tuple[list[dict[str, float]], dict[str, float]]],
) -> None:
    """A value model (``kind="value"``) at CP2 x DP2, CP2 x TP2 with sequence parallelism and CP2 x
    PP2 on the packed variable-length batch of the log-prob cases: per-token values returned on every
    rank in the original token order, the token-mean value loss over dp x cp with the global
    loss-token count, every gradient (the CP-replicated score head included) and the reported grad
    norm equal the float64 HF token-classification model's; the parameters after one clipped AdamW
    step equal the CP1 x DP4 engine's step (which moved them, head included). Each rank holding
    different tokens draws its own head-dropout mask (distinct seeds). Negative control: a CP gather
    that skips the un-permutation to the packed order is off by over 100x the tolerance."""
    for _, r in cp_suite:
        for tag, _sizes in W.VALUE_LAYOUTS:
            assert r[f"{tag}_values"] < LP_TOL and r[f"{tag}_loss"] < LOSS_TOL, (tag, r)
            assert r[f"{tag}_tokens"] == 0.0 and r[f"{tag}_names"] == 1.0, (tag, r)
            assert r[f"{tag}_grad_rel"] < GRAD_TOL and r[f"{tag}_norm"] < 1e-5, (tag, r)
            assert r[f"{tag}_skipped"] == 0.0, (tag, r)
            if tag != "cp1":
                assert r[f"{tag}_step"] < STEP_TOL, (tag, r)
                assert r[f"{tag}_seeds_distinct"] == 1.0, (tag, r)
        assert r["cp1_moved"] > 100 * STEP_TOL and r["cp1_head_moved"] > 100 * STEP_TOL, r
        assert r["unpermuted_values"] > 100 * LP_TOL, r


@pytest.mark.parametrize(
    ("world", "tp", "pp", "cp", "sp", "needle"),
    [
        (4, 1, 1, 3, False, r"world size 4 is not a multiple of tp\*pp\*cp = 1\*1\*3 = 3"),
        (6, 2, 1, 2, True, r"world size 6 is not a multiple of tp\*pp\*cp = 2\*1\*2 = 4"),
        (8, 1, 2, 0, False, r"cp=0 must be an int >= 1"),
        (4, 1, 1, 2, True, r"sequence_parallel=True needs tp > 1"),
    ],
)
def test_bad_cp_layouts_refused(world: int, tp: int, pp: int, cp: int, sp: bool, needle: str) -> None:
    """Layouts with context parallelism the world or the options do not allow: ``ConfigError`` naming
    the numbers, from the pure layout check the engine runs before any process group exists."""
    arch = arch_of(tiny_config("qwen3"))
    with pytest.raises(ConfigError, match=needle):
        check_layout(arch, world=world, tp=tp, pp=pp, vpp=1, cp=cp, ep=1, etp=tp, sequence_parallel=sp)


@pytest.mark.distributed
def test_cp_attention_equals_full_attention() -> None:
    """Without megatron, 2 gloo ranks: the load-balanced split, the K/V all-gather attention (GQA,
    sequences of 1..13 tokens; ``multiple=3`` appends a padding sequence as sequence parallelism with
    tp=3 would) and the output gather give float64 causal attention over the whole sequences, and the
    ranks' gradients sum to the reference q/k/v gradients."""
    multiples = [1, 3]
    results = run_distributed(W.attention_vs_full, 2, "eager", multiples, timeout_s=120)
    for per_rank in results:
        for multiple, r in zip(multiples, per_rank):
            assert r["out"] < 1e-12 and r["grad"] < 1e-12, (multiple, r)
            assert r["local"] % multiple == 0, (multiple, r)
