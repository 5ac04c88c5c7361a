"""Hugging Face config -> megatron-core ``TransformerConfig`` + ``GPTModel`` arguments.

Supported families: ``llama``, ``mistral``, ``qwen2`` (q/k/v bias), ``qwen3`` (q/k RMSNorm, ``head_dim``
independent of ``hidden / heads``), ``qwen3_moe`` (softmax top-k router, routed experts on every
layer), ``mixtral`` (per-expert ``w1``/``w3``/``w2`` on disk), ``qwen2_moe`` (a shared expert behind a
sigmoid gate) and ``glm4_moe`` (leading dense layers, a shared expert, a sigmoid router whose top-k is
chosen with the ``e_score_correction_bias`` buffer, optionally group-limited, scaled weights; partial
RoPE), with or without tied embeddings; RoPE plain or with the static scalings ``linear`` and
``llama3`` (inverse frequencies computed as transformers computes them, ``MCoreArch.inv_freq``);
sliding-window attention per layer (``MCoreArch.windows``, transformers' window semantics). What the
conversion cannot represent exactly (another RoPE scaling type, an activation, a bias pattern, dense
layers in qwen MoE stacks, multi-latent attention, group-limited routing other than megatron's) is
refused with ``ConfigError`` naming it, so a converted model always computes what the HF model computes.

The functions here are pure: they read the HF config and the requested sizes and never touch
megatron's global parallel state (``check_layout`` runs before any process group exists).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from underlay.interfaces import ConfigError

__all__ = [
    "MCoreArch",
    "arch_of",
    "check_expert_tp",
    "check_layout",
    "check_training_randomness",
    "config_class",
    "padded_vocab_size",
    "transformer_config_keys",
    "transformer_config_kwargs",
    "value_arch",
    "with_padded_vocab",
]

SUPPORTED = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
)

_REFUSED: dict[str, str] = {}

_STATIC_ROPE = ("default", "linear", "llama3")
"""RoPE types whose inverse frequencies do not depend on the sequence and whose cos/sin are unscaled
(transformers' ``attention_factor`` is 1): the engine applies them from ``MCoreArch.inv_freq``."""


@dataclass(frozen=True)
class MCoreArch:
    """The architecture facts the conversion and the weight map need (all from the HF config).

    ``head_dim`` is the per-head width (``kv_channels``), ``num_query_groups`` the number of k/v heads;
    ``num_experts``/``moe_topk``/``moe_ffn`` are 0 for dense models. ``value_head``: a value model
    (``ModelConfig.kind="value"``, see ``value_arch``): the last stage ends in the token-classification
    head ``score`` (``[1, hidden]`` weight, a ``[1]`` bias when ``value_bias``, dropout
    ``value_dropout`` on its input in training) instead of the vocabulary output layer; ``tied`` is
    then ``False`` (no output layer shares the embedding).
    """

    model_type: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    num_query_groups: int
    head_dim: int
    vocab: int
    max_positions: int
    rope_theta: float
    norm_eps: float
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn: int = 0
    norm_topk_prob: bool = True
    value_head: bool = False
    value_bias: bool = True
    value_dropout: float = 0.0
    inv_freq: tuple[float, ...] | None = None
    windows: tuple[int | None, ...] = ()
    shared_ffn: int = 0
    shared_gate: bool = False
    padded_vocab: int = 0
    first_dense: int = 0
    router: str = "softmax"
    expert_bias: bool = False
    num_groups: int = 1
    group_topk: int = 1
    routed_scaling: float = 1.0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are routed experts."""
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (deepseek_v3): ``head_dim`` is the non-rotary q/k part of a head,
        ``qk_rope_dim`` its rotary part, ``v_head_dim`` the value width; ``q_lora_rank`` 0 means a
        plain q projection."""
        return self.kv_lora_rank > 0

    def moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has routed experts (the first ``first_dense`` layers
        of an MoE model are dense MLPs)."""
        return self.is_moe and layer >= self.first_dense

    @property
    def vocab_rows(self) -> int:
        """Rows of the engine's embedding and output layer: ``padded_vocab`` (a multiple of the TP
        size, set by ``with_padded_vocab``) or ``vocab`` when nothing is padded."""
        return max(self.padded_vocab, self.vocab)

    def window(self, layer: int) -> int | None:
        """Sliding window of global layer ``layer`` (0-based) as transformers counts it (query ``i``
        sees key ``j`` when ``0 <= i - j < window``), or ``None`` for full causal attention."""
        return self.windows[layer] if self.windows else None


def _rope(cfg: Any) -> tuple[float, tuple[float, ...] | None]:
    """``(rope_theta, inv_freq)``: ``inv_freq`` is ``None`` for plain RoPE (megatron's own inverse
    frequencies, equal to transformers'), else the float32 values transformers computes for a static
    scaling (``_STATIC_ROPE``, through its ``ROPE_INIT_FUNCTIONS``) or a partial rotary factor
    (``rotary_dim // 2`` values: RoPE on the first ``rotary_dim = int(head_dim *
    partial_rotary_factor)`` dimensions of each head)."""
    params = getattr(cfg, "rope_parameters", None)
    scaling = getattr(cfg, "rope_scaling", None)
    rope_type = "default"
    theta = getattr(cfg, "rope_theta", None)
    partial = float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0)
    if isinstance(params, dict):
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        theta = params.get("rope_theta", theta)
        partial = float(params.get("partial_rotary_factor", partial))
    if isinstance(scaling, dict) and scaling:
        rope_type = str(scaling.get("rope_type", scaling.get("type", rope_type)))
    if rope_type not in _STATIC_ROPE:
        raise ConfigError(
            f"mcore: rope scaling type {rope_type!r} cannot be converted (supported: {_STATIC_ROPE}: "
            "static inverse frequencies, unscaled cos/sin); use the fsdp2 engine for this model"
        )
    if theta is None:
        raise ConfigError("mcore: the HF config has no rope_theta (rope_parameters['rope_theta'])")
    if rope_type == "default" and partial == 1.0:
        return float(theta), None
    if rope_type == "default":  # transformers' default RoPE over the first int(head_dim * partial) dims
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        dim = int(head_dim * partial)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        inv = 1.0 / (float(theta) ** exponent)
        return float(theta), tuple(float(x) for x in inv.tolist())
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    if float(attention_factor) != 1.0:
        raise ConfigError(
            f"mcore: rope_type {rope_type!r} with attention_factor={attention_factor} (scaled cos/sin) "
            "is not converted"
        )
    return float(theta), tuple(float(x) for x in inv_freq.to(torch.float32).tolist())


def _windows(cfg: Any, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows as transformers applies them: ``layer_types`` when the config has it
    (``"sliding_attention"`` layers get ``sliding_window``), else ``sliding_window`` on every layer
    (mistral, mixtral) unless ``use_sliding_window`` is false. ``()`` when no layer is windowed."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ConfigError(
                f"mcore: layer_types {unknown}: only full_attention and sliding_attention layers"
            )
        if "sliding_attention" not in layer_types:
            return ()
        if not window or int(window) < 1:
            raise ConfigError(f"mcore: sliding_attention layers with sliding_window={window!r}")
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if window is None or not bool(getattr(cfg, "use_sliding_window", True)):
        return ()
    if int(window) < 1:
        raise ConfigError(f"mcore: sliding_window={window!r} must be >= 1 or None")
    return (int(window),) * num_layers


def arch_of(hf_config: Any) -> MCoreArch:
    """Read and validate the architecture of ``hf_config`` (a ``transformers`` config).

    Raises ``ConfigError`` naming the unsupported model type, activation, bias pattern, RoPE scaling,
    sliding window or MoE feature."""
    cfg = hf_config
    mt = str(getattr(cfg, "model_type", ""))
    if mt in _REFUSED:
        raise ConfigError(f"mcore: model_type {mt!r}: {_REFUSED[mt]}; use the fsdp2 engine")
    if mt not in SUPPORTED:
        raise ConfigError(
            f"mcore: model_type {mt!r} is not supported; supported: {SUPPORTED} (use the fsdp2 engine)"
        )
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"mcore: activation {act!r} cannot be converted (only 'silu' SwiGLU MLPs)")
    if getattr(cfg, "mlp_bias", False):
        raise ConfigError("mcore: mlp_bias=True (bias on the MLP projections) is not supported")
    attn_bias = bool(getattr(cfg, "attention_bias", False))
    if mt in ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe") and attn_bias:
        raise ConfigError(
            f"mcore: attention_bias=True on {mt} puts a bias on o_proj too; megatron's bias pattern "
            "(q/k/v bias only, add_qkv_bias) cannot represent it"
        )
    max_pos = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    windows = _windows(cfg, int(cfg.num_hidden_layers))
    theta, inv_freq = _rope(cfg)
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    num_experts = 0
    topk = 0
    moe_ffn = 0
    norm_topk = True
    shared_ffn = 0
    if mt in ("qwen3_moe", "qwen2_moe", "mixtral"):
        num_experts = int(cfg.num_local_experts if mt == "mixtral" else cfg.num_experts)
        topk = int(cfg.num_experts_per_tok)
        # mixtral's experts are as wide as its intermediate_size; it always renormalises the top-k
        moe_ffn = int(cfg.intermediate_size if mt == "mixtral" else cfg.moe_intermediate_size)
        norm_topk = True if mt == "mixtral" else bool(getattr(cfg, "norm_topk_prob", True))
        if getattr(cfg, "mlp_only_layers", None):
            raise ConfigError(
                f"mcore: {mt} with dense mlp_only_layers={cfg.mlp_only_layers} is not supported "
                "(every layer must be an MoE layer)"
            )
        if int(getattr(cfg, "decoder_sparse_step", 1)) != 1:
            raise ConfigError(
                f"mcore: {mt} decoder_sparse_step={cfg.decoder_sparse_step}: only 1 (every layer MoE)"
            )
        shared_ffn = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        if shared_ffn and mt != "qwen2_moe":
            raise ConfigError(f"mcore: shared experts on {mt} are not converted")
    router = _Router()
    mla = (0, 0, 0, 0)  # q_lora_rank, kv_lora_rank, qk_rope_dim, v_head_dim
    if mt == "deepseek_v3":
        mla = _mla(cfg, inv_freq)
        kv = heads
        head_dim = int(cfg.qk_nope_head_dim)
    if mt in ("glm4_moe", "deepseek_v3"):
        num_experts = int(cfg.n_routed_experts)
        topk = int(cfg.num_experts_per_tok)
        moe_ffn = int(cfg.moe_intermediate_size)
        shared_ffn = moe_ffn * int(getattr(cfg, "n_shared_experts", 0) or 0)
        norm_topk = bool(getattr(cfg, "norm_topk_prob", True))
        router = _sigmoid_router(cfg, num_experts, topk, norm_topk)
    return MCoreArch(
        model_type=mt,
        num_layers=int(cfg.num_hidden_layers),
        hidden=int(cfg.hidden_size),
        ffn=int(getattr(cfg, "intermediate_size", 0) or 0),
        heads=heads,
        num_query_groups=kv,
        head_dim=head_dim,
        vocab=int(cfg.vocab_size),
        max_positions=max_pos or 4096,
        rope_theta=theta,
        norm_eps=float(cfg.rms_norm_eps),
        tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2"
        or (mt == "qwen2_moe" and bool(getattr(cfg, "qkv_bias", True)))
        or (mt == "glm4_moe" and attn_bias),
        qk_norm=mt in ("qwen3", "qwen3_moe")
        or (mt == "glm4_moe" and bool(getattr(cfg, "use_qk_norm", False))),
        num_experts=num_experts,
        moe_topk=topk,
        moe_ffn=moe_ffn,
        norm_topk_prob=norm_topk,
        inv_freq=inv_freq,
        windows=windows,
        shared_ffn=shared_ffn,
        shared_gate=shared_ffn > 0 and mt == "qwen2_moe",
        first_dense=router.first_dense,
        router=router.kind,
        expert_bias=router.expert_bias,
        num_groups=router.num_groups,
        group_topk=router.group_topk,
        routed_scaling=router.scaling,
        q_lora_rank=mla[0],
        kv_lora_rank=mla[1],
        qk_rope_dim=mla[2],
        v_head_dim=mla[3],
    )


def _mla(cfg: Any, inv_freq: tuple[float, ...] | None) -> tuple[int, int, int, int]:
    """deepseek_v3's multi-latent attention sizes ``(q_lora_rank, kv_lora_rank, qk_rope_dim,
    v_head_dim)`` for ``MCoreArch``. megatron-core's
    ``MLASelfAttention`` computes transformers' attention exactly with plain RoPE on interleaved
    weights (``rope_interleave=True``, transformers' default: megatron de-interleaves the rotary part
    the same way) and no projection biases; the rest is refused by name."""
    if inv_freq is not None:
        raise ConfigError(
            "mcore: deepseek_v3 with a scaled RoPE (rope_parameters rope_type != 'default', e.g. yarn): "
            "megatron-core's MLA applies its own YaRN, not verified equal to transformers'; use the "
            "fsdp2 engine"
        )
    if not bool(getattr(cfg, "rope_interleave", True)):
        raise ConfigError(
            "mcore: deepseek_v3 with rope_interleave=False: megatron-core's MLA always de-interleaves the "
            "rotary part of q/k; not converted"
        )
    if bool(getattr(cfg, "attention_bias", False)):
        raise ConfigError("mcore: deepseek_v3 with attention_bias=True (q_a/kv_a biases) is not converted")
    return (
        int(getattr(cfg, "q_lora_rank", None) or 0),
        int(cfg.kv_lora_rank),
        int(cfg.qk_rope_head_dim),
        int(cfg.v_head_dim),
    )


def config_class(arch: MCoreArch) -> Any:
    """megatron-core's config class for ``arch``: ``MLATransformerConfig`` for multi-latent attention,
    else ``TransformerConfig``."""
    if arch.is_mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig


@dataclass(frozen=True)
class _Router:
    kind: str = "softmax"
    expert_bias: bool = False
    num_groups: int = 1
    group_topk: int = 1
    scaling: float = 1.0
    first_dense: int = 0


def _sigmoid_router(cfg: Any, num_experts: int, topk: int, norm_topk: bool) -> _Router:
    """glm4_moe's router (DeepSeek-V3's): sigmoid scores, top-k chosen on scores +
    ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` expert groups (a group's
    score: the sum of its 2 best), weights = the chosen scores renormalised, times
    ``routed_scaling_factor``; the first ``first_k_dense_replace`` layers dense. Megatron's router
    computes exactly this when a group's score is its best ``topk // topk_group`` (so that must be 2
    unless grouping selects every group) and always renormalises (``norm_topk_prob`` must be true for
    ``topk > 1``)."""
    n_group = int(getattr(cfg, "n_group", 1) or 1)
    topk_group = int(getattr(cfg, "topk_group", 1) or 1)
    if n_group > 1 and topk_group < n_group and topk // topk_group != 2:
        raise ConfigError(
            f"mcore: group-limited routing with n_group={n_group}, topk_group={topk_group}, "
            f"num_experts_per_tok={topk}: transformers scores a group by its 2 best experts, megatron-core "
            f"by its best num_experts_per_tok // topk_group = {topk // topk_group}; not converted"
        )
    if not norm_topk and topk > 1:
        raise ConfigError(
            "mcore: a sigmoid router with norm_topk_prob=False: megatron-core always renormalises the "
            "top-k sigmoid scores; not converted"
        )
    if num_experts % n_group:
        raise ConfigError(f"mcore: n_group={n_group} must divide the {num_experts} routed experts")
    grouped = n_group > 1 and topk_group < n_group
    first_dense = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    if first_dense >= int(cfg.num_hidden_layers):
        raise ConfigError(
            f"mcore: first_k_dense_replace={first_dense} leaves no MoE layer of {cfg.num_hidden_layers}"
        )
    return _Router(
        kind="sigmoid",
        expert_bias=True,
        num_groups=n_group if grouped else 1,
        group_topk=topk_group if grouped else 1,
        scaling=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0),
        first_dense=first_dense,
    )


def padded_vocab_size(vocab: int, tp: int) -> int:
    """The smallest multiple of ``tp`` that is ``>= vocab``: the rows of the vocab-parallel embedding
    and output layer (megatron splits them in ``tp`` equal shards)."""
    return -(-int(vocab) // int(tp)) * int(tp)


def with_padded_vocab(arch: MCoreArch, tp: int) -> MCoreArch:
    """``arch`` with ``padded_vocab = padded_vocab_size(arch.vocab, tp)`` (0 when nothing is padded).
    The padded rows exist only inside the engine: the weight map strips them (``hf_shapes`` keeps the
    real vocabulary) and the log-probs never give them probability (``vocab.mask_padded_rows``)."""
    rows = padded_vocab_size(arch.vocab, tp)
    return dataclasses.replace(arch, padded_vocab=rows if rows != arch.vocab else 0)


def value_arch(arch: MCoreArch, hf_config: Any) -> MCoreArch:
    """``arch`` as the value model transformers builds with ``AutoModelForTokenClassification`` and
    ``num_labels=1``: the backbone, then ``score = Linear(hidden, 1, bias=token_classification_bias)``
    on the final (normed) hidden state of every token, after a dropout of ``classifier_dropout``
    (else ``hidden_dropout``, else 0.1, transformers' rule) that is active in training only. No
    vocabulary output layer, so nothing is tied. ``ConfigError`` for a dropout outside ``[0, 1)``."""
    cfg = hf_config
    rate = getattr(cfg, "classifier_dropout", None)
    if rate is None:
        rate = getattr(cfg, "hidden_dropout", None)
    dropout = 0.1 if rate is None else float(rate)
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(
            f"mcore: value-head dropout {dropout} (classifier_dropout/hidden_dropout) must be in [0, 1)"
        )
    return dataclasses.replace(
        arch,
        tied=False,
        value_head=True,
        value_bias=bool(getattr(cfg, "token_classification_bias", True)),
        value_dropout=dropout,
    )


def check_layout(
    arch: MCoreArch,
    *,
    world: int,
    tp: int,
    pp: int,
    vpp: int,
    cp: int,
    ep: int,
    etp: int,
    sequence_parallel: bool,
    stage_layers: tuple[int | None, int | None] = (None, None),
) -> int:
    """Validate the parallel sizes against the world size and the model; return the data-parallel size.

    Raises ``ConfigError`` naming the numbers and the fix when the world size is not a multiple of
    ``tp * pp * cp``, heads or k/v heads are not divisible by ``tp`` (a vocabulary that is not is
    padded: ``with_padded_vocab``), sliding windows or multi-latent attention meet ``cp > 1``, layers by
    ``pp * vpp``, experts by ``ep``, ``ep * etp`` does not divide ``dp * cp * tp``, MoE under TP runs
    without sequence parallelism, VPP is used without PP, ``etp`` (expert tensor parallelism, megatron's default
    ``etp = tp``) differs from ``tp`` on a dense model or exceeds ``tp``.
    ``stage_layers``: the layer counts of the first and last pipeline stage (megatron's
    ``num_layers_in_first/last_pipeline_stage``, ``None`` = even split); each must be a multiple of
    ``vpp`` and the other layers must split evenly over the other stages and virtual stages."""
    for name, value in (("tp", tp), ("pp", pp), ("vpp", vpp), ("cp", cp), ("ep", ep), ("etp", etp)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"mcore: {name}={value!r} must be an int >= 1")
    mp = tp * pp * cp
    if world % mp:
        raise ConfigError(
            f"mcore: world size {world} is not a multiple of tp*pp*cp = {tp}*{pp}*{cp} = {mp}; "
            "choose sizes whose product divides the number of processes"
        )
    dp = world // mp
    if arch.heads % tp or arch.num_query_groups % tp:
        raise ConfigError(
            f"mcore: tp={tp} must divide the attention heads ({arch.heads}) and the k/v heads "
            f"({arch.num_query_groups}); lower tp"
        )
    if arch.is_mla and cp > 1:
        raise ConfigError(
            f"mcore: multi-latent attention (deepseek_v3) with cp={cp} is not verified by the mcore "
            "engine; use cp=1"
        )
    if arch.windows and cp > 1:
        raise ConfigError(
            f"mcore: sliding-window attention with cp={cp}: the engine's context-parallel attention "
            "computes full causal attention; use cp=1 for this model"
        )
    if vpp > 1 and pp == 1:
        raise ConfigError(f"mcore: vpp={vpp} needs pp > 1 (virtual stages interleave pipeline stages)")
    if stage_layers != (None, None):
        _check_uneven(arch.num_layers, pp, vpp, stage_layers)
    elif arch.num_layers % (pp * vpp):
        raise ConfigError(
            f"mcore: the model's {arch.num_layers} layers are not divisible by pp*vpp = {pp}*{vpp} = "
            f"{pp * vpp}; pick pp and vpp whose product divides the layer count"
        )
    check_expert_tp(arch, tp=tp, etp=etp)
    if arch.is_moe:
        if arch.num_experts % ep:
            raise ConfigError(f"mcore: ep={ep} must divide the number of experts {arch.num_experts}")
        if (dp * cp * tp) % (ep * etp):
            raise ConfigError(
                f"mcore: ep*etp = {ep}*{etp} must divide dp*cp*tp = {dp}*{cp}*{tp} = {dp * cp * tp} "
                "(experts are spread over the non-pipeline ranks)"
            )
        if tp > 1 and not sequence_parallel:
            raise ConfigError(
                f"mcore: MoE with tp={tp} requires sequence parallelism; set options sequence_parallel=True"
            )
    elif ep != 1:
        raise ConfigError(f"mcore: ep={ep} on a dense model (no experts); use ep=1")
    if sequence_parallel and tp == 1:
        raise ConfigError("mcore: sequence_parallel=True needs tp > 1 (it splits the sequence over TP)")
    return dp


def check_expert_tp(arch: MCoreArch, *, tp: int, etp: int) -> None:
    """``ConfigError`` for an expert tensor-parallel size ``etp`` other than ``tp`` on a dense model,
    or larger than ``tp``. ``etp < tp`` is supported: each expert is split over ``etp`` ranks and
    replicated over ``tp / etp`` of the TP ranks, whose gradients megatron's DDP sums over the expert
    data-parallel group (see ``_build._mark_expert_replicas``)."""
    if etp != tp and not arch.is_moe:
        raise ConfigError(f"mcore: etp={etp} with tp={tp} on a dense model (no experts); leave etp unset")
    if etp > tp:
        # megatron lays the expert groups out inside the tp x dp ranks; a wider expert TP than the
        # dense one is not a layout this engine verifies
        raise ConfigError(
            f"mcore: etp={etp} > tp={tp}: expert tensor parallelism wider than tp is not supported by the "
            "mcore engine; use etp <= tp (etp < tp replicates each expert over tp/etp ranks)"
        )


def check_training_randomness(hf_config: Any, randomness: str) -> None:
    """``ConfigError`` for a training-mode randomness of ``hf_config`` that the converted model would
    apply differently from transformers: MoE router jitter (``router_jitter_noise`` > 0) with
    ``ModelConfig.training_randomness="keep"``. transformers scales the MoE block's input, which feeds
    the router and the experts, by a uniform ``[1 - noise, 1 + noise]`` draw in training; megatron's
    only jitter (``moe_input_jitter_eps``) scales the router's input alone. With ``"off"`` (the
    default) transformers applies no jitter either, and the converted model (which has none) computes
    the same forward, so any ``router_jitter_noise`` is accepted."""
    noise = float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0)
    if randomness == "keep" and noise != 0.0:
        raise ConfigError(
            f"mcore: router_jitter_noise={noise} with training_randomness='keep': transformers jitters "
            "the input of the router and the experts, megatron (moe_input_jitter_eps) the router's "
            "only, so training would run another model; use training_randomness='off' (no jitter, the "
            "default), router_jitter_noise=0, or the fsdp2 engine"
        )


def _check_uneven(num_layers: int, pp: int, vpp: int, stage_layers: tuple[int | None, int | None]) -> None:
    """``ConfigError`` unless first/last stage layer counts ``stage_layers`` split ``num_layers`` over
    ``pp`` stages of ``vpp`` virtual stages: each given count a multiple of ``vpp``, the rest an equal
    non-zero multiple of ``vpp`` per other stage (megatron's rule for uneven pipelines)."""
    first, last = stage_layers
    if pp == 1:
        raise ConfigError(
            "mcore: num_layers_in_first/last_pipeline_stage need pp > 1; remove them or raise pp"
        )
    given = [n for n in (first, last) if n is not None]
    for n in given:
        if n % vpp:
            raise ConfigError(
                f"mcore: a first/last pipeline stage of {n} layers is not divisible by vpp={vpp}"
            )
    rest = num_layers - sum(given)
    others = pp - len(given)
    if rest < 0 or (others == 0 and rest) or (others and (rest < others * vpp or rest % (others * vpp))):
        raise ConfigError(
            f"mcore: first/last pipeline stages of {first}/{last} layers leave {rest} of the model's "
            f"{num_layers} layers for {others} other stage(s) x vpp={vpp}; they must split evenly (at "
            "least one layer per virtual stage)"
        )


def check_interleaved_count(count: int, *, pp: int, vpp: int, group_size: int | None = None) -> None:
    """Raise ``ConfigError`` for a micro-batch ``count`` that megatron's interleaved schedule
    (``vpp > 1``) refuses, before it runs: it executes micro-batches in groups of ``group_size``
    (``microbatch_group_size_per_vp_stage``, default ``pp``) per virtual stage, so it needs
    ``pp <= group_size <= count`` and a last group of 0 or at least ``pp`` micro-batches. No check
    for ``vpp == 1``."""
    if vpp <= 1:
        return
    group = pp if group_size is None else group_size
    if not pp <= group <= count:
        raise ConfigError(
            f"mcore: {count} micro-batches with pp={pp}, vpp={vpp}: the interleaved schedule runs "
            f"groups of {group} micro-batches per virtual stage and needs at least {max(group, pp)}; give "
            f"the step at least {max(group, pp)} micro-batches (a multiple of pp={pp}) or use vpp=1"
        )
    rest = count % group
    if 0 < rest < pp:
        raise ConfigError(
            f"mcore: {count} micro-batches with pp={pp}, vpp={vpp}: the last group of the interleaved "
            f"schedule would hold {rest} < pp micro-batches ({count} % {group}); use a multiple of "
            f"pp={pp} micro-batches or use vpp=1"
        )


def transformer_config_kwargs(
    arch: MCoreArch,
    *,
    tp: int,
    pp: int,
    vpp: int,
    cp: int,
    ep: int,
    etp: int,
    sequence_parallel: bool,
    params_dtype: torch.dtype,
    recompute: str = "none",
    batch_p2p_comm: bool = True,
    fused_elementwise: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of megatron's ``TransformerConfig`` for ``arch`` under the given sizes.

    Dropout is 0 and every fused kernel that needs TE/apex is off, so the mcore model computes the HF
    model's function; ``fused_elementwise`` turns on megatron's SwiGLU fusion (``bias_activation_fusion``:
    a ``torch.compile``d kernel that saves only the MLP's input to the activation). ``recompute`` is ``"none"``, ``"full"`` (every layer, uniform) or
    ``"selective"`` (megatron's core-attention recompute)."""
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden,
        ffn_hidden_size=arch.ffn if not arch.is_moe or arch.first_dense else arch.moe_ffn,
        num_attention_heads=arch.heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=fused_elementwise,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # the interleaved schedule runs with one padded token count per step (see the engine's
        # _micro_batches): megatron's shape exchange is wrong at pp=2 with virtual stages
        variable_seq_lengths=vpp == 1,
        batch_p2p_comm=batch_p2p_comm,
        calculate_per_token_loss=True,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    if arch.is_moe:
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn,
            moe_router_score_function="softmax",
            # top-k of the softmax then renormalised == softmax over the top-k logits (norm_topk_prob);
            # without renormalisation megatron takes the softmax over all experts first
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
        )
        if arch.first_dense:  # dense MLPs (ffn_hidden_size) on the first layers
            kw["moe_layer_freq"] = [0] * arch.first_dense + [1] * (arch.num_layers - arch.first_dense)
        if arch.router == "sigmoid":
            # the routing bias is transformers' fixed buffer: megatron's load-balancing update is off
            kw.update(
                moe_router_score_function="sigmoid",
                moe_router_pre_softmax=False,
                moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0,
                moe_router_dtype="fp32",  # transformers runs this router in float32
                moe_router_topk_scaling_factor=arch.routed_scaling if arch.routed_scaling != 1.0 else None,
            )
            if arch.num_groups > 1:
                kw.update(moe_router_num_groups=arch.num_groups, moe_router_group_topk=arch.group_topk)
        if arch.shared_ffn:
            # qwen2_moe: output += sigmoid(x @ gate.T) * shared_mlp(x) (megatron's SharedExpertMLP);
            # glm4_moe: output += shared_mlp(x)
            kw.update(
                moe_shared_expert_intermediate_size=arch.shared_ffn,
                moe_shared_expert_gate=arch.shared_gate,
                moe_shared_expert_overlap=False,
            )
    if arch.is_mla:
        kw.update(
            # DeepSeek's q_a / kv_a layernorms are MLA's q/kv norms: megatron-core >= 0.17 builds the
            # spec's norms only with qk_layernorm on (and refuses them otherwise); 0.16 ignores the flag
            qk_layernorm=True,
            q_lora_rank=arch.q_lora_rank or None,
            kv_lora_rank=arch.kv_lora_rank,
            qk_head_dim=arch.head_dim,
            qk_pos_emb_head_dim=arch.qk_rope_dim,
            v_head_dim=arch.v_head_dim,
            rope_type="rope",
            rotary_base=arch.rope_theta,
            rotary_scaling_factor=1.0,
            mscale=1.0,
            mscale_all_dim=0.0,
        )
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective")
    elif recompute != "none":
        raise ConfigError(f"mcore: recompute={recompute!r}; use 'none', 'full' or 'selective'")
    return kw


def transformer_config_keys(arch: MCoreArch) -> dict[str, Any]:
    """``transformer_config_kwargs`` of ``arch`` at the smallest layout: its key set (which fields
    the engine sets for this model) does not depend on the sizes, so the pass-through can be checked
    against it before any layout is validated."""
    return transformer_config_kwargs(
        arch, tp=1, pp=1, vpp=1, cp=1, ep=1, etp=1, sequence_parallel=False, params_dtype=torch.float32
    )
