"""Memory-frugal log-probs and entropy, from logits or straight from hidden states.

Every function here works in fp32 for fp32/bf16/fp16 input and in fp64 for fp64 input (a user checking
gradients needs it), and is chunked over tokens in forward *and*
backward (custom ``torch.autograd.Function``), so at most a couple of fp32 ``[chunk, V]`` buffers are alive
(fp64 for fp64 input) at any time. Labels equal to ``IGNORE_INDEX`` (-100) give log-prob 0 and entropy 0 and receive no
gradient.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from underlay.interfaces import IGNORE_INDEX, InvalidInput, LogprobOutput

__all__ = [
    "check_logprob_args",
    "check_softcap",
    "entropy_from_logits",
    "linear_logprobs",
    "logprobs_from_logits",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the statistics are computed in: fp64 for fp64 input, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_AUTO_CHUNK_ELEMENTS = 1 << 26  # 64 Mi fp32 elements (256 MiB) per logits chunk when chunk_size is None


# --------------------------------------------------------------------------------------------- helpers


def _check_temperature(temperature: float) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise InvalidInput(f"temperature={temperature!r} must be a finite number > 0 (1.0 = no scaling)")


def _check_chunk(chunk_size: int | None) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise InvalidInput(f"chunk_size={chunk_size!r} must be an int >= 1 (or None for automatic)")


def _check_labels(labels: torch.Tensor, vocab: int, what: str) -> None:
    if labels.dtype not in (torch.int64, torch.int32):
        raise InvalidInput(f"{what}: labels dtype {labels.dtype} must be int64 (or int32)")
    if labels.numel() == 0:
        return
    bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab)
    if bool(bad.any()):
        first = labels[bad][0].item()
        raise InvalidInput(
            f"{what}: found {first}: label {first} is outside [0, {vocab}) and is not IGNORE_INDEX ({IGNORE_INDEX}); "
            "check the tokenizer's vocabulary size against the model's"
        )


def _group_info(group: Any | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInput(
            "vocab_group was given but torch.distributed is not initialised; call "
            "init_process_group first or pass vocab_group=None"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(t: torch.Tensor, op: Any, group: Any | None) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)


def _rows(chunk_size: int | None, vocab: int) -> int:
    if chunk_size is not None:
        return chunk_size
    return max(1, _AUTO_CHUNK_ELEMENTS // max(vocab, 1))


def _local_labels(labels: torch.Tensor, offset: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels shifted into this shard and a mask of the rows whose label lives in this shard."""
    local = labels.long() - offset
    inside = (local >= 0) & (local < vocab_local) & (labels != IGNORE_INDEX)
    return torch.where(inside, local, torch.zeros_like(local)), inside


def _chunk_forward(
    z: torch.Tensor,
    labels: torch.Tensor | None,
    offset: int,
    with_entropy: bool,
    group: Any | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Statistics of one fp32 chunk of (scaled) logits ``z [c, V_local]``; ``z`` is overwritten.

    Returns ``(lse [c], label_logit [c] or None, entropy [c] or None)`` over the full (all-reduced)
    vocabulary.
    """
    m = z.amax(dim=-1)
    _all_reduce(m, dist.ReduceOp.MAX, group)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z.sub_(m.unsqueeze(-1))  # z - max
    parts = []
    if labels is not None:
        local, inside = _local_labels(labels, offset, z.shape[-1])
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        parts.append(torch.where(inside, picked, torch.zeros_like(picked)))
    e = z.exp() if with_entropy else z.exp_()  # without entropy z is no longer needed: reuse it
    parts.insert(0, e.sum(dim=-1))
    if with_entropy:
        parts.append(e.mul_(z).sum(dim=-1))  # sum exp(z-m) * (z-m)
    del e
    stacked = torch.stack(parts)
    _all_reduce(stacked, dist.ReduceOp.SUM, group)
    s = stacked[0]
    log_s = s.log()
    lse = m + log_s
    label_logit = stacked[1] + m if labels is not None else None
    entropy = log_s - stacked[-1] / s if with_entropy else None
    return lse, label_logit, entropy


def _chunk_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    labels: torch.Tensor | None,
    offset: int,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    inv_t: float,
) -> torch.Tensor:
    """Gradient w.r.t. the *unscaled* logits of one chunk; ``z`` (fp32 scaled logits) is overwritten.

    d logp_y / dz_j = [j == y] - p_j;   d H / dz_j = -p_j (log p_j + H).
    """
    z.sub_(lse.unsqueeze(-1))  # log p
    coef = torch.zeros_like(lse) if g_lp is None else g_lp
    if g_ent is not None and entropy is not None:
        p = z.exp()
        z.add_(entropy.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(coef.unsqueeze(-1))
        grad = p.mul_(z).neg_()
    else:
        grad = z.exp_().mul_(-coef.unsqueeze(-1))  # one fp32 buffer: p in place
    if labels is not None and g_lp is not None:
        local, inside = _local_labels(labels, offset, grad.shape[-1])
        grad.scatter_add_(
            -1, local.unsqueeze(-1), torch.where(inside, g_lp, torch.zeros_like(g_lp)).unsqueeze(-1)
        )
    if inv_t != 1.0:
        grad.mul_(inv_t)
    return grad


def _masked_grads(
    labels: torch.Tensor | None,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    acc: torch.dtype = torch.float32,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Incoming grads in ``acc`` (fp32, or fp64) with ignored rows zeroed (those outputs are constants)."""
    if labels is None:
        return (None, None if g_ent is None else g_ent.to(acc))
    keep = labels != IGNORE_INDEX
    out = []
    for g in (g_lp, g_ent):
        out.append(None if g is None else torch.where(keep, g.to(acc), torch.zeros_like(g, dtype=acc)))
    return out[0], out[1]


# ------------------------------------------------------------------------------------- from logits


class _LogitsStats(torch.autograd.Function):
    """Chunked log-prob / entropy of ``logits [N, V]``; backward recomputes each chunk's softmax."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        temperature: float,
        with_entropy: bool,
        rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        acc = _acc_dtype(logits.dtype)
        lse = torch.empty(n, dtype=acc, device=logits.device)
        lp = torch.zeros(n if labels is not None else 0, dtype=acc, device=logits.device)
        ent = torch.zeros(n if with_entropy else 0, dtype=acc, device=logits.device)
        inv_t = 1.0 / temperature
        for start in range(0, n, rows):
            sl = slice(start, min(start + rows, n))
            z = logits[sl].to(acc, copy=True)
            if inv_t != 1.0:
                z.mul_(inv_t)
            lab = labels[sl] if labels is not None else None
            c_lse, c_lab, c_ent = _chunk_forward(z, lab, 0, with_entropy, None)
            del z
            lse[sl] = c_lse
            if lab is not None and c_lab is not None:
                lp[sl] = torch.where(lab != IGNORE_INDEX, c_lab - c_lse, torch.zeros_like(c_lse))
            if c_ent is not None:
                if lab is not None:
                    c_ent = torch.where(lab != IGNORE_INDEX, c_ent, torch.zeros_like(c_ent))
                ent[sl] = c_ent
        ctx.save_for_backward(logits, lse, ent, *(() if labels is None else (labels,)))
        ctx.has_labels = labels is not None
        ctx.temperature, ctx.rows = temperature, rows
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        g_lp_in, g_ent_in = grads
        logits, lse, ent, *rest = ctx.saved_tensors
        labels = rest[0] if ctx.has_labels else None
        if ent.numel() == 0:
            g_ent_in = None
        acc = _acc_dtype(logits.dtype)
        g_lp, g_ent = _masked_grads(labels, g_lp_in if ctx.has_labels else None, g_ent_in, acc)
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        n, rows, inv_t = logits.shape[0], ctx.rows, 1.0 / ctx.temperature
        grad = torch.empty_like(logits)
        for start in range(0, n, rows):
            sl = slice(start, min(start + rows, n))
            z = logits[sl].to(acc, copy=True)
            if inv_t != 1.0:
                z.mul_(inv_t)
            g = _chunk_grad(
                z,
                lse[sl],
                ent[sl] if g_ent is not None else None,
                labels[sl] if labels is not None else None,
                0,
                g_lp[sl] if g_lp is not None else None,
                g_ent[sl] if g_ent is not None else None,
                inv_t,
            )
            grad[sl] = g.to(grad.dtype)
        return grad, None, None, None, None


def _check_logits(logits: torch.Tensor, what: str) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise InvalidInput(f"{what}: logits must be a tensor [..., V], got {type(logits).__name__}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise InvalidInput(
            f"{what}: logits dtype {logits.dtype} must be one of float32, bfloat16, float16, float64"
        )


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``log_softmax(logits / temperature).gather(labels)`` in fp32 (fp64 for fp64 logits), chunked.

    ``logits [..., V]`` (fp32/bf16/fp16/fp64), ``labels [...]`` int64 in ``[0, V)`` or ``IGNORE_INDEX``.
    Returns fp32 ``[...]`` (fp64 for fp64 logits); ignored labels give 0 and no gradient. The gradient w.r.t. ``logits`` has the
    dtype of ``logits``. ``chunk_size`` is the number of token rows per fp32 chunk (``None``: about
    64 Mi elements per chunk). Raises ``InvalidInput`` on shape/dtype/device mismatch, labels out of
    range or ``temperature <= 0``.
    """
    _check_logits(logits, "logprobs_from_logits")
    if not isinstance(labels, torch.Tensor) or labels.shape != logits.shape[:-1]:
        raise InvalidInput(
            f"logprobs_from_logits: labels shape {tuple(getattr(labels, 'shape', ()))} must equal "
            f"logits.shape[:-1] = {tuple(logits.shape[:-1])}"
        )
    if labels.device != logits.device:
        raise InvalidInput(f"logprobs_from_logits: labels on {labels.device}, logits on {logits.device}")
    _check_temperature(temperature)
    _check_chunk(chunk_size)
    vocab = logits.shape[-1]
    _check_labels(labels, vocab, "logprobs_from_logits")
    flat = logits.reshape(-1, vocab)
    lp, _ = _LogitsStats.apply(  # type: ignore[no-untyped-call]
        flat, labels.reshape(-1).long(), float(temperature), False, _rows(chunk_size, vocab)
    )
    out: torch.Tensor = lp.view(labels.shape)
    return out


def entropy_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Entropy ``-sum p log p`` of ``softmax(logits / temperature)`` over the last dim, in fp32, chunked.

    ``logits [..., V]`` (fp32/bf16/fp16/fp64) -> fp32 ``[...]`` (nats; fp64 for fp64 logits). Differentiable (chunked backward,
    gradient in the dtype of ``logits``). Raises ``InvalidInput`` on a bad dtype or temperature.
    """
    _check_logits(logits, "entropy_from_logits")
    _check_temperature(temperature)
    _check_chunk(chunk_size)
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    _, ent = _LogitsStats.apply(  # type: ignore[no-untyped-call]
        flat, None, float(temperature), True, _rows(chunk_size, vocab)
    )
    out: torch.Tensor = ent.view(logits.shape[:-1])
    return out


# ------------------------------------------------------------------------------------- from hidden


def _logits_chunk(
    h: torch.Tensor, weight: torch.Tensor, inv_t: float, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``h @ weight.T * inv_t`` (fp64 for fp64 input); half inputs multiply in their dtype (fp32
    accumulation). With ``softcap`` ``c``: ``c * tanh(h @ weight.T / c) * inv_t`` (Gemma's final-logit
    cap, then the temperature), and the chunk's ``tanh`` values as the second result (backward's
    derivative ``(1 - tanh**2) * inv_t``); else ``None``."""
    z = h @ weight.t()
    acc = _acc_dtype(h.dtype)
    z = z.to(acc) if z.dtype != acc else z
    th = None
    if softcap is not None:
        th = z.div_(softcap).tanh_()
        z = th * (softcap * inv_t)
    elif inv_t != 1.0:
        z.mul_(inv_t)
    return z, th


class _LinearLogprob(torch.autograd.Function):
    """Chunked fused ``hidden @ weight.T -> log-prob (+ entropy)`` with recomputation in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        rows: int,
        group: Any | None,
        softcap: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rank, _ = _group_info(group)
        offset = rank * weight.shape[0]
        n = hidden.shape[0]
        dev = hidden.device
        acc = _acc_dtype(hidden.dtype)
        lse = torch.empty(n, dtype=acc, device=dev)
        lp = torch.zeros(n, dtype=acc, device=dev)
        ent = torch.zeros(n if with_entropy else 0, dtype=acc, device=dev)
        inv_t = 1.0 / temperature
        keep = labels != IGNORE_INDEX
        for start in range(0, n, rows):
            sl = slice(start, min(start + rows, n))
            z, _ = _logits_chunk(hidden[sl], weight, inv_t, softcap)
            c_lse, c_lab, c_ent = _chunk_forward(z, labels[sl], offset, with_entropy, group)
            del z
            lse[sl] = c_lse
            assert c_lab is not None
            lp[sl] = torch.where(keep[sl], c_lab - c_lse, torch.zeros_like(c_lse))
            if c_ent is not None:
                ent[sl] = torch.where(keep[sl], c_ent, torch.zeros_like(c_ent))
        ctx.save_for_backward(hidden, weight, labels, lse, ent)
        ctx.temperature, ctx.rows, ctx.group, ctx.offset = temperature, rows, group, offset
        ctx.softcap = softcap
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        g_lp_in, g_ent_in = grads
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        if ent.numel() == 0:
            g_ent_in = None
        acc = _acc_dtype(hidden.dtype)
        g_lp, g_ent = _masked_grads(labels, g_lp_in, g_ent_in, acc)
        nones = (None, None, None, None, None, None)
        if g_lp is None and g_ent is None:
            return None, None, *nones
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, rows, inv_t = hidden.shape[0], ctx.rows, 1.0 / ctx.temperature
        grad_h = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for start in range(0, n, rows):
            sl = slice(start, min(start + rows, n))
            h = hidden[sl]
            z, th = _logits_chunk(h, weight, inv_t, ctx.softcap)
            g = _chunk_grad(
                z,
                lse[sl],
                ent[sl] if g_ent is not None else None,
                labels[sl],
                ctx.offset,
                g_lp[sl] if g_lp is not None else None,
                g_ent[sl] if g_ent is not None else None,
                inv_t if th is None else 1.0,
            )
            del z
            if th is not None:  # through s = c * tanh(z / c) * inv_t: ds/dz = (1 - tanh^2) * inv_t
                g.mul_(th.square_().neg_().add_(1.0)).mul_(inv_t)
                del th
            g = g.to(weight.dtype)
            if grad_h is not None:
                grad_h[sl] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ h).to(acc)
        if grad_h is not None:
            _all_reduce(grad_h, dist.ReduceOp.SUM, ctx.group)
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            *nones,
        )


def check_softcap(softcap: float | None, what: str = "logprob kernel") -> float | None:
    """``softcap`` as a float, or ``None`` for no cap (``None`` and 0 both mean none, as in
    transformers' configs). ``InvalidInput`` for a negative, NaN or infinite cap."""
    if softcap is None or softcap == 0:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (0 < softcap < float("inf")):
        raise InvalidInput(f"{what}: softcap={softcap!r} must be a finite number > 0, or None for no cap")
    return float(softcap)


def check_logprob_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    vocab_group: Any | None = None,
    what: str = "logprob kernel",
) -> tuple[int, int]:
    """Validate the arguments of a ``LogprobKernel`` call (shared by every backend) before any launch.

    ``hidden [N, H]`` and ``weight [V_local, H]`` of one float dtype (fp32/bf16/fp16/fp64) and one device with
    ``labels [N]`` (int64/int32, in ``[0, V_local * world)`` or ``IGNORE_INDEX``); ``temperature`` a
    finite number > 0. Returns ``(rank, world)`` of ``vocab_group`` (``(0, 1)`` without one). Raises
    ``InvalidInput`` naming the bad value; ``what`` prefixes the message.
    """
    for name, t, dim in (("hidden", hidden, 2), ("weight", weight, 2), ("labels", labels, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim:
            raise InvalidInput(
                f"{what}: {name} must be a {dim}-d tensor (hidden [N, H], weight [V, H], labels [N]), got "
                f"shape {tuple(getattr(t, 'shape', ()))}; flatten batch dimensions into N first"
            )
    if hidden.dtype not in _FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise InvalidInput(
            f"{what}: hidden dtype {hidden.dtype} and weight dtype {weight.dtype} must be equal and one "
            "of float32, bfloat16, float16, float64; cast one of them"
        )
    if hidden.shape[1] != weight.shape[1] or weight.shape[0] == 0 or hidden.shape[1] == 0:
        raise InvalidInput(
            f"{what}: hidden size mismatch: hidden has H={hidden.shape[1]}, weight {tuple(weight.shape)} "
            "must be [V, H] with the same H and V >= 1"
        )
    if labels.shape[0] != hidden.shape[0]:
        raise InvalidInput(
            f"{what}: labels must be [N] with hidden's N={hidden.shape[0]} tokens; got {labels.shape[0]} tokens"
        )
    if not (hidden.device == weight.device == labels.device):
        raise InvalidInput(
            f"{what}: hidden on {hidden.device}, weight on {weight.device}, labels on {labels.device}; "
            "move them to one device"
        )
    _check_temperature(temperature)
    rank, world = _group_info(vocab_group)
    _check_labels(labels, weight.shape[0] * world, what)
    return rank, world


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_size: int = 4096,
    vocab_group: Any | None = None,
    softcap: float | None = None,
) -> LogprobOutput:
    """Log-probs (and entropy) of ``labels`` under ``softmax(hidden @ weight.T / temperature)``, or with
    ``softcap`` ``c`` (Gemma 2/3's final-logit cap) under ``softmax(c * tanh(hidden @ weight.T / c) /
    temperature)``: the cap first, then the temperature, as transformers' forward caps the logits and
    a sampler then divides them.

    ``hidden [N, H]``, ``weight [V_local, H]`` of the same dtype (fp32/bf16/fp16/fp64) and device, ``labels
    [N]`` int64 global ids in ``[0, V)`` or ``IGNORE_INDEX``. The work is chunked over ``chunk_size``
    tokens; neither forward nor backward ever holds the full ``[N, V]`` logits: backward recomputes the
    chunk's logits. The matmul runs in the input dtype (fp32 accumulation, like the model's lm_head);
    softmax, gather, entropy and gradient accumulation are fp32 (all of it fp64 for fp64 input). Ignored labels give 0 in both outputs
    and no gradient.

    ``vocab_group`` (a ``torch.distributed`` group): ``weight`` is this rank's vocabulary shard, rank
    ``r`` holding rows ``[r * V_local, (r + 1) * V_local)`` with ``V = V_local * world``; max, sum-exp,
    label logit and entropy sums are all-reduced so every rank gets the unsharded result, the weight
    gradient is the local shard's and the hidden gradient is all-reduced (complete on every rank).
    Every rank must call with the same ``hidden``, ``labels`` and upstream gradients.

    Returns ``LogprobOutput(log_probs [N] fp32, entropy [N] fp32 or None)`` (fp64 for fp64 input). Raises ``InvalidInput`` on
    bad shapes, dtypes, devices, labels, ``chunk_size`` or ``temperature <= 0``.
    """
    check_logprob_args(hidden, weight, labels, temperature, vocab_group, "linear_logprobs")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidInput(f"linear_logprobs: chunk_size={chunk_size!r} must be an int >= 1")
    cap = check_softcap(softcap, "linear_logprobs")
    lp, ent = _LinearLogprob.apply(  # type: ignore[no-untyped-call]
        hidden, weight, labels.long(), float(temperature), bool(with_entropy), chunk_size, vocab_group, cap
    )
    return LogprobOutput(lp, ent if with_entropy else None)
