"""Device-agnostic math in plain torch. Imports only ``underlay.interfaces``.

Submodules: ``logprob`` (log-probs/entropy from logits or hidden states), ``masked`` (masked
statistics), ``packing`` (THD unpad/pad, position ids), ``groups`` (GRPO group statistics),
``balancing`` (sequence-length balancing, micro-batch planning), ``schedules`` (LR schedules),
``flops`` (FLOPs/MFU), ``loss`` (verl's loss aggregation modes over the global batch),
``distributed`` (statistics reduced over a process group); ``attention`` and
``quant`` hold argument checks and references shared by the attention and quantisation backends.
"""

from underlay.ops.balancing import (
    ATTENTION_WORKLOAD_A,
    balanced_group_partitions,
    balanced_partitions,
    greedy_lpt,
    karmarkar_karp,
    partition_loads,
    plan_micro_batches,
    restore_order,
)
from underlay.ops.distributed import collective_device, distributed_masked_mean, distributed_mean_max_min_std
from underlay.ops.flops import SUPPORTED_MODEL_TYPES, FlopsCounter
from underlay.ops.groups import group_ids_to_index, group_mean_std, group_normalize
from underlay.ops.logprob import entropy_from_logits, linear_logprobs, logprobs_from_logits
from underlay.ops.loss import AGGREGATION_MODES, AggregationMode, aggregate_loss
from underlay.ops.masked import (
    clip_by_value,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    response_mask,
)
from underlay.ops.packing import pad, pad_to_multiple, position_ids_from_mask, unpad
from underlay.ops.schedules import (
    build_lr_scheduler,
    constant_with_warmup,
    cosine_with_warmup,
    warmup_stable_decay,
)

__all__ = [
    "AGGREGATION_MODES",
    "ATTENTION_WORKLOAD_A",
    "SUPPORTED_MODEL_TYPES",
    "AggregationMode",
    "FlopsCounter",
    "aggregate_loss",
    "balanced_group_partitions",
    "balanced_partitions",
    "build_lr_scheduler",
    "clip_by_value",
    "collective_device",
    "constant_with_warmup",
    "cosine_with_warmup",
    "distributed_masked_mean",
    "distributed_mean_max_min_std",
    "entropy_from_logits",
    "greedy_lpt",
    "group_ids_to_index",
    "group_mean_std",
    "group_normalize",
    "karmarkar_karp",
    "linear_logprobs",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pad",
    "pad_to_multiple",
    "partition_loads",
    "plan_micro_batches",
    "position_ids_from_mask",
    "response_mask",
    "restore_order",
    "unpad",
    "warmup_stable_decay",
]
