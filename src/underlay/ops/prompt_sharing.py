"""Shared-prompt packing for GRPO groups: the n responses to one prompt attend to ONE copy of it.

A group of rows whose real tokens start with the same prefix (a GRPO prompt and its n responses) is
packed as ``[prefix, suffix_1, ..., suffix_n]``: the prefix is a segment of its own (causal), each
suffix a segment that attends to the whole prefix and causally to itself, with position ids continuing
from the prefix length. Every token then sees exactly the keys and positions it sees in its own row, so
hidden states, log-probs and gradients equal the unshared computation (each row with its own copy of
the prefix) up to floating-point summation order, while the prefix's attention and MLP run once per
group instead of n times. The shared part is the longest common prefix of the group's real tokens
(which contains the prompt; sharing more is exact too).

:func:`share_prompts` builds the layout (:class:`SharedPrompts`) of one micro-batch; the attention of
such a layout is :func:`shared_prefix_attention` (an SDPA call with a boolean block mask per group, or
``torch.nn.attention.flex_attention`` with a block mask over the whole stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from underlay.interfaces import InvalidInput, PackedBatch
from underlay.ops.flex import flex_attention_fn
from underlay.ops.packing import unpad

__all__ = [
    "CallCounter",
    "SharedPrompts",
    "group_rows",
    "share_prompts",
    "shared_prefix_attention",
    "shared_prompt_costs",
]


class CallCounter:
    """A mutable count (``value``), shared by every copy of the layout that holds it; also the flex
    block masks built for the layout (``block_masks``, by window), so that every layer and the
    recomputation in backward reuse one instead of building it per attention call."""

    def __init__(self) -> None:
        self.value = 0
        self.block_masks: dict[tuple[str, int], Any] = {}


@dataclass(frozen=True)
class SharedPrompts:
    """The shared-prompt packing of a padded ``[B, S]`` micro-batch (built by :func:`share_prompts`).

    - ``packed``: the unshared packing of the batch (``ops.unpad``): ``T`` tokens; outputs are given
      per unshared token and mapped back to ``[B, S]`` with ``ops.pad(x, packed)``.
    - ``input_ids`` / ``position_ids``: ``[T']`` int64, the shared stream (``T' <= T``): per group its
      prefix (positions ``0..p-1``) then each row's suffix (positions ``p..len-1``).
    - ``segment``: ``[T']`` int64 segment index of each stream token; ``parent``: ``[nseg]`` int64, the
      segment a segment also attends to in full (its group's prefix), ``-1`` for none.
    - ``groups``: ``(start, end)`` stream ranges, one per group (no token attends across them).
    - ``token_src``: ``[T]`` int64 stream index of each unshared token (prefix tokens of every row map
      to the one copy).
    - ``pred_src`` / ``pred_label``: ``[M]`` int64: next-token predictions to compute (stream index of
      the predicting hidden state, the label); the last prefix token predicts each row's first suffix
      token, so it has one entry per row.
    - ``token_pred``: ``[T]`` int64 entry that scores each unshared token, ``-1`` for the first token of
      a row (nothing predicts it).
    - ``calls``: a :class:`CallCounter` of the attention calls that consumed this layout (the forward
      checks that every layer saw it). A counter object, not a list: FSDP2 rebuilds dataclass and list
      inputs of a module when it moves them, and the count must survive that.
    """

    packed: PackedBatch
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment: torch.Tensor
    parent: torch.Tensor
    groups: tuple[tuple[int, int], ...]
    token_src: torch.Tensor
    pred_src: torch.Tensor
    pred_label: torch.Tensor
    token_pred: torch.Tensor
    calls: CallCounter = field(default_factory=lambda: CallCounter(), compare=False)

    @property
    def total_tokens(self) -> int:
        """``T'``: tokens of the shared stream (what the backbone computes)."""
        return int(self.input_ids.numel())


def _check_groups(groups: torch.Tensor, batch: int, where: str) -> list[int]:
    if not isinstance(groups, torch.Tensor) or groups.shape != (batch,) or groups.is_floating_point():
        raise InvalidInput(
            f"{where}: prompt_groups must be an integer tensor [B={batch}] (rows with equal values share "
            f"their prompt), got {getattr(groups, 'dtype', type(groups).__name__)} "
            f"{tuple(getattr(groups, 'shape', ()))}"
        )
    return [int(g) for g in groups.tolist()]


def group_rows(groups: torch.Tensor, batch: int) -> list[list[int]]:
    """Rows of each group, groups in the order of their first row, rows in batch order.
    ``InvalidInput`` unless ``groups`` is an integer tensor ``[batch]``."""
    order: dict[int, list[int]] = {}
    for row, g in enumerate(_check_groups(groups, batch, "group_rows")):
        order.setdefault(g, []).append(row)
    return list(order.values())


def _common_prefix(rows: list[torch.Tensor]) -> int:
    n = min(int(r.numel()) for r in rows)
    if n == 0 or len(rows) == 1:
        return n if len(rows) == 1 else 0
    first = rows[0][:n]
    same = torch.ones(n, dtype=torch.bool, device=first.device)
    for r in rows[1:]:
        same &= r[:n] == first
    differ = torch.nonzero(~same)
    return int(differ[0, 0]) if differ.numel() else n


def _row_tokens(packed: PackedBatch) -> list[torch.Tensor]:
    cu = packed.cu_seqlens.tolist()
    return [packed.input_ids[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


def shared_prompt_costs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: torch.Tensor
) -> tuple[list[list[int]], list[int]]:
    """``(rows of each group, tokens each group computes when shared)`` for a padded batch: a group's
    cost is its common prefix once plus every row's remaining tokens. Reads the tokens on the host.
    ``InvalidInput`` for a bad ``groups``."""
    rows_of = group_rows(groups, int(input_ids.shape[0]))
    tokens = _row_tokens(unpad(input_ids, attention_mask))
    costs = []
    for rows in rows_of:
        mine = [tokens[r] for r in rows]
        p = _common_prefix(mine) if len(rows) > 1 else 0
        costs.append(p + sum(int(t.numel()) - p for t in mine))
    return rows_of, costs


def share_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: torch.Tensor
) -> SharedPrompts:
    """The shared-prompt packing of ``input_ids [B, S]`` under ``attention_mask [B, S]`` (left or right
    padding) whose rows with equal ``groups [B]`` (int) values share their longest common prefix of real
    tokens (see the module docstring). A group of one row, or whose rows have no common first token, is
    packed as plain sequences. Reads the tokens on the host; builds index tensors on the batch's device.
    ``InvalidInput`` for a bad ``groups`` or an empty row."""
    packed = unpad(input_ids, attention_mask)
    tokens = _row_tokens(packed)
    if any(int(t.numel()) == 0 for t in tokens):
        raise InvalidInput("share_prompts: a row has no real token (attention_mask all 0)")
    cu = packed.cu_seqlens.tolist()
    rows_of = group_rows(groups, len(tokens))
    dev = input_ids.device
    ids: list[torch.Tensor] = []
    pos: list[torch.Tensor] = []
    seg: list[torch.Tensor] = []
    parent: list[int] = []
    spans: list[tuple[int, int]] = []
    token_src = torch.empty(packed.total_tokens, dtype=torch.long, device=dev)
    token_pred = torch.full((packed.total_tokens,), -1, dtype=torch.long, device=dev)
    pred_src: list[torch.Tensor] = []
    pred_label: list[torch.Tensor] = []
    n_stream = n_pred = 0

    def add_segment(toks: torch.Tensor, start_pos: int, par: int) -> tuple[int, int]:
        nonlocal n_stream
        s = len(parent)
        parent.append(par)
        n = int(toks.numel())
        ids.append(toks)
        pos.append(torch.arange(start_pos, start_pos + n, device=dev))
        seg.append(torch.full((n,), s, dtype=torch.long, device=dev))
        first = n_stream
        n_stream += n
        return s, first

    def add_preds(src: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Append prediction entries; returns their indices."""
        nonlocal n_pred
        n = int(src.numel())
        pred_src.append(src)
        pred_label.append(labels)
        n_pred += n
        return torch.arange(n_pred - n, n_pred, device=dev)

    for rows in rows_of:
        start = n_stream
        mine = [tokens[r] for r in rows]
        p = _common_prefix(mine) if len(rows) > 1 else 0
        prefix_seg, prefix_at = -1, 0
        if p > 0:
            prefix_seg, prefix_at = add_segment(mine[0][:p], 0, -1)
            # inside the prefix: position k - 1 predicts prefix token k (one entry for the whole group)
            shared_preds = add_preds(prefix_at + torch.arange(p - 1, device=dev), mine[0][1:p])
        for r, toks in zip(rows, mine):
            base = cu[r]
            n = int(toks.numel())
            suffix = toks[p:]
            _, at = add_segment(suffix, p, prefix_seg) if n > p else (-1, n_stream)
            src = torch.empty(n, dtype=torch.long, device=dev)
            src[:p] = prefix_at + torch.arange(p, device=dev)
            src[p:] = at + torch.arange(n - p, device=dev)
            token_src[base : base + n] = src
            if p > 0:
                token_pred[base + 1 : base + p] = shared_preds
            # tokens k >= max(p, 1) are predicted by their own row's position k - 1
            k0 = max(p, 1)
            if n > k0:
                ks = torch.arange(k0, n, device=dev)
                token_pred[base + ks] = add_preds(src[ks - 1], toks[k0:])
        spans.append((start, n_stream))
    empty = torch.tensor([], dtype=torch.long, device=dev)
    return SharedPrompts(
        packed=packed,
        input_ids=torch.cat(ids),
        position_ids=torch.cat(pos),
        segment=torch.cat(seg),
        parent=torch.tensor(parent, dtype=torch.long, device=dev),
        groups=tuple(spans),
        token_src=token_src,
        pred_src=torch.cat(pred_src) if pred_src else empty,
        pred_label=torch.cat(pred_label) if pred_label else empty,
        token_pred=token_pred,
    )


def _visible(layout: SharedPrompts, lo: int, hi: int, window: tuple[int, int] | None) -> torch.Tensor:
    """``[hi - lo, hi - lo]`` bool: key ``j`` visible from query ``i`` inside stream range
    ``[lo, hi)`` (same segment and ``j <= i``, or ``j`` in the query's parent segment; within the left
    window of positions when ``window`` is given)."""
    seg = layout.segment[lo:hi]
    idx = torch.arange(hi - lo, device=seg.device)
    same = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    parent = layout.parent[seg]
    allowed = same | (parent[:, None] == seg[None, :])
    if window is not None:
        p = layout.position_ids[lo:hi]
        allowed &= (p[:, None] - p[None, :]) <= window[0]
    return allowed


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SharedPrompts,
    scale: float | None,
    window: tuple[int, int] | None,
) -> torch.Tensor:
    outs = []
    rep = int(q.shape[1]) // int(k.shape[1])
    for lo, hi in layout.groups:
        mask = _visible(layout, lo, hi, window)
        qg, kg, vg = (t[lo:hi].transpose(0, 1)[None] for t in (q, k, v))
        if rep > 1:
            kg, vg = kg.repeat_interleave(rep, dim=1), vg.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SharedPrompts,
    scale: float | None,
    window: tuple[int, int] | None,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    seg, parent, position = layout.segment, layout.parent, layout.position_ids
    left = -1 if window is None else int(window[0])

    def mask_mod(b: Any, h: Any, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        sq, sk = seg[qi], seg[ki]
        ok = ((sq == sk) & (ki <= qi)) | (parent[sq] == sk)
        if left >= 0:
            ok = ok & (position[qi] - position[ki] <= left)
        return ok

    n = int(q.shape[0])
    key = (str(q.device), left)
    block = layout.calls.block_masks.get(key)
    if block is None:
        block = create_block_mask(mask_mod, None, None, n, n, device=q.device)
        layout.calls.block_masks[key] = block
    fn = flex_attention_fn(q.device.type)  # compiled off the cpu (eager flex materialises the scores)
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    gqa = int(q.shape[1]) != int(k.shape[1])
    out = fn(qh, kh, vh, block_mask=block, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


@torch.compiler.disable  # type: ignore[untyped-decorator]
def shared_prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SharedPrompts,
    *,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    impl: Literal["auto", "sdpa", "flex"] = "auto",
) -> torch.Tensor:
    """Attention over a shared-prompt stream: ``q [T', Hq, D]``, ``k``/``v [T', Hk, D(v)]`` (``Hq`` a
    multiple of ``Hk``) -> ``[T', Hq, Dv]`` in ``q``'s dtype. Key ``j`` is visible from query ``i`` when
    both are in one segment and ``j <= i``, or ``j`` is in the prefix segment of ``i``'s group; with
    ``window = (left, right)`` (causal: ``right`` is 0) also only when ``pos[i] - pos[j] <= left``, the
    row's own distance. ``scale``: ``None`` is ``1/sqrt(D)``. ``impl``: ``"sdpa"`` (one
    ``scaled_dot_product_attention`` per group with a ``[Tg, Tg]`` boolean mask: exact, memory quadratic
    in the group's tokens), ``"flex"`` (``flex_attention`` with a block mask over the stream; compiled
    off the cpu), ``"auto"``: flex on cuda, sdpa elsewhere (flex has no cpu backward)."""
    if impl not in ("auto", "sdpa", "flex"):
        raise InvalidInput(f"shared_prefix_attention: impl={impl!r}; use 'auto', 'sdpa' or 'flex'")
    if q.dim() != 3 or k.shape[0] != q.shape[0] or int(q.shape[0]) != layout.total_tokens:
        raise InvalidInput(
            f"shared_prefix_attention: q {tuple(q.shape)}, k {tuple(k.shape)} must be [T'={layout.total_tokens}, H, D]"
        )
    if int(q.shape[1]) % int(k.shape[1]):
        raise InvalidInput(
            f"shared_prefix_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]}"
        )
    use_flex = impl == "flex" or (impl == "auto" and q.device.type == "cuda")
    return (_flex if use_flex else _sdpa)(q, k, v, layout, scale, window)
