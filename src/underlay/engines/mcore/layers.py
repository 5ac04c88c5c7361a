"""Modules underlay supplies to megatron-core's local (non-TE) layer spec.

- ``RMSNorm``: HF's RMSNorm (fp32 statistics, weight applied in the input dtype); its weight carries
  ``sequence_parallel`` so megatron all-reduces its gradient over TP when sequence parallelism is on
  (the local spec's torch norm refuses sequence parallelism).
- ``CoreAttention``: causal attention through the selected ``AttentionKernel`` (varlen), for packed THD
  input (``PackedSeqParams``) and for ``[s, b, h, d]`` input; GQA is left to the kernel. Under context
  parallelism it gathers K/V over the CP group (``context_parallel.cp_attention``). It applies RoPE to
  q/k first (after megatron's q/k norm), vectorized over the packed micro-batch (``rope``), with the
  HF config's scaled inverse frequencies when it has them, and each layer's sliding window.
- ``layer_spec``: the GPT layer spec with these plugged in, or the Transformer Engine spec when
  ``transformer_engine`` is importable.
- ``mark_tensor_parallel``: the TP attributes megatron sets only when it initialises weights itself.
- ``ValueHead``: a value model's token-classification head in the place of ``GPTModel.output_layer``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from underlay.interfaces import AttentionKernel, ConfigError, InvalidInput
from underlay.utils import env

__all__ = [
    "DEVICE_CU_ATTR",
    "CoreAttention",
    "RMSNorm",
    "ValueHead",
    "block_spec",
    "fused_kernel",
    "have_te",
    "kernel_cu_seqlens",
    "mark_tensor_parallel",
    "position_embedding_type",
    "rms_norm",
]


def have_te() -> bool:
    """Whether Transformer Engine is importable (its layer specs are used then)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis with the statistics in fp32, cast back
    to ``x``'s dtype before the weight (Hugging Face's order). ``x [..., hidden]``, ``weight [hidden]``."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_kernel(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled with ``torch.compile(dynamic=True)`` (one graph for every token count; the
    elementwise chain becomes one kernel forward and one or two backward), once per process and
    backend (``UNDERLAY_COMPILE_BACKEND``, the engines' compile backend; the engine checks it when it
    is built). Used by the layers when the engine enables ``fused_elementwise``; the numbers are
    ``fn``'s up to reassociation inside the fused kernel."""
    return _compiled(fn, env.get("UNDERLAY_COMPILE_BACKEND"))


@functools.cache
def _compiled(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    compiled: Callable[..., Any] = torch.compile(fn, dynamic=True, backend=backend)
    return compiled


class RMSNorm(torch.nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` with the statistics in fp32, as Hugging Face computes it
    (``rms_norm``); with ``fused`` through one compiled kernel (``fused_kernel``).

    Megatron's norm constructor signature ``(config, hidden_size, eps)``."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, fused: bool = False) -> None:
        super().__init__()
        self.eps = float(eps)
        self.fused = bool(fused)
        # the compiled function resolved once here, not on every forward
        self._compiled = fused_kernel(rms_norm) if self.fused else None
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hidden]`` -> same shape and dtype."""
        if self._compiled is None:
            return rms_norm(x, self.weight, self.eps)
        # one compiled graph for the [s, b, H] hidden states and the [t, heads, d] q/k norms alike
        out: torch.Tensor = self._compiled(x.reshape(-1, x.shape[-1]), self.weight, self.eps)
        return out.view(x.shape)


class ValueHead(torch.nn.Module):
    """A value model's head, installed as the last stage's ``GPTModel.output_layer``: per-token values
    ``hidden @ weight.T + bias`` (Hugging Face's ``*ForTokenClassification.score`` with
    ``num_labels=1``), after a dropout of rate ``dropout`` in training mode (transformers applies its
    ``nn.Dropout`` there too; evaluation applies none).

    ``weight [1, hidden]`` and ``bias [1]`` are replicated over TP (one output cannot be split) and
    over CP (each CP rank scores its own chunks of the sequences; the engine gathers the values over CP,
    and megatron's DDP sums every replicated parameter's gradient over dp x cp).
    Without sequence parallelism every TP rank holds the whole sequence and computes the same values;
    with it each rank scores its sequence slice and the ``[s, b, 1]`` values (not the ``[s, b, H]``
    hidden states) are gathered; the parameters then carry ``sequence_parallel=True`` so megatron's
    ``finalize_model_grads`` sums their slice gradients over TP, as it does for the norms.

    With LoRA on ``score`` its term (``lora.delta`` of the same dropped-out hidden states) is added
    before the gather.

    Dropout masks come from a generator seeded with ``seed`` and a per-call counter, so every TP rank
    draws the same mask for the same micro-batch independently of torch's global RNG state (a mask
    that differed across TP ranks would give replicated parameters different gradients); the engine
    passes a seed that differs across data-parallel and context-parallel ranks (and across TP ranks
    under sequence parallelism): each of those holds different tokens."""

    def __init__(
        self, config: Any, hidden_size: int, *, bias: bool, dropout: float, seed: int, tp_group: Any
    ) -> None:
        super().__init__()
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None
        self.sequence_parallel = bool(config.sequence_parallel)
        for p in self.parameters():
            p.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
        self.dropout = float(dropout)
        self.seed = int(seed)
        self.calls = 0
        self._tp_group = tp_group
        self.lora: Any = None  # LoRA on ``score`` (``mcore.lora.LoraAdapter``), set by the engine

    def forward(
        self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        """``hidden [s, b, H]`` (``s`` this rank's slice under sequence parallelism) -> ``(values [S,
        b, 1], None)`` with ``S`` the whole sequence, in ``hidden``'s dtype; ``weight`` and
        ``runtime_gather_output`` (``GPTModel``'s output-layer arguments) are unused."""
        if self.training and self.dropout > 0:
            gen = torch.Generator(device=hidden.device)
            gen.manual_seed(self.seed * 1_000_003 + self.calls)
            self.calls += 1
            draw = torch.rand(hidden.shape, generator=gen, device=hidden.device, dtype=torch.float32)
            hidden = hidden * (draw >= self.dropout).to(hidden.dtype) / (1.0 - self.dropout)
        values = torch.nn.functional.linear(hidden, self.weight, self.bias)
        if self.lora is not None and self.lora.enabled:
            values = values + self.lora.delta(hidden).to(values.dtype)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False, group=self._tp_group
            )
        return values, None


DEVICE_CU_ATTR = "underlay_device_copy"
"""Attribute of a host ``cu_seqlens`` in ``PackedSeqParams`` holding its device copy (int32). The
engine gives megatron host ``cu_seqlens`` with the local spec: megatron's unfused THD RoPE reads the
lengths with ``tolist()`` in every layer (a device synchronisation each time were they on the device);
``CoreAttention`` takes the device copy for the kernel."""


def kernel_cu_seqlens(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The int32 ``cu_seqlens`` on ``device`` for the attention kernel: the device copy the engine
    attached to a host tensor (``DEVICE_CU_ATTR``), else the tensor itself (moved when elsewhere)."""
    attached = getattr(cu_seqlens, DEVICE_CU_ATTR, None)
    if isinstance(attached, torch.Tensor) and attached.device == device:
        return attached
    return cu_seqlens.to(device=device, dtype=torch.int32)


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
            kernel: str | AttentionKernel | None = None,
            rotary_base: float | None = None,
            fused_rope: bool = False,
            inv_freq: tuple[float, ...] | None = None,
            windows: tuple[int | None, ...] = (),
            k_channels: int | None = None,
            v_channels: int | None = None,
        ) -> None:
            # k_channels/v_channels: MLA's q/k and v head widths (the kernel reads them off q and v)
            super().__init__(config=config)
            self.softmax_scale = softmax_scale
            self.fused_rope = bool(fused_rope)
            from underlay.engines.mcore.rope import apply_rope

            # the rotation, compiled when fused: resolved once here, not on every forward
            self._rope_fn = fused_kernel(apply_rope) if self.fused_rope else apply_rope
            # a registry name (None: the registry's choice), or a kernel the caller built
            self.kernel_name = kernel if kernel is None or isinstance(kernel, str) else None
            self._kernel: Any = None if kernel is None or isinstance(kernel, str) else kernel
            cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            if cp_group is None and int(getattr(config, "context_parallel_size", 1)) > 1:
                from megatron.core import parallel_state

                cp_group = parallel_state.get_context_parallel_group()
            self.cp_group = cp_group
            self.cp_size = torch.distributed.get_world_size(cp_group) if cp_group is not None else 1
            self.cp_rank = torch.distributed.get_rank(cp_group) if cp_group is not None else 0
            # RoPE is applied here (GPTModel is built with position_embedding_type="none", see
            # ``position_embedding_type``): vectorized over the packed micro-batch, see ``rope``
            self._inv_freq: torch.Tensor | None = None
            if inv_freq is not None:  # a scaled RoPE: transformers' own inverse frequencies (fp32)
                self._inv_freq = torch.tensor(inv_freq, dtype=torch.float32)
            elif rotary_base is not None:
                from underlay.engines.mcore.rope import rope_inv_freq

                self._inv_freq = rope_inv_freq(config, rotary_base)
            # transformers' sliding window w: query i sees key j when 0 <= i - j < w, i.e. the kernel's
            # (left, right) = (w - 1, 0); ``layer_number`` is megatron's global 1-based layer index
            w = windows[layer_number - 1] if windows else None
            self.window: tuple[int, int] | None = None if w is None else (int(w) - 1, 0)

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
            if self._inv_freq is not None:
                query, key = self._rotate(query, key, packed_seq_params)
            if self.cp_size > 1:
                return self._context_parallel(kernel, query, key, value, packed_seq_params)
            if packed_seq_params is not None:
                cu_q = kernel_cu_seqlens(packed_seq_params.cu_seqlens_q, query.device)
                cu_k = kernel_cu_seqlens(packed_seq_params.cu_seqlens_kv, query.device)
                out = kernel.varlen(
                    query,
                    key,
                    value,
                    cu_q,
                    cu_k,
                    int(packed_seq_params.max_seqlen_q),
                    int(packed_seq_params.max_seqlen_kv),
                    causal=True,
                    window=self.window,
                    scale=self.softmax_scale,
                )
                result: torch.Tensor = out.reshape(out.shape[0], -1)
                return result
            s, b = query.shape[:2]
            q = query.transpose(0, 1).reshape(b * s, *query.shape[2:])
            k = key.transpose(0, 1).reshape(b * s, *key.shape[2:])
            v = value.transpose(0, 1).reshape(b * s, *value.shape[2:])
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
            out = kernel.varlen(
                q, k, v, cu, cu, s, s, causal=True, window=self.window, scale=self.softmax_scale
            )
            result = out.reshape(b, s, -1).transpose(0, 1).contiguous()
            return result

        def _rotate(
            self, query: torch.Tensor, key: torch.Tensor, packed: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """RoPE on q ``[t, hq, d]`` / k ``[t, hk, d]`` (THD: positions restart at every sequence of
            ``cu_seqlens_q(_padded)``, CP-local under context parallelism) or ``[s, b, h, d]``
            (positions ``0 .. s - 1``). cos/sin are computed once per micro-batch and cached on its
            ``PackedSeqParams`` (every layer of every chunk reuses them)."""
            from underlay.engines.mcore.rope import rope_cos_sin

            assert self._inv_freq is not None
            rope = _partial(self._rope_fn)
            if packed is None:
                pos = torch.arange(query.shape[0], device=query.device)
                cos, sin = rope_cos_sin(pos, self._device_inv_freq(query.device), query.dtype)
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [s, 1, 1, d]
                return rope(query, cos, sin), rope(key, cos, sin)
            cu_q = (
                packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
            )
            cu_k = (
                packed.cu_seqlens_kv_padded
                if packed.cu_seqlens_kv_padded is not None
                else packed.cu_seqlens_kv
            )
            cos_q, sin_q = self._packed_cos_sin(packed, cu_q, query)
            cos_k, sin_k = (cos_q, sin_q) if cu_k is cu_q else self._packed_cos_sin(packed, cu_k, key)
            return rope(query, cos_q, sin_q), rope(key, cos_k, sin_k)

        def _device_inv_freq(self, device: torch.device) -> torch.Tensor:
            """The inverse frequencies on ``device``, moved there once (a host-to-device copy per
            micro-batch would stall the host behind the queued kernels)."""
            assert self._inv_freq is not None
            if self._inv_freq.device != device:
                self._inv_freq = self._inv_freq.to(device)
            return self._inv_freq

        def _packed_cos_sin(
            self, packed: Any, cu: torch.Tensor, x: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            from underlay.engines.mcore.rope import packed_positions, rope_cos_sin

            assert self._inv_freq is not None
            cache: dict[Any, tuple[torch.Tensor, torch.Tensor]] | None = getattr(
                packed, "underlay_rope", None
            )
            if cache is None:
                cache = {}
                packed.underlay_rope = cache
            # ``cu`` lives as long as ``packed``, so its id is a stable key; the inverse frequencies
            # are the model's (one rotary base per engine, and every micro-batch is engine-owned)
            key = (id(cu), x.shape[0], x.dtype, x.device, self.cp_size, self.cp_rank)
            hit = cache.get(key)
            if hit is None:
                pos = packed_positions(
                    kernel_cu_seqlens(cu, x.device), x.shape[0], self.cp_size, self.cp_rank
                )
                hit = rope_cos_sin(pos, self._device_inv_freq(x.device), x.dtype)
                cache[key] = hit
            return hit

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


@functools.cache
def _mla_class() -> type:
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class UnderlayMLASelfAttention(MLASelfAttention):  # type: ignore[misc]
        """megatron's ``MLASelfAttention`` whose column-parallel kv down projection hands back the
        whole ``[kv_lora_rank + qk_pos_emb_head_dim]`` output (gathered over TP, then this rank's
        sequence slice under sequence parallelism), as a replicated projection would.

        Why: with the split output megatron gathers it itself and uses the shared rotary key part
        (``k_pos_emb``) for this rank's heads only; the gather's backward keeps this rank's columns of
        the gradient, so the rotary key's gradient from the other ranks' heads is lost (gradients 2%
        off at TP=2). On the replicated path megatron all-gathers ``k_pos_emb`` along the sequence,
        whose backward sums it over the TP ranks. Sequence parallelism is required (the engine
        requires it for MoE under TP, and deepseek_v3 has MoE layers)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if torch.distributed.get_world_size(self.tp_group) == 1:
                return
            if not self.config.sequence_parallel:
                raise ConfigError("mcore: multi-latent attention under tp > 1 needs sequence_parallel=True")
            proj = self.linear_kv_down_proj
            inner = proj.forward
            group = self.tp_group

            def forward(x: torch.Tensor, *a: Any, **kw: Any) -> Any:
                out, bias = inner(x, *a, **kw)
                full = gather_from_tensor_model_parallel_region(out, group=group)
                return scatter_to_sequence_parallel_region(full, group=group), bias

            proj.forward = forward  # keeps the parameter names (linear_kv_down_proj.weight)

    return UnderlayMLASelfAttention


def _mla_without_te() -> None:
    """megatron-core 0.16.1's ``multi_latent_attention`` sets ``HAVE_TE = True`` when its import of
    megatron's TE extension module succeeds, which it does without Transformer Engine (the extension
    then binds ``TELinear = None``); ``MLASelfAttention`` then calls ``isinstance(x, None)``. Its
    ``HAVE_TE`` only selects TE's fp8/fp4 output saving, so it is set to ``False`` when ``TELinear`` is
    not a class. Touches nothing with Transformer Engine installed."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False


def _partial(rope: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``rope(x, cos, sin)`` on the first ``cos.shape[-1]`` dimensions of each head, the rest of
    ``x`` unchanged (transformers' partial rotary embedding); ``rope`` itself on whole heads."""

    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = cos.shape[-1]
        if r == x.shape[-1]:
            return rope(x, cos, sin)
        return torch.cat([rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    return apply


def position_embedding_type() -> str:
    """``GPTModel``'s ``position_embedding_type``: ``"rope"`` with Transformer Engine (its layers apply
    RoPE, fused), else ``"none"``: ``CoreAttention`` then applies RoPE itself, vectorized over the
    packed micro-batch (megatron's unfused THD RoPE loops over the sequences)."""
    return "rope" if have_te() else "none"


def block_spec(
    arch: Any,
    config: Any,
    *,
    attention: str | AttentionKernel | None,
    vp_stage: int | None,
    fused_elementwise: bool = False,
) -> Any:
    """The decoder block spec of one pipeline chunk: Transformer Engine's GPT layer spec when TE is
    installed, else megatron's local spec with ``RMSNorm`` and ``CoreAttention`` (kernel ``attention``: a
    registry name, ``None`` = the registry's choice, or a kernel object the caller built) plugged in, and
    ``RMSNorm`` as the final norm. ``fused_elementwise``: the norms and the RoPE rotation run as compiled kernels (``fused_kernel``)."""
    global CoreAttention
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    num_experts = arch.num_experts or None
    if have_te():
        if arch.inv_freq is not None or arch.windows or arch.first_dense or arch.is_mla:
            raise ConfigError(
                "mcore with Transformer Engine: scaled or partial RoPE, sliding windows, dense layers "
                "in an MoE stack and multi-latent attention are built by underlay's local spec only; uninstall "
                "transformer_engine or use the fsdp2 engine for this model"
            )
        layer = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm
        )
        return layer
    if CoreAttention is None:
        CoreAttention = _core_attention_class()
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    norm = ModuleSpec(module=RMSNorm, params={"fused": fused_elementwise})
    rotary_base = int(arch.rope_theta) if float(arch.rope_theta).is_integer() else float(arch.rope_theta)

    def local(experts: int | None) -> Any:
        layer = specs.get_gpt_layer_local_spec(
            num_experts=experts,
            moe_grouped_gemm=False,
            qk_layernorm=arch.qk_norm or arch.is_mla,
            multi_latent_attention=arch.is_mla,
            normalization="RMSNorm",
        )
        sub = layer.submodules
        sub.input_layernorm = norm
        sub.pre_mlp_layernorm = norm
        att = sub.self_attention.submodules
        att.core_attention = ModuleSpec(
            module=CoreAttention,
            params={
                "kernel": attention,
                # megatron's MLA applies RoPE itself (to the rotary part of q/k, per packed sequence)
                "rotary_base": None if arch.is_mla else rotary_base,
                "fused_rope": fused_elementwise,
                "inv_freq": arch.inv_freq,
                "windows": arch.windows,
            },
        )
        if arch.is_mla:  # q_a_layernorm (only with a q LoRA rank) and kv_a_layernorm
            if arch.q_lora_rank:
                att.q_layernorm = norm
            att.kv_layernorm = norm
            sub.self_attention.module = _mla_class()
        elif arch.qk_norm:
            att.q_layernorm = norm
            att.k_layernorm = norm
        return layer

    if arch.is_mla:
        _mla_without_te()
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    if not arch.first_dense:
        return TransformerBlockSubmodules(layer_specs=[local(num_experts)] * n, layer_norm=norm)
    # dense MLPs on the first ``first_dense`` layers of an MoE model (global layer indices)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    moe, dense = local(num_experts), local(None)
    specs_ = [moe if arch.moe_layer(offset + i) else dense for i in range(n)]
    return TransformerBlockSubmodules(layer_specs=specs_, layer_norm=norm)


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
