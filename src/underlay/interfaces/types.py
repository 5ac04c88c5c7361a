"""Frozen value types that cross the interfaces."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from underlay.interfaces.errors import ConfigError, InvalidInput

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "AttentionSpec",
    "BackendKind",
    "LogprobOutput",
    "LossContext",
    "MemoryStats",
    "Metric",
    "MetricReduce",
    "OptimizerStepResult",
    "PackedBatch",
    "ParallelLayout",
    "ProbeResult",
    "ProcessGroups",
    "RecomputePolicy",
    "StepResult",
    "TokenBatch",
    "TokenOutputs",
    "VisionInputs",
]

RecomputePolicy = Literal["auto", "none", "full", "selective"]
"""Activation recomputation: ``"auto"`` lets the engine choose at build (fsdp2: ``"none"`` when its
memory estimate fits the device, else ``"full"``; mcore: ``"none"``) and reports the choice;
``"none"`` keeps every activation, ``"full"`` recomputes each decoder layer in backward,
``"selective"`` recomputes the cheap-to-recompute parts (e.g. attention core) only; an engine says
which it supports (``ParallelEngine.supports_recompute``)."""

BackendKind = Literal["device", "engine", "attention", "logprob", "quant", "profiler", "weight_loader"]


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of a backend probe: ``available`` or the ``reason`` it is not, plus an install ``hint``."""

    available: bool
    reason: str = ""
    hint: str = ""

    @classmethod
    def ok(cls) -> ProbeResult:
        """A passing probe."""
        return cls(True)

    @classmethod
    def fail(cls, reason: str, hint: str = "") -> ProbeResult:
        """A failing probe with the reason and how to fix it."""
        return cls(False, reason, hint)


@dataclass(frozen=True)
class MemoryStats:
    """Memory of one device in bytes.

    On accelerators ``allocated``/``reserved``/``peak_allocated`` come from the caching allocator and
    ``total``/``free`` from the driver. On cpu ``allocated`` is the process resident set size,
    ``reserved`` its virtual size, ``peak_allocated`` the peak resident size (or since the last reset),
    and ``total``/``free`` are system memory.
    """

    allocated: int
    reserved: int
    peak_allocated: int
    total: int
    free: int

    def as_gib(self) -> dict[str, float]:
        """The same figures in GiB, keyed by field name, for logging."""
        return {k: v / 2**30 for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of an engine's parallel dimensions, by name.

    Every field is a ``torch.distributed.ProcessGroup`` or ``None``. ``None`` means the dimension has
    size 1 for this engine (or the engine runs without a process group), so a caller treats it as
    "this rank alone" and skips the collective. How ranks are ordered into groups is the engine's
    choice (fsdp2: consecutive ranks form a Ulysses group; mcore: Megatron-Core's rank generator).

    - ``world``: every rank of the engine.
    - ``dp``: ranks that hold different data and the same model shard (one per Ulysses group).
    - ``dp_cp``: ``dp`` x ``cp``, the group a token-mean loss (and its token count) is reduced over.
    - ``tp``: tensor parallel. ``pp``: pipeline stages. ``cp``: context parallel (sequence split
      inside attention, ring/all-gather style).
    - ``ep``: expert parallel. ``etp``: tensor parallel inside an expert. ``edp``: expert data
      parallel (the ranks that hold the same experts; gradients of expert weights reduce over it).
    - ``ulysses``: the Ulysses sequence-parallel group (all-to-all between sequence and heads around
      attention); its ranks share one data shard.
    - ``mp``: the model-parallel group, every rank that shares one data shard (tp x pp x cp x
      ulysses); an engine broadcasts per-token outputs and metrics inside it so that every rank
      returns the same thing as its data-parallel peers expect.
    - ``device_mesh``: the ``DeviceMesh`` parameters are sharded over (fsdp2: 1-D ``("dp_shard",)`` or
      2-D HSDP ``("dp_replicate", "dp_shard")``); ``None`` for engines without one.
    """

    world: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    dp_cp: ProcessGroup | None = None
    tp: ProcessGroup | None = None
    pp: ProcessGroup | None = None
    cp: ProcessGroup | None = None
    ep: ProcessGroup | None = None
    etp: ProcessGroup | None = None
    edp: ProcessGroup | None = None
    ulysses: ProcessGroup | None = None
    mp: ProcessGroup | None = None
    device_mesh: DeviceMesh | None = None


_LAYOUT_SIZES = ("world_size", "dp_replicate", "dp_shard", "tp", "pp", "vpp", "cp", "ep", "etp", "ulysses")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of each parallel dimension of an engine, and its process groups.

    - ``world_size == dp_replicate * dp_shard * tp * pp * cp``.
    - ``dp_replicate``/``dp_shard``: data-parallel replicas and shards (HSDP: parameters are sharded
      over ``dp_shard`` and replicated over ``dp_replicate``; Megatron's data parallel is
      ``dp_replicate * dp_shard``).
    - ``tp`` tensor, ``pp`` pipeline, ``cp`` context parallel.
    - ``vpp``: virtual pipeline chunks per pipeline rank (interleaved schedule); ``> 1`` needs
      ``pp > 1``, and the micro-batch count must then be a multiple of ``pp``.
    - ``ep``: expert parallel, ``etp``: expert tensor parallel; ``ep * etp`` divides
      ``dp_shard * cp * tp`` (experts are spread over the ranks of one pipeline stage and replica).
    - ``ulysses``: Ulysses sequence parallel; divides ``dp_shard`` (its ranks share one data shard).
      This is not Megatron's ``sequence_parallel`` flag (activations split along the sequence inside
      tensor parallelism), which has no size of its own.

    Derived: ``dp`` (ranks with different data), ``edp`` (expert data parallel), ``mp`` (ranks
    sharing one data shard). ``groups`` holds the process groups; it does not take part in equality
    or hashing. Every size is validated on construction; ``ConfigError`` names the sizes and the fix.
    """

    world_size: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    ulysses: int = 1
    groups: ProcessGroups = field(default_factory=ProcessGroups, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        for name in _LAYOUT_SIZES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ParallelLayout.{name}={value!r}: every size must be an int >= 1")
        if not isinstance(self.groups, ProcessGroups):
            raise ConfigError(
                f"ParallelLayout.groups is a {type(self.groups).__name__}; pass a ProcessGroups"
            )
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp
        if product != self.world_size:
            raise ConfigError(
                f"ParallelLayout: dp_replicate*dp_shard*tp*pp*cp = {self.dp_replicate}*{self.dp_shard}*"
                f"{self.tp}*{self.pp}*{self.cp} = {product} != world_size {self.world_size}; "
                "choose sizes whose product is the world size"
            )
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError(
                f"ParallelLayout: vpp={self.vpp} needs pipeline parallelism (pp={self.pp}); set pp > 1 "
                "or vpp=1"
            )
        if self.dp_shard % self.ulysses:
            raise ConfigError(
                f"ParallelLayout: ulysses={self.ulysses} must divide dp_shard={self.dp_shard} "
                "(Ulysses ranks share one data shard); lower ulysses or raise dp_shard"
            )
        per_stage = self.dp_shard * self.cp * self.tp
        if per_stage % (self.ep * self.etp):
            raise ConfigError(
                f"ParallelLayout: ep*etp = {self.ep}*{self.etp} = {self.ep * self.etp} must divide "
                f"dp_shard*cp*tp = {self.dp_shard}*{self.cp}*{self.tp} = {per_stage} (experts are "
                "spread over the ranks of one pipeline stage); lower ep or etp"
            )

    @property
    def dp(self) -> int:
        """Ranks with different data: ``dp_replicate * dp_shard // ulysses``."""
        return self.dp_replicate * self.dp_shard // self.ulysses

    @property
    def edp(self) -> int:
        """Expert data parallel size, Megatron's rule: ``world_size // (pp * ep * etp)``."""
        return self.world_size // (self.pp * self.ep * self.etp)

    @property
    def mp(self) -> int:
        """Ranks that share one data shard: ``tp * pp * cp * ulysses`` (``world_size // dp``)."""
        return self.tp * self.pp * self.cp * self.ulysses

    @classmethod
    def infer(
        cls,
        world_size: int,
        *,
        tp: int = 1,
        pp: int = 1,
        vpp: int = 1,
        cp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        ulysses: int = 1,
        dp_replicate: int = 1,
        groups: ProcessGroups | None = None,
    ) -> ParallelLayout:
        """The layout for ``world_size`` ranks with ``dp_shard`` filled in from what remains.

        ``etp=None`` means ``etp = tp`` (Megatron-Core's default). Raises ``ConfigError`` when
        ``tp * pp * cp * dp_replicate`` does not divide ``world_size``, and for every rule of the class.
        """
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ParallelLayout.{name}={value!r}: every size must be an int >= 1")
        if isinstance(dp_replicate, bool) or not isinstance(dp_replicate, int) or dp_replicate < 1:
            raise ConfigError(f"ParallelLayout.dp_replicate={dp_replicate!r}: every size must be an int >= 1")
        denom = tp * pp * cp * dp_replicate
        if world_size % denom:
            raise ConfigError(
                f"world size {world_size} is not divisible by tp*pp*cp*dp_replicate = {tp}*{pp}*{cp}*"
                f"{dp_replicate} = {denom}; pick sizes that divide the number of processes"
            )
        return cls(
            world_size=world_size,
            dp_replicate=dp_replicate,
            dp_shard=world_size // denom,
            tp=tp,
            pp=pp,
            vpp=vpp,
            cp=cp,
            ep=ep,
            etp=tp if etp is None else etp,
            ulysses=ulysses,
            groups=groups if groups is not None else ProcessGroups(),
        )


@dataclass(frozen=True)
class PackedBatch:
    """A right- or left-padded ``[B, S]`` batch with the padding removed (THD, token-major).

    - ``input_ids``: ``[T]`` the kept tokens, sequence after sequence, ``T = cu_seqlens[-1]``.
    - ``cu_seqlens``: ``[B + 1]`` int32, cumulative lengths starting at 0.
    - ``max_seqlen``: the longest sequence length (python int, for kernels).
    - ``indices``: ``[T]`` int64 positions of the kept tokens in the flattened ``[B * S]`` batch.
    - ``position_ids``: ``[T]`` int64, restarting at 0 for every sequence.
    - ``batch_size``/``seqlen``: ``B`` and ``S`` of the padded batch, so ``pad`` can invert.
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    indices: torch.Tensor
    position_ids: torch.Tensor
    batch_size: int
    seqlen: int

    @property
    def total_tokens(self) -> int:
        """Number of real tokens ``T``."""
        return int(self.indices.numel())

    @property
    def seqlens(self) -> list[int]:
        """Length of each sequence."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


@dataclass(frozen=True)
class AttentionSpec:
    """What an attention call needs, so a kernel can say ahead of time whether it can run it.

    ``layout`` is ``"varlen"`` (packed ``[T, H, D]`` with ``cu_seqlens``) or ``"padded"``
    (``[B, S, H, D]``). ``window`` is ``(left, right)`` tokens visible around each query (``-1`` =
    unbounded), or ``None`` for full attention. ``device_type`` is ``torch.device.type``. ``sinks``:
    the call carries per-head attention-sink logits (gpt-oss; see ``AttentionKernel``).
    """

    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    device_type: str
    layout: Literal["varlen", "padded"] = "varlen"
    causal: bool = True
    window: tuple[int, int] | None = None
    softcap: float | None = None
    head_dim_v: int | None = None
    requires_grad: bool = False
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise InvalidInput(
                f"attention: q heads {self.num_heads} must be a positive multiple of kv heads "
                f"{self.num_kv_heads} (GQA/MQA); fix the head counts of q, k and v"
            )
        if self.head_dim < 1:
            raise InvalidInput(f"attention: head_dim={self.head_dim} must be >= 1")
        if self.layout not in ("varlen", "padded"):
            raise InvalidInput(f"attention: layout={self.layout!r}; use 'varlen' or 'padded'")


@dataclass(frozen=True)
class LogprobOutput:
    """Per-token ``log_probs`` ``[N]`` fp32 of the labels and ``entropy`` ``[N]`` fp32 (or ``None``).

    Positions whose label is the ignore index (-100) hold 0 in both and receive no gradient.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None


@dataclass(frozen=True)
class VisionInputs:
    """The images (or the videos) of a :class:`TokenBatch` for a Qwen-VL style vision-language model.

    - ``pixel_values``: ``[P, C * T_patch * patch * patch]`` float, the flattened patches of every
      image, image after image, as the model's image processor returns them
      (``AutoProcessor(...)["pixel_values"]``; ``"pixel_values_videos"`` for videos).
    - ``grid_thw``: ``[n, 3]`` int64 (``int32`` accepted and converted), the (t, h, w) patch grid of
      each image (``image_grid_thw`` / ``video_grid_thw``); image ``i`` owns ``t * h * w`` consecutive
      rows of ``pixel_values``, so ``P == sum(t * h * w)``.
    - ``rows``: ``[n]`` int64, the batch row (sequence) each image belongs to, non-decreasing: images
      are listed row by row, and inside a row in the order of their placeholder runs in ``input_ids``.
    - ``second_per_grid``: ``[n]`` float or ``None``, seconds per temporal grid step of each video
      (Qwen2.5-VL's ``second_per_grid_ts``); ``None`` for images.

    Raises ``InvalidInput`` naming the field when a shape, dtype or count disagrees. The count of
    placeholder tokens in ``input_ids`` (``t * h * w / merge_size**2`` per image) depends on the
    model's config and is checked by the engine (``underlay.models.check_vision_batch``).
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    rows: torch.Tensor
    second_per_grid: torch.Tensor | None = None

    def __post_init__(self) -> None:
        grid, rows = self.grid_thw, self.rows
        if grid.dim() != 2 or grid.shape[-1] != 3 or grid.dtype not in (torch.int64, torch.int32):
            raise InvalidInput(
                f"VisionInputs.grid_thw must be [n, 3] int64 (t, h, w), got {tuple(grid.shape)} {grid.dtype}"
            )
        if grid.dtype != torch.int64:
            object.__setattr__(self, "grid_thw", grid.long())
            grid = self.grid_thw
        n = int(grid.shape[0])
        if n < 1:
            raise InvalidInput("VisionInputs has no images (grid_thw is [0, 3]); pass None instead")
        if bool((grid < 1).any()):
            raise InvalidInput(f"VisionInputs.grid_thw has entries < 1: {grid.tolist()[:4]}")
        if rows.dim() != 1 or rows.numel() != n or rows.is_floating_point():
            raise InvalidInput(
                f"VisionInputs.rows must be [n={n}] integer (one batch row per image), got "
                f"{tuple(rows.shape)} {rows.dtype}"
            )
        if rows.dtype != torch.int64:
            object.__setattr__(self, "rows", rows.long())
            rows = self.rows
        if n > 1 and bool((rows[1:] < rows[:-1]).any()):
            raise InvalidInput(
                f"VisionInputs.rows {rows.tolist()[:8]} must be non-decreasing: list images row by row, "
                "in the order their placeholders appear"
            )
        px = self.pixel_values
        patches = int(grid.prod(dim=1).sum())
        if px.dim() != 2 or not px.is_floating_point() or int(px.shape[0]) != patches:
            raise InvalidInput(
                f"VisionInputs.pixel_values must be [P, D] float with P = sum(t*h*w) = {patches} patches "
                f"of grid_thw; got {tuple(px.shape)} {px.dtype}"
            )
        sec = self.second_per_grid
        if sec is not None and (sec.dim() != 1 or sec.numel() != n):
            raise InvalidInput(f"VisionInputs.second_per_grid must be [n={n}], got {tuple(sec.shape)}")

    @property
    def count(self) -> int:
        """``n``, the number of images (videos)."""
        return int(self.grid_thw.shape[0])

    def patch_counts(self) -> torch.Tensor:
        """``[n]`` int64: patches of each image (``t * h * w``), on the device of ``grid_thw``."""
        return self.grid_thw.prod(dim=1)

    def patches_per_row(self, batch_size: int) -> torch.Tensor:
        """``[batch_size]`` int64 on the cpu: the patches each batch row owns (0 for text-only rows)."""
        out = torch.zeros(batch_size, dtype=torch.int64)
        return out.index_add_(0, self.rows.cpu(), self.patch_counts().cpu())

    def select(self, index: list[int]) -> VisionInputs | None:
        """The images of rows ``index`` (in that order; a repeated row repeats its images), renumbered
        to the new rows ``0..len(index)-1``; ``None`` when those rows have no image."""
        rows = self.rows.tolist()
        counts = self.patch_counts().tolist()
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)
        picked: list[int] = []
        new_rows: list[int] = []
        patch_idx: list[torch.Tensor] = []
        for new, old in enumerate(index):
            for i, r in enumerate(rows):
                if r == old:
                    picked.append(i)
                    new_rows.append(new)
                    patch_idx.append(torch.arange(starts[i], starts[i] + counts[i]))
        if not picked:
            return None
        dev = self.pixel_values.device
        images = torch.tensor(picked, dtype=torch.long)
        return VisionInputs(
            self.pixel_values[torch.cat(patch_idx).to(dev)],
            self.grid_thw[images.to(self.grid_thw.device)],
            torch.tensor(new_rows, dtype=torch.long, device=self.rows.device),
            None
            if self.second_per_grid is None
            else self.second_per_grid[images.to(self.second_per_grid.device)],
        )

    def to(self, device: torch.device) -> VisionInputs:
        """The same inputs on ``device``."""
        return VisionInputs(
            self.pixel_values.to(device),
            self.grid_thw.to(device),
            self.rows.to(device),
            None if self.second_per_grid is None else self.second_per_grid.to(device),
        )


@dataclass(frozen=True)
class TokenBatch:
    """A padded training batch as an RL trainer holds it.

    - ``input_ids``: ``[B, S]`` int64 prompt + response tokens.
    - ``attention_mask``: ``[B, S]`` 0/1 (left or right padding).
    - ``loss_mask``: ``[B, S]`` 0/1, where the loss applies (usually the response tokens). The
      log-prob at position ``t`` is that of ``input_ids[:, t]`` given the tokens before it, so a mask
      over response tokens selects exactly their log-probs; position 0 never has one.
    - ``extras``: further ``[B, ...]`` tensors the loss function needs (advantages, old log-probs,
      reference log-probs, returns); micro-batching slices them along dim 0.
    - ``images`` / ``videos``: for vision-language models (Qwen2.5-VL, Qwen3-VL), the
      :class:`VisionInputs` of the batch (``None``: none). Each image belongs to one row
      (``VisionInputs.rows``), whose ``input_ids`` hold its placeholder tokens (``image_token_id``,
      ``t * h * w / merge_size**2`` of them); :meth:`select` (micro-batching) keeps every row's images
      with it. Rows without images are text-only sequences of the same model.
    - ``prompt_groups``: ``[B]`` int, or ``None``. Rows with equal values (a GRPO prompt's n
      responses) share their prompt: an engine that supports it computes their longest common prefix
      of real tokens once (``ops.prompt_sharing``; outputs and gradients equal the unshared
      computation), and keeps each group in one micro-batch. Engines without it refuse the field.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    images: VisionInputs | None = None
    videos: VisionInputs | None = None
    prompt_groups: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise InvalidInput(
                f"TokenBatch.input_ids must be [B, S], got shape {tuple(self.input_ids.shape)}"
            )
        for name in ("attention_mask", "loss_mask"):
            t = getattr(self, name)
            if t.shape != self.input_ids.shape:
                raise InvalidInput(
                    f"TokenBatch.{name} shape {tuple(t.shape)} != input_ids shape {tuple(self.input_ids.shape)}"
                )
        for key, t in self.extras.items():
            if t.shape[:1] != self.input_ids.shape[:1]:
                raise InvalidInput(
                    f"TokenBatch.extras[{key!r}] has batch size {t.shape[:1]}, expected {self.input_ids.shape[0]}"
                )
        groups = self.prompt_groups
        if groups is not None and (
            not isinstance(groups, torch.Tensor)
            or groups.shape != self.input_ids.shape[:1]
            or groups.is_floating_point()
            or groups.is_complex()
            or groups.dtype == torch.bool
        ):
            raise InvalidInput(
                f"TokenBatch.prompt_groups must be an integer tensor [B={self.batch_size}] (rows with equal "
                f"values share their prompt), got {getattr(groups, 'dtype', type(groups).__name__)} "
                f"{tuple(getattr(groups, 'shape', ()))}"
            )
        for name in ("images", "videos"):
            media = getattr(self, name)
            if media is None:
                continue
            if not isinstance(media, VisionInputs):
                raise InvalidInput(
                    f"TokenBatch.{name} is a {type(media).__name__}; give a VisionInputs or None"
                )
            rows = media.rows
            if int(rows.min()) < 0 or int(rows.max()) >= self.batch_size:
                raise InvalidInput(
                    f"TokenBatch.{name}.rows {rows.tolist()[:8]} out of range [0, {self.batch_size})"
                )

    @property
    def batch_size(self) -> int:
        """``B``."""
        return int(self.input_ids.shape[0])

    @property
    def has_vision(self) -> bool:
        """Whether the batch carries images or videos."""
        return self.images is not None or self.videos is not None

    def select(self, index: torch.Tensor | list[int]) -> TokenBatch:
        """The rows ``index`` (in that order) of every tensor, as a new batch; images and videos follow
        their rows (renumbered)."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.input_ids.device)
        rows = idx.tolist() if self.has_vision else []
        return TokenBatch(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.loss_mask[idx],
            {k: v[idx.to(v.device)] for k, v in self.extras.items()},
            None if self.images is None else self.images.select(rows),
            None if self.videos is None else self.videos.select(rows),
            None if self.prompt_groups is None else self.prompt_groups[idx.to(self.prompt_groups.device)],
        )

    def to(self, device: torch.device) -> TokenBatch:
        """The same batch on ``device``."""
        return TokenBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.loss_mask.to(device),
            {k: v.to(device) for k, v in self.extras.items()},
            None if self.images is None else self.images.to(device),
            None if self.videos is None else self.videos.to(device),
            None if self.prompt_groups is None else self.prompt_groups.to(device),
        )


@dataclass(frozen=True)
class TokenOutputs:
    """Per-token model outputs of one micro-batch, padded back to its ``[b, S]`` shape.

    ``log_probs`` fp32 (0 at position 0 and at padding); ``entropy`` fp32 or ``None``; ``values``
    fp32 for value models (``None`` for policies). ``aux_loss``: the model's router auxiliary
    (load-balancing) loss over this micro-batch's tokens, a 0-dim differentiable tensor already scaled by
    ``config.router_aux_loss_coef`` (exactly the term transformers adds to its own loss), for MoE models
    whose transformers class defines one, else ``None``. It is never added by the engine: a ``loss_fn``
    that wants it adds ``outputs.aux_loss * ctx.token_share`` (see ``docs/models.md``).
    """

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


MetricReduce = Literal["sum", "mean", "max", "min"]
"""How a loss_fn metric reduces over the micro-batches of every data-parallel rank: ``"sum"`` (a
contribution, like the loss), ``"mean"`` (unweighted mean over every ``loss_fn`` call of every rank),
``"max"``, ``"min"``."""

_METRIC_REDUCES = ("sum", "mean", "max", "min")


@dataclass(frozen=True)
class Metric:
    """A ``loss_fn`` metric with its reduction: ``value`` a number or a one-element tensor (detached by
    the engine), ``reduce`` one of :data:`MetricReduce`. A plain tensor or number returned as a metric
    means ``Metric(value, "sum")``. ``InvalidInput`` for an unknown ``reduce`` or a non-scalar value."""

    value: torch.Tensor | float
    reduce: MetricReduce = "sum"

    def __post_init__(self) -> None:
        if self.reduce not in _METRIC_REDUCES:
            raise InvalidInput(f"Metric reduce={self.reduce!r}; use one of {list(_METRIC_REDUCES)}")
        v = self.value
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise InvalidInput(
                    f"Metric value has shape {tuple(v.shape)}; give a number or a one-element tensor"
                )
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidInput(f"Metric value is {type(v).__name__}; give a number or a one-element tensor")


@dataclass(frozen=True)
class LossContext:
    """What a ``loss_fn`` knows about where its micro-batch sits in the global batch (loss contract v3).

    Counts come from ``TokenBatch.loss_mask`` (a *sequence* is a row with at least one loss token):

    - ``global_loss_tokens`` / ``global_sequences``: of the whole global batch, every micro-batch of
      every data-parallel rank (ranks that share a data shard, Ulysses or context parallel, count it
      once).
    - ``dp_size``: data-parallel ranks holding different data.
    - ``micro_batch``: index of this micro-batch on this rank, ``0 <= micro_batch < num_micro_batches``.
    - ``local_loss_tokens`` / ``local_sequences``: of this micro-batch.
    - ``loss_mask``: the micro-batch's ``batch.loss_mask`` the counts come from (the engine checked
      it is 0/1), or ``None``; ``ops.aggregate_loss`` reads nothing back when given this tensor.

    The ``loss_fn`` returns this micro-batch's contribution to the global objective; the engine sums
    the contributions' gradients over micro-batches and ranks (``ops.aggregate_loss`` builds
    contributions with verl's aggregation modes). ``InvalidInput`` on negative or inconsistent counts.
    """

    global_loss_tokens: int
    global_sequences: int
    dp_size: int
    micro_batch: int
    num_micro_batches: int
    local_loss_tokens: int
    local_sequences: int
    loss_mask: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if name == "loss_mask":
                continue
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidInput(f"LossContext.{name}={v!r} must be an int >= 0")
        if self.dp_size < 1 or self.num_micro_batches < 1:
            raise InvalidInput(
                f"LossContext: dp_size={self.dp_size} and num_micro_batches={self.num_micro_batches} "
                "must be >= 1"
            )
        if self.micro_batch >= self.num_micro_batches:
            raise InvalidInput(
                f"LossContext.micro_batch={self.micro_batch} out of range [0, {self.num_micro_batches})"
            )
        if self.local_loss_tokens > self.global_loss_tokens or self.local_sequences > self.global_sequences:
            raise InvalidInput(
                f"LossContext: local counts ({self.local_loss_tokens} tokens, {self.local_sequences} "
                f"sequences) exceed the global ones ({self.global_loss_tokens}, {self.global_sequences})"
            )
        if self.local_sequences > self.local_loss_tokens or self.global_sequences > self.global_loss_tokens:
            raise InvalidInput(
                "LossContext: more sequences than loss tokens (a sequence has at least one loss token): "
                f"local {self.local_sequences} > {self.local_loss_tokens} or global "
                f"{self.global_sequences} > {self.global_loss_tokens}"
            )

    @property
    def token_share(self) -> float:
        """``local_loss_tokens / global_loss_tokens`` (0 when the global batch has no loss token)."""
        return self.local_loss_tokens / self.global_loss_tokens if self.global_loss_tokens else 0.0

    @property
    def sequence_share(self) -> float:
        """``local_sequences / global_sequences`` (0 when no sequence has a loss token)."""
        return self.local_sequences / self.global_sequences if self.global_sequences else 0.0

    @classmethod
    def single(cls, loss_mask: torch.Tensor) -> LossContext:
        """The context of one micro-batch that is the whole global batch on one rank (what a float64
        reference or a unit test passes to a ``loss_fn``); ``loss_mask`` ``[B, S]`` 0/1."""
        if not isinstance(loss_mask, torch.Tensor) or loss_mask.dim() != 2:
            raise InvalidInput(
                f"LossContext.single: loss_mask must be a [B, S] tensor, got {getattr(loss_mask, 'shape', loss_mask)!r}"
            )
        per_row = (loss_mask != 0).sum(dim=1)
        tokens, rows = int(per_row.sum()), int((per_row > 0).sum())
        return cls(tokens, rows, 1, 0, 1, tokens, rows)  # loss_mask unset: aggregate_loss checks it


@dataclass(frozen=True)
class StepResult:
    """What ``forward_backward`` returns, identical on every rank: ``metrics`` reduced as each was
    declared (``Metric``; ``"loss"`` is the sum of the ``loss_fn`` contributions, the global
    objective), the number of micro-batches run on this rank, and the global counts of loss tokens and
    of sequences with at least one loss token (``LossContext.global_loss_tokens`` /
    ``global_sequences``)."""

    metrics: Mapping[str, float]
    num_micro_batches: int
    loss_tokens: int
    sequences: int


@dataclass(frozen=True)
class OptimizerStepResult:
    """Outcome of ``optimizer_step``: the global grad norm before clipping, whether the step was skipped
    (non-finite norm; parameters unchanged), and the learning rate used."""

    grad_norm: float
    skipped: bool
    lr: float

    @property
    def finite(self) -> bool:
        """Whether the grad norm was finite."""
        return math.isfinite(self.grad_norm)
