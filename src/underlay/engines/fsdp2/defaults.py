"""How the fsdp2 engine fills in the options a user left to it ("auto"): pure functions, no torch.

Two parts, both unit-tested with made-up device sizes:

- ``device_defaults(device_type, ...)``: the speed settings per device family (``compile``,
  ``fused_adamw``, ``compile_memory_budget``), each with the reason it was chosen. On ``cuda`` they are
  the fastest robust settings measured on the H200 (``benchmarks/results/fsdp2.md``: whole-layer
  compile, fused AdamW, a 0.85 activation budget: 51.8% MFU on the Qwen2-1.5B benchmark, 40% eager); on ``cpu`` and ``npu`` the safe ones (no compile; fused AdamW where torch has
  the kernel for that device and it was measured).
- ``estimate_memory`` and ``choose_memory_policy``: device bytes of one training step from the model's
  shape and ``micro_batch_max_tokens``, and the first configuration in a fixed order that fits the
  device: no recomputation -> full recomputation -> parameters resharded after forward; when none of
  those fits, the same order again with the AdamW state in host memory (``optimizer_offload``).
  Gradients are reduced once per micro-batch unless the user asks for ``grad_sync="per_step"`` (its
  speed on one GPU is not measured yet, so the policy does not choose it); the estimate counts what
  ``"per_step"`` keeps when it is asked for.

Gradient sync and memory: with ``grad_sync="per_step"`` FSDP2 keeps each micro-batch's unsharded
gradient, accumulated in the reduce dtype (fp32: 4 bytes per trainable parameter, over the whole model),
until the last micro-batch's backward reduce-scatters it into the sharded gradient (4/dp bytes). The
engine syncs per step only while the sharded gradients are empty (its first ``forward_backward`` after
``zero_grad``/``optimizer_step``; a later call before the optimizer step syncs per micro-batch), so the
two never coexist beyond one layer at a time: the gradient bytes of a step are ``4 x trainable`` instead
of ``4 x trainable / dp``: the same at one rank, ``dp`` times more at ``dp`` ranks.

The activation model (bytes saved per token per decoder layer, bf16 compute; ``h`` hidden, ``q`` =
heads x head_dim, ``kv`` = kv heads x head_dim, ``f`` ffn width):

- eager: ``16h + 12q + 4kv + 8f`` (each RMSNorm keeps its fp32 input and its bf16 normalised output,
  the projections their inputs, rotary its inputs, the attention kernel q, the GQA-repeated k and v and
  its output, the MLP gate, SiLU, up and product);
- compiled whole layer at ``compile_memory_budget <= 0.9``: ``4h + 4q + 4kv + 4f`` (+ ``2q + 2kv`` with
  q/k norms): the layer input and mid residual, the q/k/v projections, the attention output, gate and
  up; the partitioner recomputes the pointwise rest. Measured: 48.4 KiB against 48 KiB modelled
  (Qwen2-1.5B, budgets 0.85 and 0.7 gave the same 47.99 GiB peak: lower budgets save nothing more, so
  the policy never lowers it), 76 KiB against 78 KiB (Qwen3-4B, 111.6 GiB peak);
- compiled at a budget above 0.9 (torch's own default is 1.0): 0.66 x eager (Qwen2-1.5B: 59.55 GiB
  peak, 75 KiB per token and layer);
- full recomputation: the layer input (``2h``) per layer plus one layer's activations;
- attention on the eager kernel (a spec no installed fused kernel runs, e.g. attention sinks on cuda
  without flash-attn, or a head dim ``flex`` does not take): ``[heads, S, S]`` fp32 scores per layer,
  counted apart (``eager_attention_bytes``) because they grow with the square of the longest sequence.
  The fused kernels, ``flex`` included, are ``O(T)`` and count nothing here.

``tests/unit/test_fsdp2_defaults.py`` holds the recorded peaks and the tolerance (15%).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from underlay.engines.fsdp2._device_defaults import (
    AUTO_COMPILE_BUDGET,
    DeviceDefaults,
    device_defaults,
)
from underlay.engines.fsdp2.options import FSDP2Options

GradSync = Literal["per_micro_batch", "per_step"]

OFFLOAD_CHUNK_BYTES = 1 << 30
"""State bytes per streamed chunk of ``HostOffloadAdamW`` (``optimizer_offload``)."""

__all__ = [
    "AUTO_COMPILE_BUDGET",
    "DeviceDefaults",
    "GradSync",
    "MemoryEstimate",
    "MemoryPolicy",
    "ModelShape",
    "Resolved",
    "choose_memory_policy",
    "device_defaults",
    "eager_attention_bytes",
    "estimate_memory",
    "resolve",
    "usable_bytes",
]

GiB = 1 << 30

MEMORY_MARGIN_FRACTION = 0.08
MEMORY_MARGIN_BYTES = 2 * GiB
"""What the memory policy leaves free of ``device total``: the caching allocator's fragmentation and
the CUDA/NPU context (8% + 2 GiB: 140.4 GiB -> 127.2 GiB usable on an H200)."""


HEAD_CHUNK_BYTES = 2 * (256 << 20)
"""The fused head's bounded buffers: one fp32 logits chunk of about 256 MiB (torch kernel; the Triton
backward's dlogits and accumulator are about 128 MiB each) and, for a soft-capped head, its tanh chunk."""


EAGER_ATTENTION_SAVED_BYTES = 12
"""Bytes per (query head, query, key) score that the eager attention kernel (``eager_attention``: the
fp32 reference, the only kernel some specs resolve to, e.g. Gemma 2's attention softcap where no
flash-attn is installed) keeps for backward: the tanh of the capped scores, the softmax output and the
masked probabilities, fp32 each."""

EAGER_ATTENTION_BACKWARD_BYTES = 12
"""Bytes per score of one eager layer's backward: the fp32 gradients of those three score tensors."""


def eager_attention_bytes(
    shape: ModelShape,
    tokens: int,
    *,
    recompute: Literal["none", "full"],
    activation_offload: bool = False,
    ulysses: int = 1,
) -> int:
    """Device bytes of the ``[heads, S, S]`` score tensors of the decoder layers whose attention runs on
    the eager kernel (``shape.eager_attention_layers``; 0 bytes when there are none). The longest
    sequence of a micro-batch is ``tokens`` (one sequence may fill it), every rank of ``ulysses`` holds
    ``heads / ulysses`` heads of the whole sequence. Saved for backward: every such layer without
    recomputation, one with ``recompute="full"``, two with ``activation_offload`` (the layer being
    offloaded and the one prefetched); plus one layer's backward (:data:`EAGER_ATTENTION_BACKWARD_BYTES`)."""
    if shape.eager_attention_layers <= 0:
        return 0
    scores = -(-shape.heads // ulysses) * tokens * tokens
    if recompute == "full":
        held = 1
    elif activation_offload:
        held = min(2, shape.eager_attention_layers)
    else:
        held = shape.eager_attention_layers
    return scores * (held * EAGER_ATTENTION_SAVED_BYTES + EAGER_ATTENTION_BACKWARD_BYTES)


def head_bytes(shape: ModelShape, tokens: int) -> int:
    """Device bytes of the fused log-prob head for ``tokens`` tokens, the same for every architecture
    (soft-capped heads included: the cap is applied inside the kernel's chunks): per token its hidden
    state and gradient (fp32, ``12 * hidden``), the per-row statistics and the Triton forward's
    ``ceil(V / 256)``-column fp32 workspaces (three), a 64 KiB margin; plus :data:`HEAD_CHUNK_BYTES`."""
    per_token = 12 * shape.hidden + 12 * -(-shape.vocab // 256) + 65536
    return tokens * per_token + HEAD_CHUNK_BYTES


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs of a decoder-only model.

    ``params``: every parameter (tied ones once); ``trainable``: those the optimizer updates (LoRA:
    the adapters); ``layer_params``: the largest decoder layer; ``root_params``: parameters outside the
    decoder layers (embeddings, head, final norm); the rest as in the Hugging Face config.
    ``ffn``: the MLP width a token passes through (MoE: routed experts x expert width + shared).
    ``eager_attention_layers``: decoder layers whose attention call resolves to the eager kernel, which
    materialises ``[heads, S, S]`` fp32 scores (:func:`eager_attention_bytes`); 0 when a fused kernel
    runs every layer."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    params: int
    trainable: int
    layer_params: int
    root_params: int
    qk_norm: bool = False
    eager_attention_layers: int = 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Device bytes of one training step, by part (``total`` is their sum). ``accumulated_grads``: what
    the unsharded reduce-dtype gradients of ``grad_sync="per_step"`` hold beyond ``grads`` (0 when
    syncing per micro-batch, and at one rank). ``attention``: the eager attention kernel's score tensors
    (:func:`eager_attention_bytes`; 0 when fused kernels run every layer)."""

    master_params: int
    grads: int
    optimizer_state: int
    unsharded_params: int
    transient: int
    activations: int
    head: int
    accumulated_grads: int = 0
    attention: int = 0

    @property
    def total(self) -> int:
        """Sum of the parts, bytes."""
        return (
            self.attention
            + self.master_params
            + self.grads
            + self.accumulated_grads
            + self.optimizer_state
            + self.unsharded_params
            + self.transient
            + self.activations
            + self.head
        )

    @property
    def model_state(self) -> int:
        """Master parameters, gradients and optimizer state, bytes."""
        return self.master_params + self.grads + self.optimizer_state

    def describe(self) -> str:
        """One line in GiB for logs."""
        parts = (
            "master_params",
            "grads",
            "accumulated_grads",
            "optimizer_state",
            "unsharded_params",
            "transient",
            "activations",
            "head",
            "attention",
        )
        inner = ", ".join(f"{p} {getattr(self, p) / GiB:.1f}" for p in parts)
        return f"{self.total / GiB:.1f} GiB ({inner})"


def activation_bytes_per_token_layer(
    shape: ModelShape, *, compiled: bool, compile_memory_budget: float | None, param_bytes: int = 2
) -> float:
    """Activation bytes one token leaves saved for backward in one decoder layer without recomputation
    (the module docstring gives the model and its calibration). ``compile_memory_budget=None`` is
    torch's default (1.0)."""
    h, f = shape.hidden, shape.ffn
    q = shape.heads * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    eager = 16 * h + 12 * q + 4 * kv + 8 * f
    if not compiled:
        return eager * param_bytes / 2
    budget = 1.0 if compile_memory_budget is None else compile_memory_budget
    if budget > 0.9:
        return 0.66 * eager * param_bytes / 2
    floor = 4 * h + 4 * q + 4 * kv + 4 * f + ((2 * q + 2 * kv) if shape.qk_norm else 0)
    return floor * param_bytes / 2


def estimate_memory(
    shape: ModelShape,
    *,
    tokens: int,
    recompute: Literal["none", "full"],
    keep_unsharded: bool,
    optimizer_offload: bool,
    compiled: bool,
    compile_memory_budget: float | None,
    dp: int = 1,
    ulysses: int = 1,
    param_bytes: int = 2,
    cpu_offload: bool = False,
    activation_offload: bool = False,
    grad_sync: GradSync = "per_micro_batch",
) -> MemoryEstimate:
    """Device bytes of a training step on one rank.

    Model state: fp32 master parameters, fp32 gradients of the trainable ones and AdamW's two fp32
    states, each sharded over ``dp`` ranks (``optimizer_offload``: the AdamW state lives on the host;
    ``cpu_offload``: all three do). ``grad_sync="per_step"``: the unsharded fp32 gradients of every
    trainable parameter are on the device until the step's last backward, ``accumulated_grads`` counts
    what they hold beyond the sharded ``grads`` (see the module docstring). Unsharded ``param_bytes`` parameters: the whole model when
    ``keep_unsharded`` (``reshard_after_forward=False``), else the root and two layers (one prefetched).
    With ``optimizer_offload`` the device holds three streamed chunks of the state (at least one
    parameter's each). Transient: the unsharded gradient of the largest FSDP unit (a decoder layer or
    the root) and its fp32 reduce buffer. Activations: ``tokens`` (one
    micro-batch, ``micro_batch_max_tokens``; divided over ``ulysses`` ranks) x layers x
    ``activation_bytes_per_token_layer``, or with ``recompute="full"`` the layer inputs plus one layer's
    activations; ``activation_offload`` (saved activations in host memory, one layer of slack and one
    prefetched): two layers' activations, or one with full recomputation. Head: :func:`head_bytes`.
    Attention: :func:`eager_attention_bytes` (layers on the eager kernel only)."""
    p, t = shape.params, shape.trainable
    master = 0 if cpu_offload else 4 * p // dp
    grads = 0 if cpu_offload else 4 * t // dp
    if cpu_offload:
        optim = 0
    elif optimizer_offload:
        # the streamed state: three chunks in flight, a chunk at least one parameter's state (the
        # embedding and the head are the largest tensors)
        largest = 8 * min(t, shape.vocab * shape.hidden) // dp
        optim = 3 * max(OFFLOAD_CHUNK_BYTES, largest)
    else:
        optim = 8 * t // dp
    if keep_unsharded:
        unsharded = param_bytes * p
    else:
        unsharded = param_bytes * (shape.root_params + 2 * shape.layer_params)
    # the unsharded gradients of one FSDP unit and their fp32 reduce buffer: a decoder layer, or the
    # root unit (embeddings, head) at the end of backward when that is larger
    transient = max(shape.layer_params, shape.root_params) * (param_bytes + 4)
    n = -(-tokens // ulysses)
    per_layer = activation_bytes_per_token_layer(
        shape, compiled=compiled, compile_memory_budget=compile_memory_budget, param_bytes=param_bytes
    )
    if activation_offload:
        acts = n * per_layer * (1 if recompute == "full" else min(2, shape.layers))
    elif recompute == "full":
        acts = n * (shape.layers * param_bytes * shape.hidden + per_layer)
    else:
        acts = n * shape.layers * per_layer
    head = head_bytes(shape, n)
    accumulated = max(0, 4 * t - grads) if grad_sync == "per_step" else 0
    attention = eager_attention_bytes(
        shape, tokens, recompute=recompute, activation_offload=activation_offload, ulysses=ulysses
    )
    return MemoryEstimate(
        master, grads, optim, unsharded, transient, int(acts), head, accumulated, attention=attention
    )


@dataclass(frozen=True)
class MemoryPolicy:
    """What the memory policy chose, the estimate of that choice, the usable bytes, and why."""

    recompute: Literal["none", "full"]
    keep_unsharded: bool
    optimizer_offload: bool
    estimate: MemoryEstimate
    usable: int
    fits: bool
    reason: str
    grad_sync: GradSync = "per_micro_batch"


def usable_bytes(device_total: int) -> int:
    """``device_total`` minus the margin (``MEMORY_MARGIN_FRACTION`` and ``MEMORY_MARGIN_BYTES``)."""
    return max(0, int(device_total * (1 - MEMORY_MARGIN_FRACTION)) - MEMORY_MARGIN_BYTES)


def choose_memory_policy(
    shape: ModelShape,
    *,
    device_total: int,
    tokens: int,
    compiled: bool,
    compile_memory_budget: float | None,
    recompute: Literal["none", "full"] | None = None,
    keep_unsharded: bool | None = None,
    optimizer_offload: bool | None = None,
    unsharded_allowed: bool = True,
    dp: int = 1,
    ulysses: int = 1,
    param_bytes: int = 2,
    cpu_offload: bool = False,
    activation_offload: bool = False,
    grad_sync: GradSync | None = None,
) -> MemoryPolicy:
    """The first configuration that fits ``usable_bytes(device_total)``, trying in order: no
    recomputation, full recomputation, then parameters resharded after forward (each with the
    parameters kept unsharded first when ``unsharded_allowed``; ``grad_sync`` left open is
    ``"per_micro_batch"``). ``recompute``, ``keep_unsharded``, ``optimizer_offload`` and
    ``grad_sync`` given (not ``None``) are the user's and are never changed. ``optimizer_offload``
    left open is set only when no configuration fits without it (then the same order is tried with it).
    When nothing fits, the configuration with the smallest estimate, ``fits=False`` and a reason naming
    the shortfall (the caller logs it; the estimate may be pessimistic, so the run is still tried).
    Never raises."""
    usable = usable_bytes(device_total)

    def est(rc: Literal["none", "full"], keep: bool, off: bool, sync: GradSync) -> MemoryEstimate:
        return estimate_memory(
            shape,
            tokens=tokens,
            recompute=rc,
            keep_unsharded=keep,
            optimizer_offload=off,
            compiled=compiled,
            compile_memory_budget=compile_memory_budget,
            dp=dp,
            ulysses=ulysses,
            param_bytes=param_bytes,
            cpu_offload=cpu_offload,
            activation_offload=activation_offload,
            grad_sync=sync,
        )

    offloads = [optimizer_offload] if optimizer_offload is not None else [False, True]
    rcs: list[Literal["none", "full"]] = [recompute] if recompute is not None else ["none", "full"]
    keeps = (
        [keep_unsharded] if keep_unsharded is not None else ([True, False] if unsharded_allowed else [False])
    )
    syncs: list[GradSync] = [grad_sync] if grad_sync is not None else ["per_micro_batch"]
    # keeping parameters unsharded costs less time than recomputing, which costs less than resharding every layer (an
    # all-gather per layer in backward); the host optimizer step costs the most
    candidates = [(rc, keep, sync) for keep in keeps for rc in rcs for sync in syncs]
    best: MemoryPolicy | None = None
    for off in offloads:
        if off and optimizer_offload is None:
            off_reason = "set: the model state does not fit with any recompute/reshard choice"
        else:
            off_reason = "given" if optimizer_offload is not None else "not needed"
        for rc, keep, sync in candidates:
            e = est(rc, keep, off, sync)
            fits = e.total <= usable
            why = (
                f"recompute={rc}, keep_unsharded={keep}, grad_sync={sync}, optimizer_offload={off} "
                f"({off_reason}): estimate {e.describe()} {'<=' if fits else '>'} usable "
                f"{usable / GiB:.1f} GiB"
            )
            policy = MemoryPolicy(rc, keep, off, e, usable, fits, why, sync)
            if fits:
                return policy
            if best is None or e.total < best.estimate.total:
                best = policy
    assert best is not None
    return replace(best, reason=best.reason + "; nothing fits: the smallest estimate is used")


@dataclass(frozen=True)
class Resolved:
    """Every auto option of an fsdp2 engine decided: concrete ``options`` (no ``None`` left in the
    auto fields), the recompute policy, one reason per decided field, and the memory policy (``None``
    when the user fixed recompute, resharding, optimizer offload and gradient sync)."""

    options: FSDP2Options
    recompute: Literal["none", "full"]
    reasons: dict[str, str]
    memory: MemoryPolicy | None


def resolve(
    options: FSDP2Options,
    *,
    device_type: str,
    recompute: str,
    shape: ModelShape,
    device_total: int,
    tokens: int,
    single_node: bool,
    dp: int = 1,
    ulysses: int = 1,
    param_bytes: int = 2,
    cpu_offload: bool = False,
    inductor_ok: bool | None = None,
    fused_adamw_ok: bool | None = None,
    world_size: int = 1,
) -> Resolved:
    """Decide the auto fields of ``options`` (``None``) and ``recompute="auto"`` for an engine on
    ``device_type`` with ``device_total`` bytes of memory: the speed fields from ``device_defaults``,
    then resharding, recomputation, gradient sync and optimizer offload from ``choose_memory_policy``
    (parameters may stay unsharded only when ``single_node``), last ``single_device``: True at
    ``world_size`` 1 without ``cpu_offload`` when the parameters stay unsharded (the world-size-1 path
    keeps its compute copy for the whole step; a ``single_device=True`` the user set keeps them unsharded
    in the memory estimate too). Fields the user set are kept as given, with the reason "given".
    ``recompute`` must be ``"auto"``, ``"none"`` or ``"full"`` (the engine refused the rest).
    Never raises."""
    dd = device_defaults(device_type, inductor_ok=inductor_ok, fused_adamw_ok=fused_adamw_ok)
    reasons: dict[str, str] = {}

    def pick(name: str, given: object, auto: object) -> object:
        if given is not None:
            reasons[name] = "given"
            return given
        reasons[name] = dd.reasons[name]
        return auto

    compile_ = pick("compile", options.compile, dd.compile)
    fused = pick("fused_adamw", options.fused_adamw, dd.fused_adamw)
    if options.compile_memory_budget is None and not compile_:
        budget: object = None
        reasons["compile_memory_budget"] = "not compiling"
    else:
        budget = pick(
            "compile_memory_budget", options.compile_memory_budget, AUTO_COMPILE_BUDGET if compile_ else None
        )
    given_rc: Literal["none", "full"] | None = None if recompute == "auto" else recompute  # type: ignore[assignment]
    given_keep = None if options.reshard_after_forward is None else not options.reshard_after_forward
    if options.single_device and given_keep is None:
        given_keep = True  # the compute copy lives from forward to backward and across micro-batches
    memory: MemoryPolicy | None = None
    if (
        given_rc is not None
        and given_keep is not None
        and options.optimizer_offload is not None
        and options.grad_sync is not None
    ):
        rc, keep, offload, sync = given_rc, given_keep, options.optimizer_offload, options.grad_sync
        for name in ("recompute", "reshard_after_forward", "optimizer_offload", "grad_sync"):
            reasons[name] = "given"
    else:
        memory = choose_memory_policy(
            shape,
            device_total=device_total,
            tokens=tokens,
            compiled=bool(compile_),
            compile_memory_budget=budget if isinstance(budget, float) else None,
            recompute=given_rc,
            keep_unsharded=given_keep,
            optimizer_offload=options.optimizer_offload,
            unsharded_allowed=single_node,
            dp=dp,
            ulysses=ulysses,
            param_bytes=param_bytes,
            cpu_offload=cpu_offload,
            activation_offload=options.activation_offload,
            grad_sync=options.grad_sync,
        )
        rc, keep, offload = memory.recompute, memory.keep_unsharded, memory.optimizer_offload
        sync = memory.grad_sync
        policy = "memory policy: " + memory.reason
        reasons["recompute"] = "given" if given_rc is not None else policy
        if given_keep is not None:
            reasons["reshard_after_forward"] = "given"
        elif not single_node:
            reasons["reshard_after_forward"] = "ranks on more than one node: reshard after forward"
        else:
            reasons["reshard_after_forward"] = policy
        reasons["optimizer_offload"] = "given" if options.optimizer_offload is not None else policy
        reasons["grad_sync"] = "given" if options.grad_sync is not None else policy
    if options.single_device is not None:
        single = options.single_device
        reasons["single_device"] = "given"
    else:
        single = world_size == 1 and not cpu_offload and keep
        if world_size != 1:
            reasons["single_device"] = f"world size {world_size}: parameters are sharded with fully_shard"
        elif cpu_offload:
            reasons["single_device"] = "cpu_offload keeps the parameters on the host through FSDP2"
        elif not keep:
            reasons["single_device"] = "parameters resharded after forward (reshard_after_forward=True)"
        else:
            reasons["single_device"] = "world size 1 and the parameters stay unsharded: no FSDP2 copies"
    concrete = replace(
        options,
        single_device=single,
        compile=compile_,  # type: ignore[arg-type]
        fused_adamw=bool(fused),
        compile_memory_budget=budget,  # type: ignore[arg-type]
        reshard_after_forward=not keep,
        optimizer_offload=offload,
        grad_sync=sync,
    )
    return Resolved(concrete, rc, reasons, memory)
