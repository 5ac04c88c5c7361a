"""Shared prompts through the fsdp2 engine (``TokenBatch.prompt_groups``), at 1 and 2 gloo ranks: on
the same weights, ``infer`` gives the log-probs and entropy of the batch without ``prompt_groups``;
``forward_backward`` gives its loss, metrics and per-rank gradient shards, and the optimizer step the
same weights; the micro-batch plan keeps every group whole, in several micro-batches; the shared
micro-batches compute fewer tokens than the unshared ones; a group over the micro-batch budget is
refused. The engine runs fp32 (it has no float64 compute): both sides are the same model in the same
precision, so they differ by summation order only; the weights are far from their init (``std`` 0.15)
so that a wrong position or mask moves the results by far more than the tolerance. The float64
equality of the computation itself, per model family, is ``tests/unit/ops/test_prompt_sharing.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_distributed
from tests.distributed import _fsdp_helpers as H
from underlay.interfaces import InvalidInput, TokenBatch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

TOL = 2e-5  # relative, fp32 vs fp32 in another summation order


def _grpo_batch(seed: int, groups: int) -> TokenBatch:
    """``groups`` prompts of 3-8 tokens, each with 2-4 responses of 1-6 tokens (loss mask on the
    responses), each at a random place of a row 2 tokens wider than the longest (left, right or both
    padded); advantages for ``H.pg_loss``; ``prompt_groups`` gives each its group."""
    g = torch.Generator().manual_seed(seed)
    rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    ids_of: list[int] = []
    for gi in range(groups):
        prompt = torch.randint(0, H.VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
        for _ in range(int(torch.randint(2, 5, (1,), generator=g))):
            rows.append(
                (
                    prompt,
                    torch.randint(0, H.VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g),
                )
            )
            ids_of.append(10 * gi + 3)  # any integer labels a group
    width = max(len(p) + len(r) for p, r in rows) + 2
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        n = len(p) + len(r)
        at = int(torch.randint(0, width - n + 1, (1,), generator=g))  # left, right or both padded
        ids[i, at : at + n] = torch.cat([p, r])
        attn[i, at : at + n] = 1
        loss[i, at + len(p) : at + n] = 1
    adv = torch.randn(len(rows), generator=g)
    return TokenBatch(ids, attn, loss, {"advantages": adv}, prompt_groups=torch.tensor(ids_of))


def _rel(a: torch.Tensor | None, b: torch.Tensor | None, mask: torch.Tensor) -> float:
    assert a is not None and b is not None
    m = mask.bool()
    return float((a[m].double() - b[m].double()).abs().max() / b[m].double().abs().max().clamp(min=1.0))


def _grads(engine: Any) -> dict[str, torch.Tensor]:
    return {
        n: H.local(p.grad).detach().clone() for n, p in engine.model.named_parameters() if p.grad is not None
    }


def _rel_dict(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b) or not a:
        return float("inf")
    keys = [k for k in a if b[k].numel()]  # a rank's shard of a small parameter may be empty
    scale = max(float(b[k].abs().max()) for k in keys) or 1.0
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys) / scale


class _Groups:
    """``H.pg_loss`` that records the prompt groups and the real tokens of each micro-batch."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []

    def __call__(self, outputs: Any, batch: TokenBatch, ctx: Any) -> Any:
        assert batch.prompt_groups is not None
        self.groups.append(batch.prompt_groups.tolist())
        return H.pg_loss(outputs, batch, ctx)


def _job(rank: int, world: int, weights: str) -> dict[str, Any]:
    from underlay import registry
    from underlay.ops.prompt_sharing import group_rows, share_prompts

    hf = H.llama_config()
    gb = _grpo_batch(5, groups=3 * world)
    mine = [i for i, g in enumerate(gb.prompt_groups.tolist()) if (g // 10) % world == rank]  # type: ignore[union-attr]
    shared = gb.select(mine)
    plain = dataclasses.replace(shared, prompt_groups=None)
    loader = registry.get_weight_loader("fsdp2")
    cfg = H.engine_config(hf, max_tokens=24)
    engines = {}
    for name in ("shared", "plain"):
        engines[name] = registry.get_engine(cfg)
        loader.load_hf(engines[name], weights)
    eng_s, eng_u = engines["shared"], engines["plain"]
    out: dict[str, Any] = {}
    a, b = eng_s.infer(shared, with_entropy=True), eng_s.infer(plain, with_entropy=True)
    out["infer_logp"] = _rel(a.log_probs, b.log_probs, shared.attention_mask)
    out["infer_entropy"] = _rel(a.entropy, b.entropy, shared.attention_mask)

    probe = _Groups()
    rs, ru = eng_s.forward_backward(shared, probe), eng_u.forward_backward(plain, H.pg_loss)
    out["loss"] = abs(rs.metrics["loss"] - ru.metrics["loss"]) / max(abs(ru.metrics["loss"]), 1e-30)
    out["metrics"] = max(abs(rs.metrics[k] - ru.metrics[k]) for k in ("logp_sum", "entropy"))
    out["grads"] = _rel_dict(_grads(eng_s), _grads(eng_u))
    ss, su = eng_s.optimizer_step(), eng_u.optimizer_step()
    out["norm"] = abs(ss.grad_norm - su.grad_norm) / su.grad_norm
    out["weights"] = H.max_diff(dict(eng_s.named_full_parameters()), dict(eng_u.named_full_parameters()))
    out["mb_groups"] = probe.groups
    out["rank_groups"] = sorted(set(shared.prompt_groups.tolist()))  # type: ignore[union-attr]
    layout = share_prompts(shared.input_ids, shared.attention_mask, shared.prompt_groups)  # type: ignore[arg-type]
    out["tokens"] = (layout.total_tokens, layout.packed.total_tokens)
    out["group_sizes"] = {
        shared.prompt_groups[r[0]].item(): len(r) for r in group_rows(shared.prompt_groups, shared.batch_size)
    }  # type: ignore[arg-type,index]
    big = TokenBatch(  # one group: 8 prompt tokens + 4 responses of 5 = 28 tokens shared > 24
        torch.randint(0, H.VOCAB, (1, 13)).repeat(4, 1),
        torch.ones(4, 13, dtype=torch.long),
        torch.ones(4, 13, dtype=torch.long),
        prompt_groups=torch.zeros(4, dtype=torch.long),
    )
    big.input_ids[:, 8:] = torch.randint(0, H.VOCAB, (4, 5))
    try:
        eng_s.infer(big)
        out["too_big"] = "no error"
    except InvalidInput as exc:
        out["too_big"] = str(exc)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_shared_prompts_through_the_engine_equal_the_unshared_batch(tmp_path: Path, world: int) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(H.llama_config())
    with torch.no_grad():  # far from init: log-probs far from uniform, sensitive to positions and masks
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() == 2 else p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    for r in run_distributed(_job, world, str(tmp_path)):
        for key in ("infer_logp", "infer_entropy", "loss", "grads", "norm"):
            assert r[key] < TOL, (key, r[key])
        assert r["metrics"] < TOL and r["weights"] < TOL, (r["metrics"], r["weights"])
        mbs = r["mb_groups"]
        assert len(mbs) > 1, mbs  # several micro-batches...
        seen = [g for mb in mbs for g in set(mb)]
        assert sorted(seen) == r["rank_groups"], mbs  # ...each group in exactly one of them, whole
        assert all(mb.count(g) == r["group_sizes"][g] for mb in mbs for g in set(mb)), mbs
        assert r["tokens"][0] < r["tokens"][1]  # prompts were computed once
        assert (
            "group of rows [0, 1, 2, 3] computes 28 tokens shared > micro_batch_max_tokens=24" in r["too_big"]
        )
