"""Full parameters of the fsdp2 engine: gathered by engine name or Hugging Face name, copied into
the shards, in buckets for weight sync, LoRA adapters merged, bypassed or streamed alone."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from underlay.engines._buckets import bucket_full_tensors, check_bucket_args
from underlay.engines.fsdp2 import _build
from underlay.engines.fsdp2._base import FSDP2Base
from underlay.engines.fsdp2.weightmap import persistent_buffers
from underlay.interfaces import InvalidInput


class FSDP2Params(FSDP2Base):
    """Gathering, copying and streaming full parameters (LoRA merged or as adapters)."""

    # ----------------------------------------------------------------------------------- weights

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) parameters by engine name (fp32; ``param_dtype`` for ``role="reference"``), in ``weight_map.rules`` order, one at a time;
        LoRA adapters are merged into their base weights (``W + scaling * B @ A``) and not yielded.
        Collective: every rank iterates and receives every tensor, on the compute device. On a world
        of 1 a tensor may share storage with the live parameter: clone it to keep it across
        optimizer steps."""
        self._ensure_onloaded("weights")
        self._reshard()
        lora = _lora_modules(self._model)
        params = self._params_by_name()
        for rule in self._weight_map.rules:
            name = rule.engine_name
            full = self._full(params[name])
            prefix = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
            if prefix is not None and prefix in lora and name.endswith(".base_layer.weight"):
                module = lora[prefix]
                for adapter in module.active_adapters:
                    a = self._full(params[f"{prefix}.lora_A.{adapter}.weight"])
                    b = self._full(params[f"{prefix}.lora_B.{adapter}.weight"])
                    full = full + module.scaling[adapter] * (b @ a)
            yield name, full

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``named_full_parameters`` converted to Hugging Face tensors by ``weight_map`` (fp32, one
        engine parameter at a time). Collective."""
        yield from self._weight_map.to_hf(self.named_full_parameters())

    def copy_full_parameter(self, engine_name: str, full: torch.Tensor) -> int:
        """Copy this rank's FSDP shard of ``full`` into parameter ``engine_name`` (no communication;
        every rank passes the same tensor). ``InvalidInput`` for an unknown name, ``CheckpointError``
        for a shape mismatch, before writing. Returns the bytes written on this rank."""
        param = self._params_by_name().get(engine_name)
        if param is None:
            raise InvalidInput(f"copy_full_parameter: the model has no parameter {engine_name!r}")
        return _build.copy_into_param(param, full, engine_name)

    def _params_by_name(self) -> dict[str, torch.Tensor]:
        # persistent buffers (routing biases) load and export like parameters (see fsdp2_weight_map)
        return {**dict(persistent_buffers(self._model)), **dict(self._model.named_parameters())}

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Inside the block the LoRA adapters are bypassed: ``infer`` gives the base model's outputs
        (the reference policy of LoRA RL, without a second copy of the model). ``forward_backward``
        inside it raises ``InvalidInput`` (nothing trains there). ``InvalidInput`` for an engine
        without LoRA. Not re-entrant; every rank enters it together."""
        toggle = getattr(self._model, "disable_adapter", None)
        if self._config.model.lora is None or toggle is None:
            raise InvalidInput("disable_adapter: the engine has no LoRA adapters (ModelConfig.lora is None)")
        if self._adapter_disabled:
            raise InvalidInput("disable_adapter: already inside a disable_adapter() block")
        self._adapter_disabled = True
        try:
            with toggle():
                yield
        finally:
            self._adapter_disabled = False

    def named_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full LoRA adapter tensors (peft names without the ``.default`` adapter segment, as
        ``PeftModel.save_pretrained`` writes them), one at a time. Empty without LoRA. Collective."""
        self._reshard()
        for name, param in self._model.named_parameters():
            if "lora_" in name:
                yield name.replace(".default.", "."), self._full(param)

    def _full(self, param: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return param.detach().to(self._torch_device)
        dt: DTensor = param
        local = dt.to_local()
        if local.device.type != dt.device_mesh.device_type:
            dt = DTensor.from_local(
                local.to(self._torch_device),
                dt.device_mesh,
                dt.placements,
                shape=dt.shape,
                stride=dt.stride(),
            )
        with torch.no_grad():
            return dt.full_tensor()

    def iter_weights(
        self, bucket_bytes: int = 1 << 29, *, ranks: Collection[int] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of ``(hf_name, full tensor)`` in ``param_dtype`` on the device, each about
        ``bucket_bytes`` (a tensor larger than that gets a bucket of its own); LoRA: merged weights.
        Collective. ``ranks``: the global ranks that receive tensors (``None``: all); the others get
        the same number of buckets, each empty. Every tensor is all-gathered by FSDP on every rank,
        so a non-receiver holds one gathered tensor at a time (dropped at once), never a bucket.
        ``InvalidInput`` for ``bucket_bytes < 1`` or a rank outside the world, before any collective."""
        receive = check_bucket_args(bucket_bytes, ranks, self._layout.world_size)
        yield from bucket_full_tensors(self.named_full_tensors(), bucket_bytes, self._param_dtype, receive)


def _lora_modules(model: torch.nn.Module) -> dict[str, Any]:
    """peft LoRA layers by module name (empty without peft)."""
    found: dict[str, Any] = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "scaling") and hasattr(module, "base_layer"):
            found[name] = module
    return found
