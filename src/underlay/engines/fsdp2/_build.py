"""Building Hugging Face models with parameters on the meta device, and copying full tensors into shards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from underlay.engines._lora import PEFT_PREFIX as _PEFT_PREFIX
from underlay.engines._lora import adapter_tensors, add_lora, check_adapter_dir
from underlay.interfaces import CheckpointError, ConfigError, ModelConfig
from underlay.models.overrides import apply_overrides

__all__ = [
    "adapter_tensors",
    "build_model",
    "check_adapter_dir",
    "copy_into_param",
    "hf_config_of",
    "hf_name",
    "local_shard",
    "meta_params",
    "seeded_state",
]


def hf_config_of(model_cfg: ModelConfig) -> Any:
    """The ``transformers.PretrainedConfig`` to build: ``hf_config`` as given or ``config.json`` of
    ``path`` (``ConfigError`` when the directory has none). A given ``hf_config`` is deep-copied: the
    build sets fields on it (``num_labels`` of a value model, ``architectures`` at export) and the
    caller's object must not change."""
    if model_cfg.hf_config is not None:
        import copy

        return apply_overrides(copy.deepcopy(model_cfg.hf_config), model_cfg)
    from transformers import AutoConfig

    assert model_cfg.path is not None
    path = Path(model_cfg.path)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"ModelConfig.path={model_cfg.path!r} has no config.json; give a local Hugging Face model "
            "directory (nothing is downloaded)"
        )
    return apply_overrides(AutoConfig.from_pretrained(str(path), local_files_only=True), model_cfg)


@contextlib.contextmanager
def meta_params() -> Iterator[None]:
    """Create every ``nn.Parameter`` registered inside the block on the meta device; buffers (rotary
    frequencies, ...) stay real on the cpu so they can be restored after ``to_empty``."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        # an already-meta parameter is re-registered as is, so ties (lm_head = embed_tokens) hold
        if param is not None and param.device.type != "meta":
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def _auto_model(model_cfg: ModelConfig, hf_config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if getattr(hf_config, "vision_config", None) is not None:  # Qwen-VL style: image-text-to-text
        if model_cfg.kind == "value":  # transformers has no token-classification head for VLMs
            from underlay.models.vision import vision_value_model

            return vision_value_model(hf_config, dtype=torch.float32)
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_config(hf_config, dtype=torch.float32)  # type: ignore[no-any-return,no-untyped-call]
    if model_cfg.kind == "value":
        from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

        model_type = getattr(hf_config, "model_type", None)
        if model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
            raise ConfigError(
                f"ModelConfig(kind='value'): transformers has no token-classification (value head) class "
                f"for model_type {model_type!r}, so underlay cannot build its value model; use a model type "
                "with an AutoModelForTokenClassification class"
            )
        hf_config.num_labels = 1
        model = AutoModelForTokenClassification.from_config(hf_config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    else:
        try:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        except ValueError as exc:
            if "Unrecognized configuration class" not in str(exc):
                raise
            # e.g. Emu3ForCausalLM saves an Emu3TextConfig, which transformers' auto classes do not map
            raise ConfigError(
                f"{type(hf_config).__name__} (model_type {getattr(hf_config, 'model_type', None)!r}) is no "
                "AutoModelForCausalLM config: transformers' AutoModelForCausalLM cannot build it (nor "
                "from_pretrained read its checkpoint), so underlay cannot either; use the checkpoint of the "
                "composite model type (its config.json with the registered model_type)"
            ) from exc
    return model  # type: ignore[no-any-return]


def build_model(model_cfg: ModelConfig, hf_config: Any, *, meta: bool) -> torch.nn.Module:
    """The fp32 model ``model_cfg`` describes (causal LM, or a 1-label token-classification value
    model; for a vision-language config the causal LM is ``AutoModelForImageTextToText`` and the value
    model ``models.vision_value_model``), with peft LoRA adapters when ``model_cfg.lora`` is set. With ``meta`` the parameters are on
    the meta device (no memory); otherwise they are initialised on the cpu from ``model_cfg.seed``
    (rank independent, so every rank builds the same values as a single process would)."""
    if model_cfg.lora is not None and model_cfg.lora.adapter_path is not None:
        check_adapter_dir(model_cfg.lora)
    if meta:
        with meta_params():
            model = _auto_model(model_cfg, hf_config)
            if model_cfg.lora is not None:
                model = add_lora(model, model_cfg.lora)
        return model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_cfg.seed)
        model = _auto_model(model_cfg, hf_config)
        if model_cfg.lora is not None:
            model = add_lora(model, model_cfg.lora)
    return model


def frozen_in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Make every floating-point parameter of ``model`` a ``dtype`` parameter without gradients, in
    place (meta parameters stay on the meta device); tied parameters stay one object. Buffers (rotary
    frequencies, routing biases) keep their dtype, as under FSDP2's mixed precision, which casts only
    parameters."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            new = done.get(id(param))
            if new is None:
                data = param.detach().to(dtype) if param.is_floating_point() else param.detach()
                new = torch.nn.Parameter(data, requires_grad=False)
                done[id(param)] = new
            module._parameters[name] = new


def seeded_state(model_cfg: ModelConfig, hf_config: Any) -> dict[str, torch.Tensor]:
    """Parameters of the seed-initialised cpu model (``build_model(meta=False)``) by engine name,
    including tied aliases."""
    model = build_model(model_cfg, hf_config, meta=False)
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def hf_name(engine_name: str) -> str:
    """Hugging Face name of an engine parameter: drops the peft wrapper prefix and ``.base_layer``."""
    name = engine_name
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


def local_shard(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of ``full`` under the placements of ``like`` (``Shard(d)`` splits dim ``d``
    into ``torch.chunk`` pieces, as DTensor and FSDP2 do; ``Replicate`` keeps it whole)."""
    coord = like.device_mesh.get_coordinate()
    if coord is None:
        raise CheckpointError("this rank is not part of the parameter's device mesh")
    piece = full
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            n = like.device_mesh.size(mesh_dim)
            chunks = list(torch.chunk(piece, n, dim=placement.dim))
            idx = coord[mesh_dim]
            if idx < len(chunks):
                piece = chunks[idx]
            else:
                shape = list(piece.shape)
                shape[placement.dim] = 0
                piece = piece.new_empty(shape)
    return piece


def copy_into_param(param: torch.Tensor, full: torch.Tensor, name: str) -> int:
    """Copy this rank's shard of the full tensor ``full`` into ``param`` (a DTensor or plain tensor),
    converting dtype and device. No communication: every rank holds ``full``. Returns the bytes of
    the local shard written. Raises ``CheckpointError`` on a shape mismatch (before writing)."""
    if tuple(full.shape) != tuple(param.shape):
        raise CheckpointError(
            f"tensor {name!r}: shape {tuple(full.shape)} in the source != model shape "
            f"{tuple(param.shape)}; the weights belong to another model configuration"
        )
    if param.is_floating_point() and not (full.is_floating_point() or full.is_complex()):
        raise CheckpointError(
            f"tensor {name!r}: {full.dtype} in the source for a {param.dtype} parameter; an int/bool "
            "tensor is not a weight (the file is not a model checkpoint or is corrupt)"
        )
    with torch.no_grad():
        if isinstance(param, DTensor):
            local = param.to_local()
            local.copy_(local_shard(full, param).to(device=local.device, dtype=local.dtype))
            return int(local.numel() * local.element_size())
        param.copy_(full.to(device=param.device, dtype=param.dtype))
        return int(param.numel() * param.element_size())
