"""Parallelisation of a Hugging Face model with FSDP2, composed torchtitan style.

Order (each step a function): validate the layout against the world size (``build_layout``), build the
device meshes (``build_meshes``), enable activation checkpointing (``apply_activation_checkpointing``),
then shard with ``fully_shard`` per decoder layer and finally the root (``apply_fsdp``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from underlay.engines.fsdp2.options import COMPILE_SCOPES
from underlay.interfaces import ConfigError, ParallelConfig, ParallelLayout

__all__ = [
    "COMPILE_SCOPES",
    "Meshes",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "build_layout",
    "build_meshes",
    "compile_layer_parts",
    "decoder_layers",
    "mp_policy_for",
    "offload_policy_for",
    "torch_dtype",
    "validate_ulysses",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (the names ``EngineConfig`` accepts)."""
    try:
        return _DTYPES[name]
    except KeyError as exc:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(_DTYPES)}") from exc


def build_layout(parallel: ParallelConfig, world_size: int) -> ParallelLayout:
    """Sizes of every dimension for ``world_size`` ranks; ``dp_shard`` takes what remains.

    Raises ``ConfigError`` when tp/pp/vpp/cp/ep/etp > 1 (fsdp2 implements dp_replicate x dp_shard and
    Ulysses only), when ``dp_replicate`` does not divide the world size, or when ``ulysses`` does not
    divide ``dp_shard``.
    """
    others = {k: getattr(parallel, k) for k in ("tp", "pp", "vpp", "cp", "ep", "etp")}
    bad = {k: v for k, v in others.items() if v not in (1, None)}
    if bad:
        raise ConfigError(
            f"fsdp2 implements dp_replicate, dp_shard and ulysses only; it cannot run {bad}; set them "
            "to 1 or select UNDERLAY_ENGINE=mcore"
        )
    return ParallelLayout.infer(
        world_size, ulysses=parallel.ulysses, dp_replicate=parallel.dp_replicate, etp=1
    )


@dataclass(frozen=True)
class Meshes:
    """Device meshes of one engine.

    ``fsdp``: the mesh parameters are sharded over (1-D ``("dp_shard",)`` or 2-D HSDP
    ``("dp_replicate", "dp_shard")``); ``data``: 2-D ``("dp", "ulysses")`` mesh whose ``dp``
    dimension indexes distinct data shards and whose ``ulysses`` dimension is one Ulysses group (ranks
    of one group are consecutive and consume the same data). ``None`` meshes only occur without a process group.
    """

    fsdp: DeviceMesh
    data: DeviceMesh

    def group(self, name: str) -> Any:
        """Process group of the data mesh dimension ``"dp"`` or ``"ulysses"``."""
        return self.data.get_group(name)


def build_meshes(layout: ParallelLayout, device_type: str) -> Meshes:
    """Device meshes for ``layout`` over the default process group (which must be initialised with
    ``layout.world_size`` ranks; ``ConfigError`` otherwise)."""
    if not dist.is_initialized():
        raise ConfigError(
            "fsdp2 needs a torch.distributed process group; call underlay.parallel.init_distributed() first"
        )
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ConfigError(f"layout world_size {layout.world_size} != process group size {world}")
    if layout.dp_replicate > 1:
        fsdp = init_device_mesh(
            device_type,
            (layout.dp_replicate, layout.dp_shard),
            mesh_dim_names=("dp_replicate", "dp_shard"),
        )
    else:
        fsdp = init_device_mesh(device_type, (layout.dp_shard,), mesh_dim_names=("dp_shard",))
    data = init_device_mesh(
        device_type, (world // layout.ulysses, layout.ulysses), mesh_dim_names=("dp", "ulysses")
    )
    return Meshes(fsdp=fsdp, data=data)


def validate_ulysses(hf_config: Any, ulysses: int) -> None:
    """Apply the Ulysses head rule (``underlay.parallel.ulysses.validate_ulysses_heads``) to the head
    counts of ``hf_config`` (its ``text_config`` for multimodal configs): ``ConfigError`` naming the
    counts and the valid sizes when attention cannot be split over ``ulysses`` ranks."""
    if ulysses == 1:
        return
    from underlay.parallel.ulysses import validate_ulysses_heads

    cfg = getattr(hf_config, "text_config", None) or hf_config
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    validate_ulysses_heads(heads, kv, ulysses)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder-layer modules of a Hugging Face model (classes named in its ``_no_split_modules``,
    looked up through peft wrappers), in module order. Raises ``ConfigError`` when there are none."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            f"{type(model).__name__}: found no decoder layers (no module class in _no_split_modules); "
            "fsdp2 shards per decoder layer and needs a transformers model"
        )
    return layers


def apply_activation_checkpointing(model: torch.nn.Module, mode: str = "full") -> None:
    """Recompute decoder-layer activations in backward (non-reentrant ``torch.utils.checkpoint``
    through transformers' ``gradient_checkpointing_enable``; parameter names stay unchanged).

    ``mode``: ``"full"`` recomputes each whole layer; ``"none"`` does nothing. Gradients are identical
    either way. Raises ``ConfigError`` for another mode or a model without
    ``gradient_checkpointing_enable``.
    """
    if mode not in ("none", "full"):
        raise ConfigError(f"activation checkpointing mode {mode!r}: use 'none' or 'full'")
    if mode == "none":
        return
    target = model
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        target = get_base()
    enable = getattr(target, "gradient_checkpointing_enable", None)
    if not callable(enable):
        raise ConfigError(
            f"{type(target).__name__} has no gradient_checkpointing_enable(); activation checkpointing "
            "needs a transformers PreTrainedModel"
        )
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg: Any = getattr(target, "config", None)
    if cfg is not None and getattr(cfg, "use_cache", False):
        cfg.use_cache = False


def compile_layer_parts(
    model: torch.nn.Module,
    backend: str = "inductor",
    scope: str = "layer_parts",
    *,
    dynamic: bool | None = None,
) -> int:
    """``torch.compile`` (in place) parts of every decoder layer so that their elementwise chains (fp32
    norm arithmetic, rotary, SiLU x up) fuse into few kernels. ``scope`` is one of ``COMPILE_SCOPES``:
    ``"layer"`` compiles each layer's bound ``forward`` (one graph per layer when the attention kernel
    offers a traceable call, see ``AttentionRoute``; the FSDP hooks, registered later, stay eager around
    it); the other scopes compile modules inside the layer (``nn.Module.compile``) and leave the residual
    adds eager. Sequence lengths vary between micro-batches, so shapes become dynamic after the first
    recompile. Returns how many layers or modules were compiled (in the module scopes ``TiledMLP`` is
    left alone: it loops over tiles by design); ``backend`` is passed to ``torch.compile`` (tests use
    ``"aot_eager"``). ``dynamic`` is passed to ``torch.compile``: use ``True`` under recomputation, so
    each layer has one graph with symbolic sizes from the start; otherwise the first static graph and the
    dynamic one compiled at the next length both match a later input, the recomputation may pick the
    other graph than the forward did (dynamo reorders its cache entries), and ``torch.utils.checkpoint``
    refuses the different saved tensors. Vision-tower blocks of vision-language models are left eager
    (see ``_vision_tower_modules``). Raises ``ConfigError`` for another scope."""
    if scope not in COMPILE_SCOPES:
        raise ConfigError(f"compile scope {scope!r}: use one of {COMPILE_SCOPES}")
    tower = _vision_tower_modules(model)
    text_layers = [layer for layer in decoder_layers(model) if id(layer) not in tower]
    if scope == "layer":
        layers = text_layers
        for layer in layers:
            # an instance attribute, so that hooks registered later (fully_shard) run eagerly around
            # it; the class's forward is looked up at call time because fully_shard swaps the class
            # for a subclass, and transformers checkpoints (recompute="full") only when that class's
            # forward is the one called (a bound method taken now would silently skip recomputation)
            layer.forward = torch.compile(
                functools.partial(_class_forward, layer), backend=backend, dynamic=dynamic
            )
        return len(layers)
    suffixes: tuple[str, ...] = ("RMSNorm", "MLP") + (("Attention",) if scope == "layer_parts" else ())
    count = 0
    for layer in text_layers:
        inside_compiled: list[torch.nn.Module] = []
        for module in layer.modules():
            cls = type(module).__name__
            if module is layer or cls == "TiledMLP" or not cls.endswith(suffixes):
                continue
            if any(any(m is module for m in outer.modules()) for outer in inside_compiled):
                continue  # e.g. q_norm inside a compiled attention module
            module.compile(backend=backend, dynamic=dynamic)
            inside_compiled.append(module)
            count += 1
    return count


# Submodule names of vision towers in transformers' vision-language models.
_VISION_TOWERS = ("visual", "vision_tower", "vision_model")


def _vision_tower_modules(model: torch.nn.Module) -> set[int]:
    """``id`` of every module inside a vision tower. Vision blocks stay eager: their attention splits
    the patches per image or window in a Python loop, so a compiled block's graph depends on the image
    count and recompiles per batch; under recomputation the recomputed block can then run another graph
    (or eager code) than its forward did, and ``torch.utils.checkpoint`` refuses the different saved
    tensors."""
    ids: set[int] = set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _VISION_TOWERS:
            ids.update(id(m) for m in module.modules())
    return ids


def _class_forward(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(layer).forward(layer, *args, **kwargs)


def apply_fsdp(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """``fully_shard`` every decoder layer, then the root, over ``mesh`` (1-D: FSDP; 2-D with dims
    ``("dp_replicate", "dp_shard")``: HSDP). The root keeps its parameters unsharded after forward (it
    is needed again at once in backward). Returns ``model`` (now an ``FSDPModule``)."""
    mp = mp_policy or MixedPrecisionPolicy()
    off = offload_policy or OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=off,
            reshard_after_forward=reshard_after_forward,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=False)
    return model


def mp_policy_for(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """FSDP2 mixed precision: compute in ``param_dtype``, reduce gradients in ``reduce_dtype``; the
    sharded master parameters stay fp32."""
    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(param_dtype),
        reduce_dtype=torch_dtype(reduce_dtype),
        cast_forward_inputs=True,
    )


def offload_policy_for(cpu_offload: bool, *, pin_memory: bool) -> OffloadPolicy:
    """``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer step on the host; pinned host
    memory when ``pin_memory``, i.e. on accelerators) or no offload."""
    return CPUOffloadPolicy(pin_memory=pin_memory) if cpu_offload else OffloadPolicy()
