"""Vision-language models (Qwen-VL style): placeholder checks, the inputs ``packed_forward`` takes, the
micro-batch token cost of images, the zero-weight vision pass that keeps FSDP-sharded vision towers in
step across ranks, and the value-model (critic) variant transformers does not provide."""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from underlay.interfaces import ConfigError, InvalidInput, TokenBatch, VisionInputs
from underlay.parallel.ulysses import sp_rank, sp_world_size

__all__ = [
    "PROCESSOR_FILES",
    "check_vision_batch",
    "is_vision_config",
    "multimodal_inputs",
    "patch_cost",
    "sequence_costs",
    "shard_vision_tower",
    "split_media",
    "vision_calls",
    "vision_value_model",
    "zero_vision_pass",
]


PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
)
"""The files of a model directory's processor beyond its tokenizer's (image and video processors,
processor-level chat template); engines copy them next to their Hugging Face exports."""


def is_vision_config(hf_config: Any) -> bool:
    """Whether ``hf_config`` describes a vision-language model (it has a ``vision_config``)."""
    return getattr(hf_config, "vision_config", None) is not None


def _vision_config(hf_config: Any) -> Any:
    vc = getattr(hf_config, "vision_config", None)
    if vc is None:
        raise ConfigError(f"{getattr(hf_config, 'model_type', hf_config)!r} has no vision_config")
    return vc


def _merge_size(hf_config: Any) -> int:
    return int(getattr(_vision_config(hf_config), "spatial_merge_size", 1) or 1)


def check_vision_batch(hf_config: Any, batch: TokenBatch) -> None:
    """Check a batch's images and videos against the model: a text model takes none; for a Qwen-VL
    model every row holds exactly ``t * h * w / merge_size**2`` placeholder tokens (``image_token_id``
    / ``video_token_id``, counted where ``attention_mask`` is 1) per image (video) it owns, and each
    grid's ``h`` and ``w`` are multiples of ``merge_size``. Raises ``InvalidInput`` naming the row and
    the counts. One host read of the per-row counts."""
    if not batch.has_vision:
        return
    if not is_vision_config(hf_config):
        raise InvalidInput(
            f"TokenBatch carries images/videos but the model ({getattr(hf_config, 'model_type', '?')}) "
            "is a text model; drop TokenBatch.images/videos or build a vision-language model"
        )
    merge = _merge_size(hf_config)
    for name, media, attr in (
        ("images", batch.images, "image_token_id"),
        ("videos", batch.videos, "video_token_id"),
    ):
        token = getattr(hf_config, attr, None)
        if token is None:
            if media is not None:
                raise InvalidInput(f"TokenBatch.{name} given but the model config has no {attr}")
            continue
        real = batch.attention_mask != 0
        found = ((batch.input_ids == int(token)) & real).sum(dim=1).cpu()
        if media is None:
            if bool((found > 0).any()):
                rows = torch.nonzero(found > 0).flatten().tolist()
                raise InvalidInput(
                    f"TokenBatch rows {rows[:5]} hold {attr}={int(token)} placeholders but TokenBatch.{name} is None"
                )
            continue
        grid = media.grid_thw.cpu()
        if bool((grid[:, 1:] % merge != 0).any()):
            raise InvalidInput(
                f"TokenBatch.{name}.grid_thw {grid.tolist()[:4]}: h and w must be multiples of the "
                f"spatial_merge_size {merge}"
            )
        want = media.patches_per_row(batch.batch_size) // (merge * merge)
        bad = torch.nonzero(want != found).flatten().tolist()
        if bad:
            r = bad[0]
            raise InvalidInput(
                f"TokenBatch row {r}: {int(found[r])} {attr}={int(token)} placeholder tokens but its "
                f"{name} need {int(want[r])} (t*h*w / merge_size**2 = {merge}**2 per image); rows "
                f"{bad[:5]} disagree. Tokenize with the model's processor, which expands the placeholders"
            )


def multimodal_inputs(batch: TokenBatch) -> dict[str, torch.Tensor] | None:
    """The ``multimodal`` mapping :func:`underlay.models.packed_forward` takes for ``batch`` (keys of
    ``MULTIMODAL_KEYS``), images and videos in row order (the order of their placeholders in the
    packed ``input_ids``); ``None`` for a batch without images and videos."""
    if not batch.has_vision:
        return None
    out: dict[str, torch.Tensor] = {}
    if batch.images is not None:
        out["pixel_values"] = batch.images.pixel_values
        out["image_grid_thw"] = batch.images.grid_thw
    if batch.videos is not None:
        out["pixel_values_videos"] = batch.videos.pixel_values
        out["video_grid_thw"] = batch.videos.grid_thw
        if batch.videos.second_per_grid is not None:
            out["second_per_grid_ts"] = batch.videos.second_per_grid
    return out


def vision_calls(batch: TokenBatch) -> int:
    """How many times transformers' Qwen-VL forward runs the vision tower on ``batch``: once for its
    images and once for its videos (0, 1 or 2)."""
    return int(batch.images is not None) + int(batch.videos is not None)


def patch_cost(hf_config: Any) -> float:
    """Micro-batch budget tokens one vision patch costs, for a vision-language config (0.0 for a text
    config): ``(vision hidden * vision depth) / (text hidden * text layers)``.

    Why: ``micro_batch_max_tokens`` bounds the activation memory of a micro-batch; what the decoder
    stores per token grows with ``hidden * layers``, and the vision tower stores the same kinds of
    activations (norms, attention in/out, MLP) per patch in each of its blocks. The placeholder tokens
    the merged patches become are already counted as text tokens. For Qwen2.5-VL-7B (vision 1280 x 32,
    text 3584 x 28) a patch costs 0.41 tokens, so a 4-patch merged token costs 2.6 tokens in all."""
    if not is_vision_config(hf_config):
        return 0.0
    vc = _vision_config(hf_config)
    text = getattr(hf_config, "text_config", None) or hf_config
    v_hidden = int(getattr(vc, "hidden_size", 0) or getattr(vc, "embed_dim", 0) or 0)
    v_depth = int(getattr(vc, "depth", 0) or getattr(vc, "num_hidden_layers", 0) or 0)
    t_hidden = int(getattr(text, "hidden_size", 0) or 0)
    t_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    if min(v_hidden, v_depth, t_hidden, t_layers) < 1:
        raise ConfigError(
            f"patch_cost: vision hidden/depth {v_hidden}/{v_depth} and text hidden/layers "
            f"{t_hidden}/{t_layers} must all be >= 1 in the config"
        )
    return (v_hidden * v_depth) / (t_hidden * t_layers)


def sequence_costs(hf_config: Any, batch: TokenBatch) -> list[int]:
    """The micro-batch planner's cost of each row: its real tokens plus ``ceil(patches *
    patch_cost(hf_config))`` for the patches of its images and videos. Text batches: the token counts."""
    costs = batch.attention_mask.sum(dim=1).cpu().to(torch.float64)
    weight = patch_cost(hf_config) if batch.has_vision else 0.0
    media: list[VisionInputs] = [m for m in (batch.images, batch.videos) if m is not None]
    for m in media:
        costs = costs + m.patches_per_row(batch.batch_size).to(torch.float64) * weight
    return [math.ceil(c - 1e-9) for c in costs.tolist()]


def _tensor_sum(value: Any) -> torch.Tensor | None:
    """Sum of every floating tensor in a (nested) model output, as a scalar (``None``: none)."""
    if isinstance(value, torch.Tensor):
        return value.sum() if value.is_floating_point() else None
    items: list[Any]
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif hasattr(value, "to_tuple"):
        items = list(value.to_tuple())
    else:
        return None
    total: torch.Tensor | None = None
    for item in items:
        s = _tensor_sum(item)
        if s is not None:
            total = s if total is None else total + s
    return total


def zero_vision_pass(backbone: nn.Module) -> torch.Tensor:
    """Run the vision tower ``backbone.visual`` once on a minimal random image (one merged token:
    a ``1 x m x m`` patch grid, ``m = spatial_merge_size``) and return ``0 * sum(outputs)``, a zero
    scalar whose backward runs through every vision block with zero gradients.

    Why: when the vision blocks are FSDP units every rank must run them as often as the others (each
    run all-gathers, each backward reduce-scatters); a rank whose micro-batch has fewer images or
    videos than another rank's adds this pass. Call it inside the root module's forward (its
    parameters unsharded). Raises ``ConfigError`` when the backbone has no ``visual`` tower."""
    visual = getattr(backbone, "visual", None)
    config = getattr(backbone, "config", None)
    if not isinstance(visual, nn.Module) or config is None:
        raise ConfigError(f"{type(backbone).__name__} has no vision tower (.visual) to run")
    vc = _vision_config(config)
    m = _merge_size(config)
    width = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
    param = next(visual.parameters())
    dtype = param.dtype if param.is_floating_point() else torch.float32
    device = param.device if param.device.type != "meta" else torch.device("cpu")
    g = torch.Generator(device="cpu").manual_seed(0)
    pixels = torch.randn(m * m, width, generator=g).to(device=device, dtype=dtype)
    grid = torch.tensor([[1, m, m]], dtype=torch.long, device=device)
    total = _tensor_sum(visual(pixels, grid_thw=grid))
    if total is None:
        raise ConfigError(f"{type(visual).__name__} returned no floating tensor")
    return total * 0.0


_VALUE_CLASSES: dict[Any, Any] = {}


def _value_class(backbone_cls: Any) -> Any:
    """The value-model class over ``backbone_cls`` (e.g. ``Qwen2_5_VLModel``), made once per backbone:
    a subclass of the backbone's ``PreTrainedModel`` base (so ``_no_split_modules``, weight init,
    gradient checkpointing and attention-implementation switching behave as in transformers' own
    classes) holding ``model`` (the backbone) and ``score`` (``nn.Linear(text hidden, 1)`` with bias,
    as transformers' ``*ForTokenClassification`` heads)."""
    cls = _VALUE_CLASSES.get(backbone_cls)
    if cls is not None:
        return cls
    from transformers.modeling_outputs import TokenClassifierOutput

    base: Any = backbone_cls.__bases__[0]

    def __init__(self: Any, config: Any) -> None:
        base.__init__(self, config)
        text = config.get_text_config()
        self.model = backbone_cls(config)
        self.score = nn.Linear(int(text.hidden_size), 1)
        self.post_init()

    def forward(
        self: Any,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """Per-token values ``logits [B, S, 1]`` (the score head on the backbone's last hidden states;
        no shift). Keyword arguments (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``, ...)
        go to the backbone."""
        kwargs.setdefault("use_cache", False)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )
        return TokenClassifierOutput(logits=self.score(out.last_hidden_state))

    stem = backbone_cls.__name__.removesuffix("Model")
    cls = type(
        f"{stem}ValueModel",
        (base,),
        {
            "__init__": __init__,
            "forward": forward,
            "__module__": __name__,
            "base_model_prefix": "model",
            # transformers decides whether the attention / experts implementation may be switched by
            # reading the class's module source; the backbone's module is the one that defines them
            "_can_set_attn_implementation_cached_value": backbone_cls._can_set_attn_implementation(),
            "_can_set_experts_implementation_cached_value": backbone_cls._can_set_experts_implementation(),
        },
    )
    _VALUE_CLASSES[backbone_cls] = cls
    return cls


def vision_value_model(hf_config: Any, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A value model (RL critic) of a Qwen-VL style vision-language config, which transformers has no
    token-classification head for: the model type's backbone (``AutoModel``: vision tower + language
    model, at ``.model``) plus ``score = nn.Linear(text_config.hidden_size, 1)`` (weight and bias), in
    ``dtype`` with transformers' initialisation (seed it with ``torch.manual_seed`` first).

    The module's class is ``<Backbone>ValueModel`` (``Qwen2_5_VLValueModel``, ``Qwen3VLValueModel``,
    ...), a subclass of the backbone's ``PreTrainedModel`` base; :func:`underlay.models.prepare_model`
    and :func:`underlay.models.packed_forward` treat it as any value model (``values`` fp32 ``[T]``,
    the head at token ``t``, no shift), with images and videos in ``multimodal``. Its parameter names
    are the backbone's under ``model.`` (as in the causal LM) plus ``score.weight`` / ``score.bias``.
    Sets ``hf_config.num_labels = 1``. Raises ``ConfigError`` for a config that is not a
    vision-language config or whose model type has no transformers backbone class."""
    if not is_vision_config(hf_config):
        raise ConfigError(
            f"vision_value_model: {getattr(hf_config, 'model_type', hf_config)!r} is not a vision-language "
            "config (no vision_config); build text value models with AutoModelForTokenClassification"
        )
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        backbone_cls: Any = MODEL_MAPPING[type(hf_config)]
    except KeyError:
        raise ConfigError(
            f"vision_value_model: transformers has no backbone (AutoModel) class for {type(hf_config).__name__}"
        ) from None
    hf_config.num_labels = 1
    cls: Any = _value_class(backbone_cls)
    return cls._from_config(hf_config, dtype=dtype)  # type: ignore[no-any-return]


def split_media(patches: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges ``[start, stop)`` of the items (images or videos) with ``patches[i]`` patches
    each, one range per part, balancing the patches: part ``r`` starts at the first item whose
    preceding patches reach ``r / parts`` of the total (ranges may be empty when there are fewer items
    than parts). ``InvalidInput`` for ``parts < 1`` or a negative count."""
    if parts < 1 or any(p < 0 for p in patches):
        raise InvalidInput(f"split_media: parts={parts} must be >= 1 and patch counts {patches[:8]} >= 0")
    before = [0]
    for p in patches:
        before.append(before[-1] + p)
    total = before[-1]
    starts = [0] + [bisect.bisect_left(before, total * r / parts, 0, len(patches)) for r in range(1, parts)]
    starts = [max(starts[: i + 1]) for i in range(parts)]  # non-decreasing
    return [(starts[r], starts[r + 1] if r + 1 < parts else len(patches)) for r in range(parts)]


class _GatherShares(torch.autograd.Function):
    """All-gather of equal-shaped ``[n, D]`` shares along dim 0 (rank order); backward: the sum over
    the group of the gradients of this rank's share (each rank's loss may use every share)."""

    @staticmethod
    def forward(ctx: Any, share: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        ctx.rank = sp_rank(group)
        ctx.rows = int(share.shape[0])
        pieces = [torch.empty_like(share) for _ in range(sp_world_size(group))]
        dist.all_gather(pieces, share.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)  # gloo has no reduce-scatter; the shares are small
        return total.narrow(0, ctx.rank * ctx.rows, ctx.rows), None


class _TowerShard:
    """State of one sharded vision-tower call (see :func:`shard_vision_tower`)."""

    def __init__(self, group: Any, merge: int) -> None:
        self.group = group
        self.sp = sp_world_size(group)
        self.rank = sp_rank(group)
        self.merge = merge
        self.counts: list[int] = []
        self.dummy = False

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kwargs = dict(kwargs)
        pixels = args[0] if args else kwargs.pop("hidden_states")
        grid: torch.Tensor = kwargs["grid_thw"]
        patches = [int(t * h * w) for t, h, w in grid.tolist()]  # one host read of the grid
        ranges = split_media(patches, self.sp)
        merged = [p // (self.merge * self.merge) for p in patches]
        self.counts = [sum(merged[a:b]) for a, b in ranges]
        a, b = ranges[self.rank]
        self.dummy = a == b
        if self.dummy:  # no item here: one merged token of zeros keeps the FSDP-sharded blocks in step
            m = self.merge
            pixels = pixels.new_zeros(m * m, pixels.shape[-1])
            local_grid = grid.new_tensor([[1, m, m]])
        else:
            first, last = sum(patches[:a]), sum(patches[:b])
            pixels, local_grid = pixels[first:last], grid[a:b]
        kwargs["grid_thw"] = local_grid
        return (pixels, *args[1:]), kwargs

    def post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        local: torch.Tensor = output.pooler_output
        if self.dummy:  # zero rows, still attached to the tower's graph (its backward runs with zeros)
            local = local[:0] + 0.0 * local.sum()
        most = max(self.counts)
        padded = torch.nn.functional.pad(local, (0, 0, 0, most - int(local.shape[0])))
        gathered: torch.Tensor = _GatherShares.apply(padded, self.group)  # type: ignore[no-untyped-call]
        pieces = gathered.chunk(self.sp)
        output.pooler_output = torch.cat([piece[:n] for piece, n in zip(pieces, self.counts)])
        return output


@contextlib.contextmanager
def shard_vision_tower(backbone: nn.Module, group: Any | None) -> Iterator[None]:
    """Inside the block, each call of ``backbone.visual`` (a Qwen2.5-VL style tower: ``visual(pixels,
    grid_thw=...)`` returning ``pooler_output [merged tokens, D]``) on the ranks of the Ulysses
    ``group`` runs the tower on this rank's contiguous share of the images (or videos) only, balanced
    by patches (:func:`split_media`), and all-gathers the merged features, so every rank gets the
    features of all items in order while the tower's work is split ``sp`` ways instead of repeated.
    Every rank of the group must make the same calls with the same grids (Ulysses ranks pass the same
    batch). A rank without an item runs the tower on one zero merged token whose output enters with
    weight 0, so FSDP-sharded vision blocks run as often on every rank.

    Gradients follow :mod:`underlay.parallel.ulysses`: the all-gather's backward sums, over the group,
    the gradients of this rank's features (each rank's tokens may use any item's features), so each
    rank's tower gradients are those of its items and their sum over the group equals the
    single-process gradient. ``last_hidden_state`` of the tower's output, unused by the language model,
    is this rank's share only. A no-op for ``sp == 1``. Raises ``ConfigError`` when the backbone has no
    ``visual`` tower."""
    if sp_world_size(group) == 1:
        yield
        return
    visual = getattr(backbone, "visual", None)
    config = getattr(backbone, "config", None)
    if not isinstance(visual, nn.Module) or config is None:
        raise ConfigError(f"{type(backbone).__name__} has no vision tower (.visual) to shard")
    state = _TowerShard(group, _merge_size(config))
    handles = [
        visual.register_forward_pre_hook(state.pre, with_kwargs=True),
        visual.register_forward_hook(state.post, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
