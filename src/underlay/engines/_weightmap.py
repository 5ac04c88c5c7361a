"""Reusable ``WeightRule`` constructors, shared by every engine's weight map (plain torch, pure).

Each constructor returns a rule whose ``to_hf``/``from_hf`` are exact inverses (copies and views only,
no arithmetic), so a float64 round trip is bit-exact. Layout facts they encode:

- ``fuse_qkv``: rows grouped per query group ``g`` (``ng = num_kv_heads`` groups): the group's
  ``num_heads / ng`` query heads (``head_dim`` rows each), then its key head, then its value head;
  tensor parallelism splits whole groups (Megatron-Core's ``linear_qkv``).
- ``fuse_gate_up``: ``[gate; up]`` along dim 0; tensor-parallel rank ``r`` holds gate's ``r``-th chunk
  followed by up's ``r``-th chunk (Megatron-Core's ``linear_fc1``).
- ``stack_experts``: one ``[E, ...]`` tensor from per-expert HF tensors; with two templates the two
  per-expert tensors are concatenated first (transformers 5 keeps ``experts.gate_up_proj [E, 2I, H]``
  = per expert ``[gate_proj; up_proj]`` in memory and ``experts.down_proj [E, H, I]``, while the
  checkpoints hold ``experts.{e}.gate_proj.weight`` etc.).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from underlay.interfaces import ConfigError, InvalidInput
from underlay.interfaces.weightmap import WeightRule

__all__ = ["fuse_gate_up", "fuse_qkv", "rename", "stack_experts"]


def _take(tensors: Mapping[str, torch.Tensor], name: str, rule: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise InvalidInput(f"{rule}: HF tensor {name!r} is missing (got {sorted(tensors)[:5]})") from None


def rename(
    engine_name: str, hf_name: str, *, tp_dim: int | None = None, optional: bool = False
) -> WeightRule:
    """The engine parameter is the HF tensor ``hf_name`` unchanged. ``tp_dim``: the dimension tensor
    parallelism splits (Megatron: 0 for column-parallel weights and the vocab of embeddings/output
    layers, 1 for ``linear_proj``/``linear_fc2``); ``optional`` when checkpoints may lack it."""

    def to_hf(full: torch.Tensor) -> dict[str, torch.Tensor]:
        return {hf_name: full}

    def from_hf(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _take(tensors, hf_name, engine_name)

    return WeightRule(engine_name, (hf_name,), to_hf, from_hf, tp_dim=tp_dim, optional=optional)


def fuse_qkv(
    engine_name: str,
    q: str,
    k: str,
    v: str,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> WeightRule:
    """One ``[ng * (nh/ng + 2) * d, ...]`` tensor from ``q [nh*d, ...]``, ``k [ng*d, ...]``,
    ``v [ng*d, ...]`` (weights ``[rows, hidden]`` or biases ``[rows]``), grouped per query group as the
    module docstring says; tensor parallelism splits dim 0 in whole groups (``num_kv_heads % tp == 0``).
    ``ConfigError`` when ``num_heads`` is not a positive multiple of ``num_kv_heads``."""
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads or head_dim < 1:
        raise ConfigError(
            f"fuse_qkv {engine_name}: num_heads={num_heads} must be a positive multiple of "
            f"num_kv_heads={num_kv_heads}, head_dim={head_dim} >= 1"
        )
    ng, per, d = num_kv_heads, num_heads // num_kv_heads, head_dim

    def to_hf(full: torch.Tensor) -> dict[str, torch.Tensor]:
        if full.shape[0] != ng * (per + 2) * d:
            raise InvalidInput(
                f"fuse_qkv {engine_name}: {full.shape[0]} rows != groups {ng} x (q heads/group {per} + 2) "
                f"x head_dim {d}"
            )
        rest = tuple(full.shape[1:])
        grouped = full.reshape(ng, per + 2, d, *rest)
        return {
            q: grouped[:, :per].reshape(ng * per * d, *rest),
            k: grouped[:, per].reshape(ng * d, *rest),
            v: grouped[:, per + 1].reshape(ng * d, *rest),
        }

    def from_hf(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        tq, tk, tv = (_take(tensors, n, engine_name) for n in (q, k, v))
        rest = tuple(tq.shape[1:])
        if tq.shape[0] != ng * per * d or tk.shape[0] != ng * d or tv.shape[0] != ng * d:
            raise InvalidInput(
                f"fuse_qkv {engine_name}: q/k/v rows {tq.shape[0]}/{tk.shape[0]}/{tv.shape[0]} != "
                f"{ng * per * d}/{ng * d}/{ng * d} (heads {num_heads}/{num_kv_heads}, head_dim {d})"
            )
        grouped = torch.cat(
            [tq.reshape(ng, per, d, *rest), tk.reshape(ng, 1, d, *rest), tv.reshape(ng, 1, d, *rest)], dim=1
        )
        return grouped.reshape(ng * (per + 2) * d, *rest)

    return WeightRule(
        engine_name, (q, k, v), to_hf, from_hf, tp_dim=0, tp_unit=(per + 2) * d, kind="fuse_qkv"
    )


def fuse_gate_up(engine_name: str, gate: str, up: str) -> WeightRule:
    """``[gate; up]`` along dim 0 (``[2I, H]`` from two ``[I, H]``); tensor-parallel rank ``r`` holds
    ``[gate_r; up_r]`` (``tp_parts=2``)."""

    def to_hf(full: torch.Tensor) -> dict[str, torch.Tensor]:
        if full.shape[0] % 2:
            raise InvalidInput(f"fuse_gate_up {engine_name}: odd row count {full.shape[0]}")
        g, u = full.chunk(2, dim=0)
        return {gate: g, up: u}

    def from_hf(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        g, u = _take(tensors, gate, engine_name), _take(tensors, up, engine_name)
        if g.shape != u.shape:
            raise InvalidInput(f"fuse_gate_up {engine_name}: gate {tuple(g.shape)} != up {tuple(u.shape)}")
        return torch.cat([g, u], dim=0)

    return WeightRule(engine_name, (gate, up), to_hf, from_hf, tp_dim=0, tp_parts=2, kind="fuse_gate_up")


def stack_experts(
    engine_name: str,
    templates: Sequence[str],
    num_experts: int,
    *,
    cat_dim: int = 0,
    tp_dim: int | None = None,
) -> WeightRule:
    """One ``[E, ...]`` tensor from per-expert HF tensors named ``template.format(e=e)``. With several
    templates expert ``e``'s tensors are concatenated along ``cat_dim`` (of the per-expert tensor) before
    stacking: ``stack_experts(n, ("...experts.{e}.gate_proj.weight", "...experts.{e}.up_proj.weight"),
    E)`` gives transformers 5's ``gate_up_proj [E, 2I, H]``. ``tp_dim`` is a dimension of the stacked
    tensor. ``ConfigError`` when a template lacks ``{e}`` or ``num_experts < 1``."""
    if num_experts < 1 or not templates or any("{e}" not in t for t in templates):
        raise ConfigError(
            f"stack_experts {engine_name}: templates {list(templates)} must each contain '{{e}}' and "
            f"num_experts={num_experts} be >= 1"
        )
    names = [[t.format(e=e) for t in templates] for e in range(num_experts)]
    flat = tuple(n for per_expert in names for n in per_expert)
    parts = len(templates)

    def to_hf(full: torch.Tensor) -> dict[str, torch.Tensor]:
        if full.shape[0] != num_experts:
            raise InvalidInput(f"stack_experts {engine_name}: {full.shape[0]} experts != {num_experts}")
        out: dict[str, torch.Tensor] = {}
        for e in range(num_experts):
            pieces = full[e].chunk(parts, dim=cat_dim) if parts > 1 else (full[e],)
            out.update(zip(names[e], pieces, strict=True))
        return out

    def from_hf(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        per_expert = []
        for e in range(num_experts):
            got = [_take(tensors, n, engine_name) for n in names[e]]
            per_expert.append(torch.cat(got, dim=cat_dim) if parts > 1 else got[0])
        return torch.stack(per_expert, dim=0)

    return WeightRule(engine_name, flat, to_hf, from_hf, tp_dim=tp_dim, kind="stack_experts")
