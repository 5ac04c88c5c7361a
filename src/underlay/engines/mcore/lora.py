"""LoRA on the mcore engine: peft's adapters on megatron-core's tensor-parallel linear layers.

Which Hugging Face modules carry adapters is peft's decision (``select``: peft applied to the model
built on the meta device), so a ``LoraConfig`` adapts the same modules on both engines, and the
initial adapters are peft's own (the seeded build, as in the fsdp2 engine). An adapted HF module with
weight ``W [out, in]`` computes ``W x + s * B (A x)`` with ``A [r, in]``, ``B [out, r]`` and
``s = alpha / r`` (peft's plain LoRA). On megatron's layers (``Site``):

- ``linear_qkv`` (q/k/v_proj) and ``linear_fc1`` ([gate; up]) are column-parallel: each part's ``A`` is
  whole on every TP rank, its ``B`` split along its rows as the base weight's part is (a rank's query
  groups' q/k/v rows, its chunk of gate and of up); the parts' outputs are placed in megatron's fused
  per-rank order (per query group: its q heads, k, v; then ``[gate; up]``), zero for a part without an
  adapter. The rank-local ``A x`` is entered into the TP region with ``copy_to_tensor_model_parallel_region``
  (its backward sums the ranks' partial gradients), or under sequence parallelism gathered along the
  sequence (``r`` columns instead of the hidden size), whose backward reduce-scatters.
- ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) are row-parallel: ``A`` split along its
  columns as the base weight, ``B`` whole; the ranks' partial ``A x`` are summed
  (``reduce_from_tensor_model_parallel_region``, or reduce-scattered along the sequence under sequence
  parallelism) before ``B``.
- A value model's ``score`` head (``layers.ValueHead``, replicated): ``A`` and ``B`` whole.

Gradients: a whole tensor whose gradient each TP rank holds only for its own sequence slice (column
``A``, row ``B`` and the head's adapters under sequence parallelism) carries ``sequence_parallel=True``,
so megatron's ``finalize_model_grads`` sums it over TP as it does for the norms; split tensors carry
megatron's tensor-parallel attributes (counted once per shard in the grad norm, resharded by
checkpoints). Every base parameter is frozen (``requires_grad=False``: megatron's DDP and optimizer hold
the adapters alone).

Refused by name (``ConfigError``): adapters on experts, routers, multi-latent attention, embeddings or the
output layer; a ``LoraConfig.dropout > 0`` kept in training (``training_randomness="keep"``: its masks
would have to agree across TP ranks); Transformer Engine layer specs; with ``pp > 1`` a decoder layer
without adapters (a pipeline chunk could then hold no trainable parameter).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from underlay.engines._lora import PEFT_PREFIX, adapted_modules, add_lora
from underlay.interfaces import ConfigError, ModelConfig

__all__ = ["LoraAdapter", "LoraSelection", "Site", "attach", "peft_names", "select", "sites_of", "split_axis"]

SiteKind = Literal["qkv", "gate_up", "row", "head"]


@dataclass(frozen=True)
class LoraSelection:
    """What ``select`` decided: the adapted HF module names (sorted), ``s = alpha / r``, the rank, and
    peft's config object (what ``export_adapters`` writes as ``adapter_config.json``)."""

    modules: tuple[str, ...]
    rank: int
    scaling: float
    peft_config: Any


@dataclass(frozen=True)
class Site:
    """One megatron linear layer that carries adapters: the global engine name of its weight (a key of
    the weight map), its pipeline stage and virtual chunk, its module path inside the chunk, its
    ``kind`` and the HF module of each part (``qkv``: q, k, v; ``gate_up``: gate, up; ``row``/``head``:
    one), ``None`` for a part without an adapter."""

    engine_name: str
    stage: int
    chunk: int
    path: str
    kind: SiteKind
    modules: tuple[str | None, ...]


def split_axis(kind: SiteKind, which: str) -> int | None:
    """The TP-split axis of a site's ``A`` or ``B`` (``which``); ``None``: whole on every TP rank.
    Column sites split ``B``'s rows, row sites ``A``'s columns, the value head splits neither."""
    if kind in ("qkv", "gate_up") and which == "B":
        return 0
    if kind == "row" and which == "A":
        return 1
    return None


def select(model_cfg: ModelConfig, hf_config: Any, arch: Any, *, pp: int) -> LoraSelection:
    """peft's selection for ``model_cfg.lora`` on the model of ``hf_config`` (causal LM, or the
    token-classification value model for ``kind="value"``) built on the meta device, checked against
    what the mcore engine can adapt. ``ConfigError`` naming the modules it cannot adapt, a kept LoRA
    dropout, Transformer Engine, or (``pp > 1``) the decoder layers without adapters. No process
    state is read or changed."""
    from underlay.engines.mcore.layers import have_te

    lora = model_cfg.lora
    assert lora is not None
    if have_te():
        raise ConfigError(
            "mcore: LoRA is built on megatron's local layer spec; Transformer Engine is installed, whose "
            "fused layers it does not wrap: uninstall transformer_engine or use the fsdp2 engine"
        )
    if lora.dropout > 0 and model_cfg.training_randomness == "keep":
        raise ConfigError(
            f"mcore: LoraConfig.dropout={lora.dropout} with training_randomness='keep': the mcore engine "
            "applies no LoRA dropout (its masks would have to agree across tensor-parallel ranks); use "
            "training_randomness='off' (no dropout in training, the RL default), dropout=0, or the fsdp2 engine"
        )
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if model_cfg.kind == "value" else AutoModelForCausalLM
    with torch.device("meta"):
        model: Any = add_lora(auto.from_config(hf_config), lora)  # type: ignore[no-untyped-call]
    modules = adapted_modules(model)
    bad = [m for m in modules if not _supported(m, arch, model_cfg.kind == "value")]
    if bad:
        raise ConfigError(
            f"mcore: LoraConfig(target_modules={lora.target_modules!r}, exclude_modules="
            f"{lora.exclude_modules!r}) adapts {bad[:6]}{' ...' if len(bad) > 6 else ''}, which the mcore "
            "engine cannot adapt (it adapts the q/k/v/o projections of standard attention, the gate/up/down "
            "projections of dense and shared-expert MLPs, and a value model's score head; not experts, "
            "routers, multi-latent attention or embeddings); name the supported modules in target_modules "
            "(e.g. ('q_proj', 'k_proj', 'v_proj', 'o_proj'); on an MoE model peft's 'all-linear' adapts the "
            "experts and the router as target parameters, which exclude_modules does not reach) or use "
            "the fsdp2 engine"
        )
    if pp > 1:
        bare = sorted(set(range(arch.num_layers)) - {_layer(m) for m in modules if m != "score"})
        if bare:
            raise ConfigError(
                f"mcore: LoRA with pp={pp}: decoder layers {bare[:8]} have no adapter, so a pipeline chunk "
                "could hold no trainable parameter (megatron's pipeline backward needs one on every "
                "stage); adapt every layer (e.g. target_modules=('q_proj', 'v_proj')) or use pp=1"
            )
    return LoraSelection(modules, lora.rank, float(lora.alpha) / lora.rank, model.peft_config["default"])


def _supported(module: str, arch: Any, value: bool) -> bool:
    """Whether the mcore engine adapts HF module ``module``: standard attention's q/k/v/o projections,
    a dense layer's or a shared expert's gate/up/down projections, a value model's ``score``."""
    if module == "score":
        return value
    found = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    if found is None:
        return False
    layer, rest = int(found[1]), found[2]
    if re.fullmatch(r"self_attn\.[qkvo]_proj", rest):
        return not arch.is_mla
    if re.fullmatch(r"mlp\.(gate|up|down)_proj", rest):
        return not arch.moe_layer(layer)
    if re.fullmatch(r"mlp\.shared_experts?\.(gate|up|down)_proj", rest):
        return bool(arch.moe_layer(layer) and arch.shared_ffn)
    return False


def _layer(module: str) -> int:
    return int(module.split(".")[2]) if module.startswith("model.layers.") else -1


def sites_of(
    where: Mapping[str, tuple[int, int, int, Any]], modules: tuple[str, ...], value_head: bool
) -> list[Site]:
    """The adapted megatron layers of the model, in the weight map's order (the same on every rank):
    ``where`` is the engine's ``engine name -> (stage, chunk, ep rank, chunk-local Rule)``."""
    chosen = set(modules)
    out: list[Site] = []
    for engine_name, (stage, chunk, _e, rule) in where.items():
        kind: SiteKind
        if rule.expert or not rule.name.endswith(".weight"):
            continue
        if rule.kind == "qkv":
            kind = "qkv"
        elif rule.kind == "gate_up":
            kind = "gate_up"
        elif rule.kind == "row":
            kind = "row"
        elif rule.name == "output_layer.weight" and value_head:
            kind = "head"
        else:
            continue
        parts = tuple(h.removesuffix(".weight") for h in rule.hf)
        adapted = tuple(p if p in chosen else None for p in parts)
        if any(adapted):
            out.append(Site(engine_name, stage, chunk, rule.name.removesuffix(".weight"), kind, adapted))
    return out


class LoraAdapter(torch.nn.Module):
    """The adapters of one ``Site`` on this rank: ``A_<i>`` / ``B_<i>`` per adapted part ``i`` (this rank's
    shards; see the module docstring for which is split), and ``delta(x)`` = the scaled LoRA term in the
    layer's output layout. ``enabled`` off (``disable_adapter``) skips the term on every rank alike.

    ``part_rows``: the per-rank output rows of every part (``qkv``: q, k, v; ``gate_up``: gate, up; one
    entry for ``row``/``head``); ``in_local``: the layer's per-rank input width; ``groups``: the
    query groups on this rank (``qkv`` only)."""

    def __init__(
        self,
        site: Site,
        *,
        rank: int,
        scaling: float,
        in_local: int,
        part_rows: tuple[int, ...],
        out_full: int,
        groups: int,
        sequence_parallel: bool,
        tp_group: Any,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        self.kind = site.kind
        self.scaling = float(scaling)
        self.part_rows = part_rows
        self.groups = groups
        self.sequence_parallel = bool(sequence_parallel)
        self.tp_group = tp_group
        self.enabled = True
        self.parts = tuple(i for i, m in enumerate(site.modules) if m is not None)
        for i in self.parts:  # zeros until the engine writes the adapters' start
            a = torch.zeros(rank, in_local, dtype=dtype, device=device)
            b = torch.zeros(
                out_full if site.kind == "row" else part_rows[i], rank, dtype=dtype, device=device
            )
            for which, p in (("A", torch.nn.Parameter(a)), ("B", torch.nn.Parameter(b))):
                axis = split_axis(site.kind, which)
                if axis is not None:
                    set_tensor_model_parallel_attributes(p, True, axis, 1)
                else:  # whole: under SP each rank's gradient covers its own sequence slice only
                    p.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
                self.register_parameter(f"{which}_{i}", p)

    def tensor(self, which: str, part: int) -> torch.Tensor:
        """This rank's ``A`` or ``B`` (``which``) of part ``part``."""
        t: torch.Tensor = getattr(self, f"{which}_{part}")
        return t

    def sharded_axes(self) -> dict[str, int]:
        """``state_dict`` key (relative to this module) -> the TP-split axis, for the split tensors."""
        axes = {f"{w}_{i}": split_axis(self.kind, w) for i in self.parts for w in "AB"}
        return {k: a for k, a in axes.items() if a is not None}

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The scaled LoRA term for the layer input ``x [s, b, in_local]`` (``s`` this rank's slice
        under sequence parallelism for column layers), in the layer's per-rank output layout and
        ``x``'s dtype."""
        from megatron.core.tensor_parallel import mappings as m

        if self.kind == "row":
            part = self.parts[0]
            h = torch.nn.functional.linear(x, self.tensor("A", part))
            if self.sequence_parallel:
                h = m.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
            else:
                h = m.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
            return torch.nn.functional.linear(h, self.tensor("B", part)) * self.scaling
        if self.kind == "head":
            part = self.parts[0]
            h = torch.nn.functional.linear(x, self.tensor("A", part))
            return torch.nn.functional.linear(h, self.tensor("B", part)) * self.scaling
        a = torch.cat([self.tensor("A", i) for i in self.parts], 0)
        h = torch.nn.functional.linear(x, a)  # [s, b, parts * r]: one collective for every part
        if self.sequence_parallel:
            h = m.gather_from_sequence_parallel_region(
                h, tensor_parallel_output_grad=True, group=self.tp_group
            )
        else:
            h = m.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        r = self.tensor("A", self.parts[0]).shape[0]
        outs: list[torch.Tensor] = []
        lead = h.shape[:-1]
        for i, rows in enumerate(self.part_rows):
            if i in self.parts:
                j = self.parts.index(i)
                hi = h[..., j * r : (j + 1) * r]
                outs.append(torch.nn.functional.linear(hi, self.tensor("B", i)) * self.scaling)
            else:
                outs.append(h.new_zeros(*lead, rows))
        if self.kind == "gate_up":
            return torch.cat(outs, -1)
        g = self.groups  # per query group: its q heads, then k, then v
        return torch.cat([o.reshape(*lead, g, -1) for o in outs], -1).reshape(*lead, -1)


def attach(linear: Any, adapter: LoraAdapter) -> None:
    """Give megatron linear layer ``linear`` the adapters ``adapter`` (child module ``lora``): its
    forward adds ``adapter.delta`` of its input to its output, and its ``sharded_state_dict`` saves
    the split adapter tensors with their TP axis (megatron's would save every extra tensor as a
    replica). The base weight keeps its name."""
    linear.lora = adapter
    inner: Callable[..., Any] = linear.forward

    def forward(input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out, bias = inner(input_, *args, **kwargs)
        if adapter.enabled:
            out = out + adapter.delta(input_).to(out.dtype)
        return out, bias

    linear.forward = forward
    original = linear.sharded_state_dict
    axes = {f"lora.{k}": v for k, v in adapter.sharded_axes().items()}
    if not axes:
        return

    import inspect

    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    takes_groups = "dp_cp_group" in inspect.signature(make_sharded_tensors_for_checkpoint).parameters

    def sharded_state_dict(prefix: str = "", sharded_offsets: Any = (), metadata: Any = None) -> Any:
        out = original(prefix, sharded_offsets, metadata)
        own = {k: v for k, v in linear.state_dict(prefix="", keep_vars=True).items() if k in axes}
        kwargs: dict[str, Any] = {}
        if takes_groups and metadata and metadata.get("dp_cp_group") is not None:
            kwargs = {"tp_group": adapter.tp_group, "dp_cp_group": metadata["dp_cp_group"]}
        out.update(make_sharded_tensors_for_checkpoint(own, prefix, axes, sharded_offsets, **kwargs))
        return out

    linear.sharded_state_dict = sharded_state_dict


def peft_names(module: str) -> tuple[str, str]:
    """peft's saved names of ``module``'s adapters: ``(A, B)``."""
    return f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"
