"""Collators: samples of :mod:`underlay.data.datasets` -> ``TokenBatch`` (padded) or packed rows, and
``TokenBatch`` <-> ``tensordict.TensorDict``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from underlay.data.datasets import PairSample, PromptSample, SFTSample
from underlay.interfaces import BackendUnavailable, ConfigError, InvalidInput, TokenBatch

__all__ = [
    "PromptBatch",
    "collate_packed",
    "collate_padded",
    "collate_pairs",
    "collate_prompts",
    "from_tensordict",
    "to_tensordict",
]


@dataclass(frozen=True)
class PromptBatch:
    """Left-padded prompts (``batch.loss_mask`` all zero) and each row's non-tensor ``fields``."""

    batch: TokenBatch
    fields: list[dict[str, Any]]


def _pad(rows: Sequence[Sequence[int]], value: int, left: bool, length: int | None = None) -> torch.Tensor:
    width = max(len(r) for r in rows) if length is None else length
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r) > width:
            raise InvalidInput(f"row {i} has {len(r)} tokens > pad length {width}")
        if r:
            t = torch.as_tensor(list(r), dtype=torch.long)
            if left:
                out[i, width - len(r) :] = t
            else:
                out[i, : len(r)] = t
    return out


def collate_prompts(samples: Sequence[PromptSample], pad_id: int) -> PromptBatch:
    """Left-pad RL prompts into ``[B, S]`` (``S`` the longest prompt) for generation. Raises
    ``InvalidInput`` for an empty list."""
    if not samples:
        raise InvalidInput("collate_prompts: no samples")
    ids = _pad([s.input_ids for s in samples], pad_id, left=True)
    attn = _pad([[1] * len(s.input_ids) for s in samples], 0, left=True)
    return PromptBatch(TokenBatch(ids, attn, torch.zeros_like(ids)), [dict(s.fields) for s in samples])


def collate_padded(samples: Sequence[SFTSample], pad_id: int, *, pad_to_multiple_of: int = 1) -> TokenBatch:
    """Right-pad SFT samples into a ``TokenBatch`` ``[B, S]`` with ``extras["turn_ids"]`` ``[B, S]``
    (``-1`` on padding). ``S`` is the longest sample rounded up to ``pad_to_multiple_of``."""
    if not samples:
        raise InvalidInput("collate_padded: no samples")
    if pad_to_multiple_of < 1:
        raise ConfigError(f"pad_to_multiple_of={pad_to_multiple_of}: must be >= 1")
    longest = max(len(s.input_ids) for s in samples)
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    ids = _pad([s.input_ids for s in samples], pad_id, False, width)
    attn = _pad([[1] * len(s.input_ids) for s in samples], 0, False, width)
    mask = _pad([s.loss_mask for s in samples], 0, False, width)
    turns = _pad([s.turn_ids for s in samples], -1, False, width)
    return TokenBatch(ids, attn, mask, {"turn_ids": turns})


def collate_pairs(samples: Sequence[PairSample], pad_id: int) -> TokenBatch:
    """Preference pairs as one right-padded ``TokenBatch`` of ``2B`` rows: the ``B`` chosen rows, then
    the ``B`` rejected rows; ``extras["pair_index"]`` ``[2B]`` and ``extras["chosen"]`` ``[2B]`` (1/0)."""
    if not samples:
        raise InvalidInput("collate_pairs: no samples")
    rows = [p.chosen for p in samples] + [p.rejected for p in samples]
    tb = collate_padded(rows, pad_id)
    n = len(samples)
    extras = dict(tb.extras)
    extras["pair_index"] = torch.arange(n).repeat(2)
    extras["chosen"] = torch.cat([torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)])
    return TokenBatch(tb.input_ids, tb.attention_mask, tb.loss_mask, extras)


def collate_packed(samples: Sequence[SFTSample], pad_id: int, max_tokens: int) -> list[TokenBatch]:
    """Pack samples first-fit (in the given order) into rows of at most ``max_tokens`` tokens; returns
    ``TokenBatch``es of one row each ``[1, max_tokens]`` with ``extras["position_ids"]`` restarting at 0
    per sample, ``extras["seq_ids"]`` (sample index within the row, ``-1`` on padding) and
    ``extras["turn_ids"]``. The loss mask never covers a sample's first token, so no token is trained
    on context from the previous sample. Raises ``InvalidInput`` when one sample exceeds ``max_tokens``."""
    if not samples:
        raise InvalidInput("collate_packed: no samples")
    rows: list[list[int]] = []
    used: list[int] = []
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        if n > max_tokens:
            raise InvalidInput(f"collate_packed: sample {i} has {n} tokens > max_tokens={max_tokens}")
        for r, u in enumerate(used):
            if u + n <= max_tokens:
                rows[r].append(i)
                used[r] += n
                break
        else:
            rows.append([i])
            used.append(n)
    out = []
    for members in rows:
        ids = torch.full((1, max_tokens), pad_id, dtype=torch.long)
        attn = torch.zeros(1, max_tokens, dtype=torch.long)
        mask = torch.zeros(1, max_tokens, dtype=torch.long)
        pos = torch.zeros(1, max_tokens, dtype=torch.long)
        seq = torch.full((1, max_tokens), -1, dtype=torch.long)
        turns = torch.full((1, max_tokens), -1, dtype=torch.long)
        at = 0
        for j, i in enumerate(members):
            s = samples[i]
            n = len(s.input_ids)
            ids[0, at : at + n] = torch.as_tensor(s.input_ids)
            attn[0, at : at + n] = 1
            m = torch.as_tensor(s.loss_mask)
            m[0] = 0
            mask[0, at : at + n] = m
            pos[0, at : at + n] = torch.arange(n)
            seq[0, at : at + n] = j
            turns[0, at : at + n] = torch.as_tensor(s.turn_ids)
            at += n
        out.append(TokenBatch(ids, attn, mask, {"position_ids": pos, "seq_ids": seq, "turn_ids": turns}))
    return out


def _tensordict() -> Any:
    try:
        import tensordict
    except ImportError as exc:
        raise BackendUnavailable(
            "data",
            "tensordict",
            "TokenBatch <-> TensorDict needs the tensordict package, which is not installed",
            [],
            "pip install tensordict (or pip install 'underlay[data]')",
        ) from exc
    return tensordict.TensorDict


def to_tensordict(batch: TokenBatch) -> Any:
    """A ``tensordict.TensorDict`` with ``batch_size=[B]`` holding ``input_ids``, ``attention_mask``,
    ``loss_mask`` and every extra under its own key (no copies). Raises ``BackendUnavailable`` when
    tensordict is not installed and ``InvalidInput`` when an extra uses a reserved name."""
    td_cls = _tensordict()
    data = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "loss_mask": batch.loss_mask,
    }
    for k, v in batch.extras.items():
        if k in data:
            raise InvalidInput(f"TokenBatch.extras key {k!r} collides with a TokenBatch field")
        data[k] = v
    return td_cls(data, batch_size=[batch.batch_size], device=batch.input_ids.device)


def from_tensordict(td: Any) -> TokenBatch:
    """The ``TokenBatch`` of a TensorDict made by :func:`to_tensordict` (or any with ``input_ids``,
    ``attention_mask``, ``loss_mask`` of shape ``[B, S]``; its other top-level tensors become extras).
    Raises ``InvalidInput`` naming a missing key."""
    keys = set(td.keys())
    for k in ("input_ids", "attention_mask", "loss_mask"):
        if k not in keys:
            raise InvalidInput(f"from_tensordict: missing key {k!r} (keys: {sorted(keys)})")
    extras = {k: td.get(k) for k in sorted(keys) if k not in ("input_ids", "attention_mask", "loss_mask")}
    return TokenBatch(td.get("input_ids"), td.get("attention_mask"), td.get("loss_mask"), extras)
