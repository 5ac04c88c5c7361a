"""Parameters of the mcore engine through its weight map: filling the chunks (the shared HF reader), the
``WeightMap`` over global names, full-tensor gathers and writes, and weight streaming."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator
from typing import Any

import torch
import torch.distributed as dist

from underlay.engines._buckets import bucket_full_tensors, check_bucket_args
from underlay.engines.mcore._build import MCoreBuild
from underlay.engines.mcore._chunks import unwrap as _unwrap
from underlay.engines.mcore.stages import chunk_layer_spans
from underlay.engines.mcore.weightmap import Rule, hf_shapes, stage_rules
from underlay.interfaces import (
    CheckpointError,
)
from underlay.interfaces.weightmap import WeightMap


class MCoreParams(MCoreBuild):
    """The weight-map half of the mcore engine (``ParallelEngine`` weight access)."""

    def _fill(self) -> dict[str, torch.Tensor]:
        """Fill the parameters (after ``_build_weight_map``, before the optimizer exists): from the
        safetensors of ``model.path`` through the shared reader (``engines._hf_load.load_hf_files``,
        strict, as ``load_hf``: every name and shape checked before any parameter changes), the optional
        tensors the files lack (a value model's head, e.g. from a causal-LM checkpoint) from the seed
        model (the whole seed model is built, so the head is the fsdp2 engine's); or all from the seed
        model. ``CheckpointError`` for anything else missing, unexpected or mis-shaped. Collective.
        Returns the seeded LoRA adapters (``_hf.seeded_hf_states``; ``{}`` when the seed model was not
        built or has none), which ``MCoreAdapters._fill`` writes."""
        from underlay.engines._hf_load import load_hf_files
        from underlay.engines.mcore._hf import seeded_hf_states

        mc = self._config.model
        only: set[str] | None = None  # the base tensors to take from the seed model (None: all)
        if mc.path is not None and mc.load_weights:
            report = load_hf_files(self, mc.path, strict=True)  # type: ignore[arg-type]
            if report.missing:
                from underlay.engines._value_head import refuse_unread_tensors

                # the head is missing: it is in no file under another name either
                refuse_unread_tensors(mc.path, self._weight_map, int(self._hf_config.vocab_size), "mcore")
            only = set(report.missing)
        seed_adapters = mc.lora is not None and mc.lora.adapter_path is None
        if only is not None and not only and not seed_adapters:
            return {}
        state, adapters = seeded_hf_states(mc, self._hf_config)
        for wr in self._weight_map.rules:
            if only is not None and not only.intersection(wr.hf_names):
                continue
            lacking = [n for n in wr.hf_names if n not in state]
            if lacking:
                raise CheckpointError(f"mcore: the seeded model lacks {lacking[:5]} (conversion bug)")
            self.copy_full_parameter(wr.engine_name, wr.from_hf({n: state[n] for n in wr.hf_names}))
        return adapters

    def _global_rules(self) -> list[tuple[int, int, int, Rule]]:
        """Every rule of the model with the (pp rank, virtual chunk, ep rank) that owns it, in a fixed
        order that every rank computes identically."""
        a = self._arch
        pp, vpp = self._layout.pp, self._layout.vpp
        ep = self._layout.ep
        spans = chunk_layer_spans(self._tf_config, pp, vpp)
        local_e = a.num_experts // ep if a.is_moe else 0
        out: list[tuple[int, int, int, Rule]] = []
        for v in range(vpp):
            for stage in range(pp):
                first_stage = stage == 0 and v == 0
                last_stage = stage == pp - 1 and v == vpp - 1
                first_layer, per_chunk = spans[v][stage]
                for e in range(ep):
                    rules = stage_rules(
                        a,
                        first_layer=first_layer,
                        num_layers=per_chunk,
                        pre_process=first_stage,
                        post_process=last_stage,
                        expert_offset=e * local_e,
                        local_experts=local_e,
                    )
                    for r in rules:
                        if e == 0 or r.expert:
                            if last_stage and not first_stage and r.name == "output_layer.weight" and a.tied:
                                continue  # the copy of the embedding: exported once, from the first stage
                            out.append((stage, v, e, r))
        return out

    def _build_weight_map(self) -> None:
        """The ``WeightMap`` over global engine names (``decoder.layers.<global layer>``, experts by global
        index), plus where each parameter lives: (pp rank, virtual chunk, ep rank, chunk-local rule)."""
        from underlay.engines.mcore.weightmap import engine_rule

        shapes = hf_shapes(self._arch)
        rules = []
        self._where: dict[str, tuple[int, int, int, Rule]] = {}
        for stage, v, e, rule in self._global_rules():
            wr = engine_rule(rule, self._arch)
            full = wr.from_hf({n: torch.empty(shapes[n], device="meta") for n in wr.hf_names})
            rules.append(dataclasses.replace(wr, engine_shape=tuple(full.shape)))
            self._where[wr.engine_name] = (stage, v, e, rule)
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if self._arch.tied else {}
        # a value model loads the backbone of a causal-LM checkpoint: its lm_head is not "unexpected"
        ignored = ("*rotary_emb.inv_freq", "lm_head.*") if self._value else ("*rotary_emb.inv_freq",)
        self._weight_map = WeightMap(tuple(rules), tied, ignored)

    @property
    def weight_map(self) -> WeightMap:
        """Megatron ``GPTModel`` parameters (global layer/expert indices) <-> HF tensors: fused q/k/v per
        query group, fused ``[gate; up]``, vocab-split embedding/output layer."""
        return self._weight_map

    def _is_mine(self, stage: int, e: int, rule: Rule) -> bool:
        from megatron.core import parallel_state as ps

        my_ep = ps.get_expert_model_parallel_rank() if self._arch.is_moe else 0
        return stage == ps.get_pipeline_model_parallel_rank() and (not rule.expert or e == my_ep)

    @staticmethod
    def _tp_group(rule: Rule) -> Any:
        from megatron.core import parallel_state as ps

        return ps.get_expert_tensor_parallel_group() if rule.expert else ps.get_tensor_model_parallel_group()

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter of ``weight_map`` in rule order, gathered over TP/ETP by its owners and
        broadcast from the lowest owning rank (pipeline stage, expert rank): full (``tp == 1`` layout)
        fp32 tensors on the device, on every rank. Collective."""
        self._ensure_onloaded("weights")
        self._finish_param_gather()
        params = [_named_tensors(c) for c in self._chunks]
        for wr in self._weight_map.rules:
            stage, v, e, rule = self._where[wr.engine_name]
            full: torch.Tensor | None = None
            if self._is_mine(stage, e, rule):
                local = params[v][rule.name].detach().float()
                group = self._tp_group(rule)
                size = dist.get_world_size(group) if wr.tp_dim is not None else 1
                if size > 1:
                    pieces = [torch.empty_like(local) for _ in range(size)]
                    dist.all_gather(pieces, local.contiguous(), group=group)
                    full = wr.tp_unshard(pieces)
                else:
                    full = local
            if dist.get_world_size() > 1:
                if full is None:
                    assert wr.engine_shape is not None
                    full = torch.empty(wr.engine_shape, dtype=torch.float32, device=self._torch_device)
                full = full.contiguous()
                dist.broadcast(full, src=self._owner_rank(stage, e, rule.expert))
            assert full is not None
            yield wr.engine_name, full

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 HF tensors one at a time (``weight_map.to_hf(named_full_parameters())``). Collective."""
        return self._weight_map.to_hf(self.named_full_parameters())

    def copy_full_parameter(self, engine_name: str, full: torch.Tensor) -> int:
        """Write this rank's TP shard of ``full`` into ``engine_name`` when this rank holds it (its
        pipeline stage and expert rank); no communication. Returns bytes written here (0 elsewhere).
        ``InvalidInput`` for an unknown name, ``CheckpointError`` for a shape mismatch, before writing."""
        from megatron.core import parallel_state as ps

        wr = self._weight_map.rule(engine_name)
        if wr.engine_shape is not None and tuple(full.shape) != wr.engine_shape:
            raise CheckpointError(
                f"copy_full_parameter {engine_name}: shape {tuple(full.shape)} != {wr.engine_shape}"
            )
        stage, v, e, rule = self._where[engine_name]
        self._finish_param_gather()  # a pending gather would overwrite what is written here
        targets: list[tuple[int, str]] = []
        if self._is_mine(stage, e, rule):
            targets.append((v, rule.name))
        last = self._layout.pp - 1
        if (
            self._arch.tied
            and last > 0
            and engine_name == "embedding.word_embeddings.weight"
            and ps.get_pipeline_model_parallel_rank() == last
        ):
            # the last stage's output layer is megatron's copy of the tied embedding
            targets.append((len(self._chunks) - 1, "output_layer.weight"))
        if rule.expert:
            rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        else:
            rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        written = 0
        for chunk, local_name in targets:
            piece = wr.tp_shard(full, rank, size)
            param = _named_tensors(self._chunks[chunk])[local_name]
            with torch.no_grad():
                param.copy_(piece.to(param.device, param.dtype))
            self._masters_stale = True
            written += param.numel() * param.element_size()
        return written

    def _finish_param_gather(self) -> None:
        """Complete the parameter all-gather that ``overlap_param_gather`` defers from the optimizer
        step to the next forward's pre-hooks, for paths that read or write parameters outside a
        forward (weights, checkpoints, offload). No-op when none is pending. Collective over dp when
        one is."""
        if self._gather_pending:
            for c in self._chunks:
                c.start_param_sync(force_sync=True)  # type: ignore[operator]
            self._gather_pending = False

    def _owner_rank(self, stage: int, e: int, expert: bool) -> int:
        """The global rank that broadcasts a tensor owned by pipeline ``stage`` (and expert rank ``e``):
        the lowest rank with that pp rank (and ep rank)."""
        from megatron.core import parallel_state as ps

        if not hasattr(self, "_rank_table"):
            mine = torch.tensor(
                [
                    ps.get_pipeline_model_parallel_rank(),
                    ps.get_expert_model_parallel_rank() if self._arch.is_moe else 0,
                ],
                dtype=torch.int64,
            )
            table = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(table, mine.to(self._torch_device) if False else mine)
            self._rank_table = [tuple(int(x) for x in t.tolist()) for t in table]
        for r, (p, ee) in enumerate(self._rank_table):
            if p == stage and (not expert or ee == e):
                return r
        raise CheckpointError(f"no rank owns pipeline stage {stage} / expert rank {e}")

    def iter_weights(
        self, bucket_bytes: int = 1 << 29, *, ranks: Collection[int] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of ``(hf_name, full tensor)`` in ``param_dtype`` on the device, about ``bucket_bytes``
        each, on the ranks in ``ranks`` (default: all); other ranks take part and get empty buckets
        (the bucket count is the same everywhere: bucket boundaries depend on shapes only). Collective.
        ``InvalidInput`` for ``bucket_bytes < 1`` or a rank outside ``[0, world_size)``, before any
        collective."""
        receive = check_bucket_args(bucket_bytes, ranks, self._layout.world_size)
        yield from bucket_full_tensors(self.named_full_tensors(), bucket_bytes, self._param_dtype, receive)


def _named_tensors(chunk: Any) -> dict[str, torch.Tensor]:
    """Parameters and buffers of an (unwrapped) chunk by name: the weight map also covers buffers
    that checkpoints hold (glm4_moe's routing bias is the router's ``expert_bias`` buffer)."""
    inner = _unwrap(chunk)
    return {**dict(inner.named_buffers()), **dict(inner.named_parameters())}
