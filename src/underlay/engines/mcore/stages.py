"""Which layers each pipeline chunk holds (even or uneven splits) and the partial-recompute fields.

Uneven pipeline stages are megatron's ``num_layers_in_first_pipeline_stage`` /
``num_layers_in_last_pipeline_stage`` (given through ``MCoreOptions.transformer``); megatron's own
layer-offset functions decide the split, and the weight map reads it from there
(``chunk_layer_spans``), so the engine's names always match the layers megatron built. Partial
recompute is megatron's ``recompute_method`` (``"uniform"``: groups of ``recompute_num_layers``
layers are checkpointed; ``"block"``: the first ``recompute_num_layers`` layers of each chunk) under
``EngineConfig.recompute="full"``, and ``recompute_modules`` under ``"selective"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from underlay.interfaces import ConfigError

__all__ = ["check_recompute_fields", "chunk_layer_spans", "stage_layer_counts"]

_FULL_ONLY = ("recompute_method", "recompute_num_layers", "distribute_saved_activations")
_SELECTIVE_ONLY = ("recompute_modules",)


def stage_layer_counts(transformer: Mapping[str, Any] | None) -> tuple[int | None, int | None]:
    """``(first, last)``: the layer counts of the first and last pipeline stage given in the
    pass-through ``transformer`` (``None`` where not given). ``ConfigError`` for a count that is not
    an int >= 1."""
    out: list[int | None] = []
    for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        value = (transformer or {}).get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"mcore: options transformer[{key!r}]={value!r} must be an int >= 1")
        out.append(value)
    return out[0], out[1]


def check_recompute_fields(recompute: str, transformer: Mapping[str, Any] | None) -> None:
    """``ConfigError`` when the pass-through sets partial-recompute fields that the recompute policy
    ``recompute`` (``EngineConfig.recompute`` with ``"auto"`` resolved to ``"none"``) does not use:
    ``recompute_method``/``recompute_num_layers``/``distribute_saved_activations`` need ``"full"``,
    ``recompute_modules`` needs ``"selective"``; a ``recompute_method`` other than ``"uniform"`` or
    ``"block"`` or a ``recompute_num_layers`` that is not an int >= 1 is refused too."""
    given = dict(transformer or {})
    for key in _FULL_ONLY:
        if key in given and recompute != "full":
            raise ConfigError(
                f"mcore: options transformer[{key!r}] is partial full-layer recompute; it needs "
                f"EngineConfig.recompute='full' (it is {recompute!r})"
            )
    for key in _SELECTIVE_ONLY:
        if key in given and recompute != "selective":
            raise ConfigError(
                f"mcore: options transformer[{key!r}] chooses the selectively recomputed modules; it needs "
                f"EngineConfig.recompute='selective' (it is {recompute!r})"
            )
    method = given.get("recompute_method", "uniform")
    if method not in ("uniform", "block"):
        raise ConfigError(
            f"mcore: options transformer['recompute_method']={method!r}: use 'uniform' or 'block'"
        )
    n = given.get("recompute_num_layers", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"mcore: options transformer['recompute_num_layers']={n!r} must be an int >= 1")


def chunk_layer_spans(tf_config: Any, pp: int, vpp: int) -> list[list[tuple[int, int]]]:
    """``spans[v][stage] = (first global layer, layer count)`` of every pipeline chunk, as megatron
    builds them for ``tf_config`` (its ``get_transformer_layer_offset`` and
    ``get_num_layers_to_build``, even or uneven splits). Needs megatron; reads no process state."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    spans: list[list[tuple[int, int]]] = []
    for v in range(vpp):
        vp = v if vpp > 1 else None
        row = []
        for stage in range(pp):
            first = int(get_transformer_layer_offset(tf_config, vp_stage=vp, pp_rank=stage))
            count = int(get_num_layers_to_build(tf_config, vp_stage=vp, pp_rank=stage))
            row.append((first, count))
        spans.append(row)
    return spans
