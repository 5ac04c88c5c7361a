"""Hugging Face model integration: attention routing, remove-padding, Ulysses SP, fused head, TiledMLP.

Typical use by an RL trainer (the FSDP2 engine does this for you)::

    model = AutoModelForCausalLM.from_config(cfg)          # or from_pretrained(...)
    prepare_model(model, sp_group=None, tiled_mlp_tiles=4)  # in place
    packed = ops.unpad(input_ids, attention_mask)           # PackedBatch, THD
    out = packed_forward(model, packed, temperature=1.0)    # TokenOutputs with [T] fields
    log_probs = ops.pad(out.log_probs, packed)              # [B, S]; 0 at position 0 and padding

``import underlay.models`` does not import transformers; it is imported when a model is prepared.
"""

from underlay.models._compat import (
    SUPPORTED_ARCHITECTURES,
    TESTED_TRANSFORMERS,
    ModelCapabilities,
    check_transformers_version,
    inspect_model,
)
from underlay.models.attention import ATTN_IMPLEMENTATION, cu_seqlens_from_position_ids
from underlay.models.forward import (
    MULTIMODAL_KEYS,
    multimodal_position_ids,
    next_token_labels,
    packed_forward,
    shift_to_tokens,
    softcapped_logprobs,
)
from underlay.models.prepare import prepare_model
from underlay.models.randomness import TRAINING_RANDOMNESS, set_training_mode
from underlay.models.rope import apply_per_sequence_rope
from underlay.models.tiled_mlp import TiledMLP, apply_tiled_mlp
from underlay.models.vision import (
    PROCESSOR_FILES,
    check_vision_batch,
    is_vision_config,
    multimodal_inputs,
    patch_cost,
    sequence_costs,
    vision_calls,
    vision_value_model,
    zero_vision_pass,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "MULTIMODAL_KEYS",
    "PROCESSOR_FILES",
    "SUPPORTED_ARCHITECTURES",
    "TESTED_TRANSFORMERS",
    "TRAINING_RANDOMNESS",
    "ModelCapabilities",
    "TiledMLP",
    "apply_per_sequence_rope",
    "apply_tiled_mlp",
    "check_transformers_version",
    "check_vision_batch",
    "cu_seqlens_from_position_ids",
    "inspect_model",
    "is_vision_config",
    "multimodal_inputs",
    "multimodal_position_ids",
    "next_token_labels",
    "packed_forward",
    "patch_cost",
    "prepare_model",
    "sequence_costs",
    "set_training_mode",
    "shift_to_tokens",
    "softcapped_logprobs",
    "vision_calls",
    "vision_value_model",
    "zero_vision_pass",
]
