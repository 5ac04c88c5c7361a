"""Parallelisation of a Hugging Face model with FSDP2, composed torchtitan style.

Order (each step a function): validate the layout against the world size (``build_layout``), build the
device meshes (``build_meshes``), enable activation checkpointing (``apply_activation_checkpointing``),
then shard with ``fully_shard`` per decoder layer and finally the root (``apply_fsdp``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint as torch_checkpoint

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

_log = logging.getLogger(__name__)

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
    recompile (``dynamic=True``: symbolic from the first graph; passed to ``torch.compile``). Returns how
    many layers or modules were compiled (in the module scopes ``TiledMLP`` is left alone: it loops over
    tiles by design); ``backend`` is passed to ``torch.compile`` (tests use ``"aot_eager"``).

    Recomputation: a layer whose activation checkpointing is on (``apply_activation_checkpointing``,
    i.e. transformers' ``gradient_checkpointing`` flag) is compiled *with the checkpoint inside*, in every
    scope: the compiled function is ``torch.utils.checkpoint.checkpoint`` (non-reentrant) of the layer's
    forward, which dynamo captures as one checkpointed region, so AOTAutograd recomputes the layer inside
    the compiled backward and no compiled graph is looked up again at recomputation time; the module
    scopes become ``"layer"`` for such layers (logged). Transformers' own checkpoint of the layer is
    turned off (``layer.gradient_checkpointing = False``). Compiled code inside a runtime checkpoint is
    not safe: the recomputation calls it again in backward, where dynamo may pick or compile another
    graph than the forward ran (its cache reorders entries shared by every layer; a guard on global state
    such as the intra-op thread count fails on the CUDA autograd thread; a recompile there runs without
    the engine's ``compile_memory_budget``), and ``torch.utils.checkpoint`` then refuses the different
    saved tensors (``CheckpointError``). A layer whose attention has no traceable kernel call yet (its
    first, eager call resolves one; Ulysses has none) or whose forward otherwise breaks the graph runs
    its checkpoint eagerly: forward and recomputation both eager, so they agree (see
    ``_checkpointed_class_forward``). Vision-tower blocks of vision-language models are left
    eager (see ``_vision_tower_modules``). Raises ``ConfigError`` for another scope."""
    if scope not in COMPILE_SCOPES:
        raise ConfigError(f"compile scope {scope!r}: use one of {COMPILE_SCOPES}")
    tower = _vision_tower_modules(model)
    text_layers = [layer for layer in decoder_layers(model) if id(layer) not in tower]
    checkpointed = {id(layer) for layer in text_layers if _checkpointing_on(layer)}
    if checkpointed and scope != "layer":
        _log.warning(
            "compile scope %r under recomputation compiles the whole checkpointed layer (%d layers): "
            "compiled modules inside an eager checkpoint may recompute with another graph",
            scope,
            len(checkpointed),
        )
    count = 0
    for layer in text_layers:
        if id(layer) in checkpointed:
            # transformers' checkpoint (around __call__ or the class forward, by version) stays off;
            # the compiled function checkpoints instead
            setattr(layer, "gradient_checkpointing", False)  # noqa: B010 (an nn.Module attribute mypy types as Tensor | Module)
            target: Any = functools.partial(_checkpointed_class_forward, layer, _attention_routes(layer))
        elif scope == "layer":
            target = functools.partial(_class_forward, layer)
        else:
            count += _compile_modules(layer, backend, scope, dynamic)
            continue
        # an instance attribute, so that hooks registered later (fully_shard) run eagerly around it;
        # the class's forward is looked up at call time because fully_shard swaps the class for a
        # subclass
        compiled = torch.compile(target, backend=backend, dynamic=dynamic)
        layer.forward = _tracing_checkpoint_side_effects(compiled) if id(layer) in checkpointed else compiled
        count += 1
    return count


def _compile_modules(layer: torch.nn.Module, backend: str, scope: str, dynamic: bool | None) -> int:
    """The module scopes: ``nn.Module.compile`` the norms and MLPs (and attention for
    ``"layer_parts"``) of ``layer``, outermost matching modules only; returns how many."""
    suffixes: tuple[str, ...] = ("RMSNorm", "MLP") + (("Attention",) if scope == "layer_parts" else ())
    inside_compiled: list[torch.nn.Module] = []
    for module in layer.modules():
        cls = type(module).__name__
        if module is layer or cls == "TiledMLP" or not cls.endswith(suffixes):
            continue
        if any(any(m is module for m in outer.modules()) for outer in inside_compiled):
            continue  # e.g. q_norm inside a compiled attention module
        module.compile(backend=backend, dynamic=dynamic)
        inside_compiled.append(module)
    return len(inside_compiled)


def _checkpointing_on(layer: torch.nn.Module) -> bool:
    """Whether transformers' activation checkpointing is enabled on ``layer``."""
    return getattr(layer, "gradient_checkpointing", False) is True


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


def _attention_routes(layer: torch.nn.Module) -> list[Any]:
    """The ``AttentionRoute`` objects ``underlay.models.prepare_model`` attached inside ``layer``."""
    from underlay.models.attention import ROUTE_ATTR, AttentionRoute

    routes = (getattr(module, ROUTE_ATTR, None) for module in layer.modules())
    return [route for route in routes if isinstance(route, AttentionRoute)]


def _tracing_checkpoint_side_effects(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` called with dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` on (read
    while dynamo traces, so only for the calls that compile). Without it, a forward that mutates state
    outside the checkpoint breaks the graph at the checkpoint and the whole layer runs eagerly: since
    transformers 5.25 with the ``kernels`` package installed (a dependency of it), every attention
    module's forward sets and resets a module-level ``CompileableContextVar`` (``use_kernelized_func``).
    Such side effects then run once, in the forward; the recomputation in backward does not repeat
    them (a set-then-reset like that one leaves nothing to repeat)."""
    import torch._dynamo.config as dynamo_config

    def forward(*args: Any, **kwargs: Any) -> Any:
        with dynamo_config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            return compiled(*args, **kwargs)

    return forward


def _checkpointed_class_forward(layer: torch.nn.Module, routes: list[Any], *args: Any, **kwargs: Any) -> Any:
    """``layer``'s class forward under non-reentrant ``torch.utils.checkpoint`` while training with
    gradients, plain otherwise; compiled by ``compile_layer_parts``.

    Dynamo captures the checkpoint as one region only when nothing inside breaks the graph; otherwise
    it runs the checkpoint eagerly, with guards only on what it traced before the checkpoint call. So
    the routes' ``traceable_count`` is read here first (guarded): while an attention route has no
    traceable kernel call yet (its first, eager call resolves one; Ulysses never has one) the layer
    runs eagerly on purpose, and once one is activated the guard fails and the layer recompiles whole.
    """
    # gradients enabled is what makes this a training forward: the layer's own ``training`` flag is
    # no guide, since training_randomness="off" runs training forwards in eval mode (no dropout)
    if not torch.is_grad_enabled():
        return _class_forward(layer, *args, **kwargs)
    if not all(route.traceable_count() for route in routes):
        return _eager_checkpoint(layer, *args, **kwargs)
    return torch_checkpoint(_class_forward, layer, *args, use_reentrant=False, **kwargs)


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _eager_checkpoint(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The eager non-reentrant checkpoint of ``layer``'s class forward (forward and recomputation both
    eager, so they run the same code)."""
    return torch_checkpoint(_class_forward, layer, *args, use_reentrant=False, **kwargs)


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
