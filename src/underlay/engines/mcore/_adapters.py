"""LoRA adapters of the mcore engine (``mcore.lora``): attaching them to the built chunks, filling
them, gathering them in peft's names, merging them into streamed weights, ``disable_adapter``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from underlay.engines.mcore._chunks import unwrap as _unwrap
from underlay.engines.mcore._params import MCoreParams
from underlay.engines.mcore.lora import LoraAdapter, LoraSelection, Site, attach, peft_names, split_axis
from underlay.engines.mcore.weightmap import hf_shapes
from underlay.interfaces import CheckpointError, InvalidInput


class MCoreAdapters(MCoreParams):
    """The LoRA half of the mcore engine's parameters (everything is a no-op or ``InvalidInput``
    without ``ModelConfig.lora``)."""

    _lora: LoraSelection | None
    _lora_sites: list[Site]

    @property
    def peft_config(self) -> Any:
        """peft's ``LoraConfig`` of the adapters (``adapter_config.json`` of ``export_adapters``);
        ``None`` without LoRA."""
        return None if self._lora is None else self._lora.peft_config

    # ------------------------------------------------------------------------- build and fill

    def _attach_adapters(self, chunk: torch.nn.Module, v: int) -> None:
        """Add the adapters of this rank's sites in virtual chunk ``v`` to ``chunk`` (before DDP) and
        freeze every other parameter of it."""
        if self._lora is None:
            return
        from megatron.core import parallel_state as ps

        stage = ps.get_pipeline_model_parallel_rank()
        tp = self._layout.tp
        a = self._arch
        trainable: set[int] = set()
        for site in self._lora_sites:
            if site.stage != stage or site.chunk != v:
                continue
            layer: Any = chunk.get_submodule(site.path)
            weight: torch.Tensor = layer.weight
            if site.kind == "qkv":
                q, kv = a.heads * a.head_dim // tp, a.num_query_groups * a.head_dim // tp
                rows: tuple[int, ...] = (q, kv, kv)
            elif site.kind == "gate_up":
                rows = (weight.shape[0] // 2, weight.shape[0] // 2)
            else:
                rows = (int(weight.shape[0]),)
            adapter = LoraAdapter(
                site,
                rank=self._lora.rank,
                scaling=self._lora.scaling,
                in_local=int(weight.shape[1]),
                part_rows=rows,
                out_full=int(weight.shape[0]),
                groups=a.num_query_groups // tp,
                sequence_parallel=bool(self._tf_config.sequence_parallel),
                tp_group=ps.get_tensor_model_parallel_group(),
                dtype=self._param_dtype,
                device=weight.device,
            )
            if site.kind == "head":
                layer.lora = adapter  # layers.ValueHead adds the term before its sequence gather
            else:
                attach(layer, adapter)
            trainable.update(id(p) for p in adapter.parameters())
        for p in chunk.parameters():
            if id(p) not in trainable:
                p.requires_grad_(False)

    def _fill(self) -> dict[str, torch.Tensor]:
        """``MCoreParams._fill``, then the adapters' start (with ``ModelConfig.lora``): the tensors of
        ``LoraConfig.adapter_path``, else peft's initialisation in the seeded build."""
        seeded = super()._fill()
        lora = self._config.model.lora
        if lora is None:
            return seeded
        from underlay.engines._lora import adapter_file_tensors

        if lora.adapter_path is not None:
            self._fill_adapters(adapter_file_tensors(lora), f"LoraConfig.adapter_path={lora.adapter_path!r}")
        else:
            self._fill_adapters(seeded, "the seeded model")
        return seeded

    def _site_adapter(self, site: Site) -> LoraAdapter:
        adapter: LoraAdapter = _unwrap(self._chunks[site.chunk]).get_submodule(site.path).lora
        return adapter

    def _lora_full_shapes(self) -> dict[str, tuple[int, int]]:
        """peft's saved name of every adapter tensor -> its full shape (``A [r, in]``, ``B [out, r]``)."""
        assert self._lora is not None
        r, shapes = self._lora.rank, hf_shapes(self._arch)
        out: dict[str, tuple[int, int]] = {}
        for site in self._lora_sites:
            for m in site.modules:
                if m is not None:
                    rows, cols = shapes[m + ".weight"]
                    a, b = peft_names(m)
                    out[a], out[b] = (r, cols), (rows, r)
        return out

    def _fill_adapters(self, source: Mapping[str, torch.Tensor], origin: str) -> None:
        """Write this rank's shards of the full adapters ``source`` (peft's saved names) into the
        adapters; every name and shape is checked before anything is written (``CheckpointError``)."""
        from megatron.core import parallel_state as ps

        expected = self._lora_full_shapes()
        missing, unexpected = sorted(set(expected) - set(source)), sorted(set(source) - set(expected))
        shapes = [
            f"{n} {tuple(source[n].shape)} != {expected[n]}"
            for n in sorted(set(expected) & set(source))
            if tuple(source[n].shape) != expected[n]
        ]
        if missing or unexpected or shapes:
            raise CheckpointError(
                f"{origin} does not fit the adapted model: missing {missing[:4]}, unexpected "
                f"{unexpected[:4]}, shape mismatch {shapes[:3]}; build the LoraConfig with "
                "LoraConfig.from_adapter(path) of an adapter of this model"
            )
        stage, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for site in self._lora_sites:
                if site.stage != stage:
                    continue
                adapter = self._site_adapter(site)
                for i, m in enumerate(site.modules):
                    if m is None:
                        continue
                    for which, name in zip("AB", peft_names(m)):
                        full = source[name]
                        axis = split_axis(site.kind, which)
                        piece = full if axis is None else full.chunk(self._layout.tp, axis)[tp_rank]
                        dst = adapter.tensor(which, i)
                        dst.copy_(piece.to(dst.device, dst.dtype))
        self._masters_stale = True

    # ------------------------------------------------------------------------ reading adapters

    def named_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full LoRA adapter tensors in fp32 under peft's saved names
        (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``, as
        ``PeftModel.save_pretrained`` writes them), one at a time, on every rank: gathered over TP by
        the owning pipeline stage and broadcast from it. Empty without LoRA. Collective."""
        if self._lora is None:
            return
        from megatron.core import parallel_state as ps

        self._ensure_onloaded("weights")
        self._finish_param_gather()
        stage = ps.get_pipeline_model_parallel_rank()
        tp_group = ps.get_tensor_model_parallel_group()
        shapes = self._lora_full_shapes()
        for site in self._lora_sites:
            adapter = self._site_adapter(site) if site.stage == stage else None
            for i, m in enumerate(site.modules):
                if m is None:
                    continue
                for which, name in zip("AB", peft_names(m)):
                    full: torch.Tensor | None = None
                    if adapter is not None:
                        local = adapter.tensor(which, i).detach().float().contiguous()
                        axis = split_axis(site.kind, which)
                        if axis is not None and self._layout.tp > 1:
                            pieces = [torch.empty_like(local) for _ in range(self._layout.tp)]
                            dist.all_gather(pieces, local, group=tp_group)
                            local = torch.cat(pieces, axis)
                        full = local
                    if dist.get_world_size() > 1:
                        if full is None:
                            full = torch.empty(shapes[name], dtype=torch.float32, device=self._torch_device)
                        dist.broadcast(full, src=self._owner_rank(site.stage, 0, False))
                    assert full is not None
                    yield name, full

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 HF tensors one at a time (``weight_map.to_hf(named_full_parameters())``); with LoRA
        each adapted weight is merged (``W + alpha / r * B @ A``, peft's merge), so the stream is the
        trained policy as a plain HF model. Collective."""
        if self._lora is None:
            yield from super().named_full_tensors()
            return
        scaling = self._lora.scaling
        adapters = dict(self.named_adapter_tensors())  # small; gathered before the first weight
        for name, t in super().named_full_tensors():
            a_name, b_name = peft_names(name.removesuffix(".weight"))
            if name.endswith(".weight") and a_name in adapters:
                t = t + scaling * (adapters[b_name] @ adapters[a_name])
            yield name, t

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Inside the block the LoRA adapters are bypassed on every layer: ``infer`` gives the base
        model's outputs (the reference policy of LoRA RL without a second copy of the model);
        ``forward_backward`` inside it raises ``InvalidInput``. ``InvalidInput`` without LoRA or when
        already inside. Every rank enters it together."""
        if self._lora is None:
            raise InvalidInput("disable_adapter: the engine has no LoRA adapters (ModelConfig.lora is None)")
        if self._adapter_disabled:
            raise InvalidInput("disable_adapter: already inside a disable_adapter() block")
        from megatron.core import parallel_state as ps

        stage = ps.get_pipeline_model_parallel_rank()
        adapters = [self._site_adapter(s) for s in self._lora_sites if s.stage == stage]
        self._adapter_disabled = True
        for a in adapters:
            a.enabled = False
        try:
            yield
        finally:
            for a in adapters:
                a.enabled = True
            self._adapter_disabled = False
