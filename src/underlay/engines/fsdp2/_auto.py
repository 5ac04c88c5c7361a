"""The fsdp2 engine's side of the auto options: measure the model and the machine, call the pure
``defaults.resolve``, log each decision; and the compile warm-up account."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from underlay.engines._inductor import inductor_ok
from underlay.engines.fsdp2.defaults import ModelShape, Resolved, resolve
from underlay.engines.fsdp2.options import FSDP2Options
from underlay.engines.fsdp2.parallelize import decoder_layers, torch_dtype
from underlay.interfaces import Device, EngineConfig, ParallelLayout
from underlay.models._compat import config_value
from underlay.parallel.rank import current_rank

__all__ = ["CompileWarmup", "model_shape", "resolve_for"]

log = logging.getLogger("underlay.engines.fsdp2")


def _unique_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())


def _eager_attention_layers(
    cfg: Any, layers: list[torch.nn.Module], spec: tuple[int, int, int], device_type: str, dtype: torch.dtype
) -> int:
    """Decoder layers whose attention call the registry would route to the ``eager`` kernel on
    ``device_type``: the call's spec (``spec`` = heads, kv heads, head dim; the config's attention
    softcap; sinks when the layer has a ``sinks`` parameter) has no fused kernel installed that runs it.
    0 when the registry cannot resolve it (the kernel call itself reports that, with its reasons)."""
    from underlay.interfaces import AttentionSpec
    from underlay.registry import resolve

    cap = config_value(cfg, "attn_logit_softcapping")
    heads, kv, head_dim = spec
    count = 0
    chosen: dict[bool, bool] = {}
    for layer in layers:
        sinks = any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in layer.named_parameters())
        if sinks not in chosen:
            try:
                call = AttentionSpec(
                    dtype, head_dim, heads, kv, device_type, softcap=float(cap) if cap else None, sinks=sinks
                )
                chosen[sinks] = resolve("attention", spec=call).name == "eager"
            except Exception:  # an estimate never fails the build; the kernel call raises with reasons
                chosen[sinks] = False
        count += chosen[sinks]
    return count


def model_shape(
    model: torch.nn.Module,
    hf_config: Any,
    *,
    device_type: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> ModelShape:
    """``ModelShape`` of a (meta-device) Hugging Face decoder model: parameter counts from the module
    (tied parameters once), dimensions from its config (``text_config`` of multimodal ones; MoE: the
    routed experts per token x expert width, plus the shared expert). With ``device_type``, the layers
    whose attention would run on the eager kernel there in ``dtype`` (``eager_attention_layers``; else 0)."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    # (per-layer attributes of heterogeneous configs, e.g. Gemma 4's head dims: the largest layer's)
    hidden = int(config_value(cfg, "hidden_size"))
    heads = int(config_value(cfg, "num_attention_heads"))
    kv = int(config_value(cfg, "num_key_value_heads") or heads)
    head_dim = int(config_value(cfg, "head_dim") or hidden // heads)
    ffn_given = config_value(cfg, "intermediate_size") or 4 * hidden
    # a per-layer list (Gemma 3n: one width per layer): the widest layer's
    ffn = int(max(ffn_given) if isinstance(ffn_given, (list, tuple)) else ffn_given)
    topk = config_value(cfg, "num_experts_per_tok")
    moe_width = config_value(cfg, "moe_intermediate_size")
    if topk and moe_width:
        ffn = int(topk) * int(moe_width) + int(config_value(cfg, "shared_expert_intermediate_size", 0))
    params = _unique_params(model)
    layers = decoder_layers(model)
    layer_ids = {id(p) for layer in layers for p in layer.parameters()}
    largest = max((sum(p.numel() for p in _unique_params(layer)) for layer in layers), default=0)
    qk_norm = any(name.endswith(("q_norm", "k_norm")) for name, _ in model.named_modules())
    return ModelShape(
        hidden=hidden,
        layers=len(layers),
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        ffn=ffn,
        vocab=int(getattr(cfg, "vocab_size", 0) or 0),
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        layer_params=largest,
        root_params=sum(p.numel() for p in params if id(p) not in layer_ids),
        qk_norm=qk_norm,
        eager_attention_layers=(
            _eager_attention_layers(cfg, layers, (heads, kv, head_dim), device_type, dtype)
            if device_type is not None
            else 0
        ),
    )


def _single_node(world: int) -> bool:
    """Whether every rank runs on this host: ``LOCAL_WORLD_SIZE`` (torchrun, the ray launcher) when
    set, else the ranks' host names compared (one collective at build)."""
    if world == 1:
        return True
    from underlay.utils import env

    local = env.get_int("LOCAL_WORLD_SIZE", minimum=1)
    if local is not None:
        return local >= world
    import socket

    names: list[Any] = [None] * world
    dist.all_gather_object(names, socket.gethostname())
    return len(set(names)) == 1


def _fused_adamw_ok(device_type: str) -> bool:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return device_type in _get_fused_kernels_supported_devices()


def resolve_for(
    model: torch.nn.Module,
    hf_config: Any,
    config: EngineConfig,
    options: FSDP2Options,
    device: Device,
    layout: ParallelLayout,
) -> Resolved:
    """Decide the auto options of an engine being built (``defaults.resolve``) from the meta model,
    the device's total memory and the layout; log every decision with its reason (rank 0, INFO; a
    memory estimate over the usable bytes as a WARNING). Collective when ``LOCAL_WORLD_SIZE`` is unset
    and the world has more than one rank (host names are gathered)."""
    dtype = device.device_type
    param_dtype = torch_dtype(config.param_dtype)
    resolved = resolve(
        options,
        device_type=dtype,
        recompute=config.recompute,
        shape=model_shape(model, hf_config, device_type=dtype, dtype=param_dtype),
        device_total=int(device.memory_stats().total),
        tokens=config.micro_batch_max_tokens,
        single_node=_single_node(layout.world_size),
        dp=layout.dp_shard,
        ulysses=layout.ulysses,
        param_bytes=torch.empty((), dtype=param_dtype).element_size(),
        cpu_offload=config.cpu_offload,
        inductor_ok=inductor_ok(dtype),
        fused_adamw_ok=_fused_adamw_ok(dtype),
        world_size=layout.world_size,
    )
    if current_rank() == 0:
        o = resolved.options
        values = {
            "compile": o.compile,
            "compile_memory_budget": o.compile_memory_budget,
            "fused_adamw": o.fused_adamw,
            "reshard_after_forward": o.reshard_after_forward,
            "optimizer_offload": o.optimizer_offload,
            "grad_sync": o.grad_sync,
            "single_device": o.single_device,
            "recompute": resolved.recompute,
        }
        for name, value in values.items():
            log.info("fsdp2 option %s=%r: %s", name, value, resolved.reasons.get(name, ""))
        if resolved.memory is not None and not resolved.memory.fits:
            log.warning("fsdp2 memory policy: %s", resolved.memory.reason)
    return resolved


@dataclass
class CompileWarmup:
    """The engine calls (``forward_backward``, ``infer``) in which torch.compile compiled graphs
    (one-time cost), their host wall time and the graph count; each such call is logged once at INFO.
    A compile the engine chose itself that compiled no graph in its first two calls is logged as a
    fallback to eager (WARNING). Two, because a layer's first forward runs eagerly to resolve its
    attention kernel: a first call of one micro-batch compiles nothing by design."""

    steps: int = 0
    seconds: float = 0.0
    graphs: int = 0
    _calls: int = 0

    @staticmethod
    def _graphs() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"].get("unique_graphs", 0))

    def start(self) -> tuple[float, int]:
        """A token for ``stop``: the time and graph count now."""
        return time.perf_counter(), self._graphs()

    def stop(self, token: tuple[float, int], step: int, auto: bool) -> None:
        """Account the step started at ``token`` (``step``: the engine's ``global_step``)."""
        t0, g0 = token
        new = self._graphs() - g0
        if new > 0:
            dt = time.perf_counter() - t0
            self.steps += 1
            self.seconds += dt
            self.graphs += new
            if current_rank() == 0:
                log.info(
                    "fsdp2: torch.compile compiled %d graph(s) in a call at step %d: %.1f s "
                    "(one-time warm-up; %.1f s in %d call(s) so far)",
                    new,
                    step,
                    dt,
                    self.seconds,
                    self.steps,
                )
        self._calls += 1
        if self._calls == 2 and auto and self.graphs == 0 and current_rank() == 0:
            log.warning(
                "fsdp2: compile was chosen automatically but torch.compile compiled no graph in the "
                "first two calls (see torch's log for why): the layers run eagerly; set "
                "options compile=False to skip the attempt"
            )

    def as_dict(self) -> dict[str, float]:
        """``{"steps", "seconds", "graphs"}``."""
        return {"steps": float(self.steps), "seconds": self.seconds, "graphs": float(self.graphs)}
