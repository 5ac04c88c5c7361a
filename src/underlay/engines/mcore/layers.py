"""Modules underlay supplies to megatron-core's local (non-TE) layer spec.

- ``RMSNorm``: HF's RMSNorm (fp32 statistics, weight applied in the input dtype); its weight carries
  ``sequence_parallel`` so megatron all-reduces its gradient over TP when sequence parallelism is on
  (the local spec's torch norm refuses sequence parallelism).
- ``CoreAttention``: causal attention through the selected ``AttentionKernel`` (varlen), for packed THD
  input (``PackedSeqParams``) and for ``[s, b, h, d]`` input; GQA is left to the kernel. Under context
  parallelism it gathers K/V over the CP group (``context_parallel.cp_attention``).
- ``layer_spec``: the GPT layer spec with these plugged in, or the Transformer Engine spec when
  ``transformer_engine`` is importable.
- ``mark_tensor_parallel``: the TP attributes megatron sets only when it initialises weights itself.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from underlay.interfaces import InvalidInput

__all__ = ["CoreAttention", "RMSNorm", "block_spec", "have_te", "mark_tensor_parallel"]


def have_te() -> bool:
    """Whether Transformer Engine is importable (its layer specs are used then)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


class RMSNorm(torch.nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` with the statistics in fp32, as Hugging Face computes it.

    Megatron's norm constructor signature ``(config, hidden_size, eps)``."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hidden]`` -> same shape and dtype."""
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _core_attention_class() -> type:
    from megatron.core.transformer.module import MegatronModule

    class CoreAttentionImpl(MegatronModule):  # type: ignore[misc]
        """Causal softmax attention over q ``[t, hq, d]`` / k, v ``[t, hk, d]`` (THD with
        ``packed_seq_params``) or ``[s, b, h, d]``; returns ``[t, hq * d]`` or ``[s, b, hq * d]``."""

        def __init__(
            self,
            config: Any,
            layer_number: int,
            attn_mask_type: Any,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection: Any = None,
            kernel: str | None = None,
        ) -> None:
            super().__init__(config=config)
            self.softmax_scale = softmax_scale
            self.kernel_name = kernel
            self._kernel: Any = None
            cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            if cp_group is None and int(getattr(config, "context_parallel_size", 1)) > 1:
                from megatron.core import parallel_state

                cp_group = parallel_state.get_context_parallel_group()
            self.cp_group = cp_group
            self.cp_size = torch.distributed.get_world_size(cp_group) if cp_group is not None else 1

        def _get_kernel(self) -> Any:
            if self._kernel is None:
                from underlay.registry import get_attention

                self._kernel = get_attention(self.kernel_name)
            return self._kernel

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Any,
            attn_mask_type: Any = None,
            attention_bias: Any = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            kernel = self._get_kernel()
            if self.cp_size > 1:
                return self._context_parallel(kernel, query, key, value, packed_seq_params)
            if packed_seq_params is not None:
                cu_q = packed_seq_params.cu_seqlens_q.to(torch.int32)
                cu_k = packed_seq_params.cu_seqlens_kv.to(torch.int32)
                out = kernel.varlen(
                    query,
                    key,
                    value,
                    cu_q,
                    cu_k,
                    int(packed_seq_params.max_seqlen_q),
                    int(packed_seq_params.max_seqlen_kv),
                    causal=True,
                    scale=self.softmax_scale,
                )
                result: torch.Tensor = out.reshape(out.shape[0], -1)
                return result
            s, b = query.shape[:2]
            q = query.transpose(0, 1).reshape(b * s, *query.shape[2:])
            k = key.transpose(0, 1).reshape(b * s, *key.shape[2:])
            v = value.transpose(0, 1).reshape(b * s, *value.shape[2:])
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
            out = kernel.varlen(q, k, v, cu, cu, s, s, causal=True, scale=self.softmax_scale)
            result = out.reshape(b, s, -1).transpose(0, 1).contiguous()
            return result

        def _context_parallel(
            self, kernel: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: Any
        ) -> torch.Tensor:
            """Under context parallelism: THD input split by ``context_parallel.split_packed`` (its
            ``cu_seqlens_q_padded`` are the global padded lengths); ``[t, hq * dv]`` out."""
            from underlay.engines.mcore.context_parallel import cp_attention

            cu = getattr(packed, "cu_seqlens_q_padded", None)
            if packed is None or packed.qkv_format != "thd" or cu is None:
                raise InvalidInput(
                    "mcore attention under context parallelism takes packed THD input with "
                    "PackedSeqParams.cu_seqlens_q_padded (the global padded lengths); build the "
                    "micro-batch with underlay.engines.mcore.context_parallel.split_packed"
                )
            out = cp_attention(
                kernel, query, key, value, cu, self.cp_group, scale=self.softmax_scale, cache=packed
            )
            result: torch.Tensor = out.reshape(out.shape[0], -1)
            return result

    return CoreAttentionImpl


CoreAttention: Any = None  # the class, built on first use (megatron is imported lazily)


def block_spec(arch: Any, config: Any, *, attention: str | None, vp_stage: int | None) -> Any:
    """The decoder block spec of one pipeline chunk: Transformer Engine's GPT layer spec when TE is
    installed, else megatron's local spec with ``RMSNorm`` and ``CoreAttention`` (kernel ``attention``,
    ``None`` = the registry's choice) plugged in, and ``RMSNorm`` as the final norm."""
    global CoreAttention
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    num_experts = arch.num_experts or None
    if have_te():
        layer = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm
        )
        return layer
    if CoreAttention is None:
        CoreAttention = _core_attention_class()
    layer = specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
    )
    sub = layer.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    att = sub.self_attention.submodules
    att.core_attention = ModuleSpec(module=CoreAttention, params={"kernel": attention})
    if arch.qk_norm:
        att.q_layernorm = RMSNorm
        att.k_layernorm = RMSNorm
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=RMSNorm)


_TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def mark_tensor_parallel(model: torch.nn.Module) -> int:
    """Give the TP-sharded weights of megatron's own parallel layers in ``model`` the attributes
    ``tensor_model_parallel=True``, ``partition_dim`` and ``partition_stride``; returns how many
    weights were marked.

    Why: megatron-core sets these attributes on the weights of ``ColumnParallelLinear``,
    ``RowParallelLinear`` and ``VocabParallelEmbedding`` only inside its weight initialisation, which
    the engine turns off (``perform_initialization=False``: the weights come from the HF checkpoint).
    Without them megatron's optimizer treats every TP shard as a replica
    (``param_is_not_tensor_parallel_duplicate``) and counts only TP rank 0's shard in the global
    gradient norm, so the reported norm, and the clipping that uses it, depend on the TP size.
    Weights that already carry the attributes (Transformer Engine layers, a megatron that
    initialised them) are left as they are. Partition dims follow megatron: dim 0 for column-parallel
    and vocab-parallel weights, dim 1 for row-parallel ones; stride 2 for a gated MLP's ``linear_fc1``
    (its per-rank [gate; up] interleave), 1 otherwise."""
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )
    from megatron.core.transformer.mlp import MLP

    gated_fc1: set[int] = set()
    for module in model.modules():
        if isinstance(module, MLP) and module.config.gated_linear_unit:
            gated_fc1.add(id(module.linear_fc1))
    marked = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or any(hasattr(weight, a) for a in _TP_ATTRIBUTES):
            continue
        stride = 2 if id(module) in gated_fc1 else 1
        set_tensor_model_parallel_attributes(weight, True, dim, stride)
        marked += 1
    return marked
