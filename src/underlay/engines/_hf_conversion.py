"""Checkpoint layouts read from transformers' own conversion mapping (transformers >= 5).

transformers 5 keeps some tensors in memory in another layout than its checkpoints hold (fused MoE
experts ``experts.gate_up_proj [E, 2I, H]`` for per-expert ``experts.{e}.gate_proj.weight`` ...,
renamed routers and routing biases, renamed attention projections); ``from_pretrained`` converts the
files with the model's ``WeightTransform`` list (``conversion_mapping.get_model_conversion_mapping``)
and ``save_pretrained`` writes the reverse (``core_model_loading.revert_weight_conversion``).

:class:`HFConversion` holds that list for one model and makes, per engine parameter, a ``WeightRule``
between the in-memory tensor and the file tensors *with transformers' own transforms*: ``to_hf`` runs
the reverse transform (what ``save_pretrained`` writes), ``from_hf`` the forward one (what
``from_pretrained`` reads), so a file written by ``save_pretrained`` loads bit-for-bit and an export
is what ``from_pretrained`` reads back. Only transforms that build one in-memory tensor from the file
tensors are expressible as a rule (one engine parameter each); a converter that builds one *file*
tensor from several in-memory tensors (a fused ``query_key_value`` split into ``q_proj``/``k_proj``/
``v_proj`` on load) is refused by name (``ConfigError``) when the map is built.

Uses transformers' ``WeightTransform`` API (``reverse_transform``, ``rename_source_key``,
``add_tensor``, ``convert``), which save and load go through; a transformers without it (4.x) has no
conversions and every name maps as is.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from underlay.interfaces import ConfigError, InvalidInput, WeightRule

__all__ = ["CONVERTED", "HFConversion", "hf_conversion"]

CONVERTED = "hf_conversion"
"""``WeightRule.kind`` of the rules that run a transformers converter (not a plain rename)."""


def _natural(name: str) -> tuple[Any, ...]:
    # expert 10 after expert 9: transformers stacks per-expert tensors in this order
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


class _ShapeModel:
    """What transformers' conversion ops read of the model (``get_parameter(name).shape`` and
    ``config``), from recorded shapes: no parameter storage is touched."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], config: Any) -> None:
        self._shapes = dict(shapes)
        self.config = config

    def get_parameter(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise AttributeError(f"no parameter {name!r}")
        return torch.empty(self._shapes[name], device="meta")


class HFConversion:
    """The ``WeightTransform`` list transformers uses to load ``model`` (``forward``) and its reverse
    (what ``save_pretrained`` applies), with the shapes of every named tensor (HF names, peft removed).
    Build with :func:`hf_conversion`; :meth:`rule` makes the rule of one engine parameter."""

    def __init__(self, forward: list[Any], shapes: Mapping[str, tuple[int, ...]], config: Any) -> None:
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.forward = forward
        reverse = [t.reverse_transform() for t in forward[::-1]]
        self._fwd_renamings = [t for t in forward if isinstance(t, WeightRenaming)]
        self._fwd_converters = [t for t in forward if isinstance(t, WeightConverter)]
        self._rev_renamings = [t for t in reverse if isinstance(t, WeightRenaming)]
        self._rev_converters = [t for t in reverse if isinstance(t, WeightConverter)]
        self._model = _ShapeModel(shapes, config)

    @staticmethod
    def _first(key: str, converters: list[Any]) -> tuple[Any, str, str] | None:
        for conv in converters:
            renamed, pattern = conv.rename_source_key(key)
            if pattern is not None:
                return conv, renamed, pattern
        return None

    @staticmethod
    def _renamed(key: str, renamings: list[Any]) -> str:
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
        return key

    def _run(
        self, template: Any, key: str, inputs: Iterable[tuple[str, str, torch.Tensor]]
    ) -> dict[str, Any]:
        conv = copy.deepcopy(template)  # converters collect tensors in place: a fresh one per call
        for source, pattern, tensor in inputs:
            conv.add_tensor(key, source, pattern, tensor)
        out = conv.convert(key, model=self._model, config=self._model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    def file_name(self, hf: str) -> str:
        """The name ``save_pretrained`` writes the in-memory tensor ``hf`` under when no converter
        takes it (renamings only); ``hf`` itself when a converter does (see :meth:`rule`)."""
        if self._first(hf, self._rev_converters) is not None:
            return hf
        return self._renamed(hf, self._rev_renamings)

    def rule(
        self, engine_name: str, hf: str, shape: tuple[int, ...], *, optional: bool = False
    ) -> WeightRule:
        """The rule of engine parameter ``engine_name`` (HF in-memory name ``hf``, full ``shape``): a
        rename to the file name ``save_pretrained`` writes, or (``kind == CONVERTED``) transformers'
        converter both ways. ``ConfigError`` naming the converter when the file tensor is built from
        several in-memory tensors, or when the forward transform does not rebuild ``hf`` from the
        files the reverse one writes."""
        from underlay.engines._weightmap import rename

        found = self._first(hf, self._rev_converters)
        if found is None:
            return rename(engine_name, self._renamed(hf, self._rev_renamings), optional=optional)
        rev, key, pattern = found
        if len(rev.source_patterns) > 1:
            raise ConfigError(
                f"{hf}: transformers' checkpoint layout builds one file tensor from several in-memory "
                f"tensors ({rev.source_patterns} -> {rev.target_patterns}, {getattr(rev, 'operations', '')}); "
                "the fsdp2 weight map has one rule per parameter and cannot load or export that fused file "
                "tensor (missing capability: many-parameter checkpoint tensors)"
            )
        meta = self._run(rev, key, [(hf, pattern, torch.empty(shape, device="meta"))])
        files = {self._renamed(k, self._rev_renamings): k for k in meta}
        names = tuple(sorted(files, key=_natural))
        fwd: list[tuple[Any, str, str]] = []
        for name in names:
            hit = self._first(self._renamed(name, self._fwd_renamings), self._fwd_converters)
            if hit is None or hit[1] != hf or (fwd and hit[0] is not fwd[0][0]):
                raise ConfigError(
                    f"{hf}: transformers' conversion writes {names[:3]} but does not read {name!r} back "
                    f"into {hf!r} (matched {hit[1] if hit else None!r}); the checkpoint layout cannot be "
                    "converted both ways"
                )
            fwd.append(hit)

        def to_hf(full: torch.Tensor) -> dict[str, torch.Tensor]:
            out = self._run(rev, key, [(hf, pattern, full)])
            by_file = {self._renamed(k, self._rev_renamings): v for k, v in out.items()}
            return {n: by_file[n] for n in names}

        def from_hf(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
            missing = [n for n in names if n not in tensors]
            if missing:
                raise InvalidInput(
                    f"{engine_name}: HF tensors {missing[:3]} are missing ({len(missing)} in all)"
                )
            out = self._run(
                fwd[0][0], hf, [(n, p, tensors[n]) for n, (_, _, p) in zip(names, fwd, strict=True)]
            )
            return out[hf]  # type: ignore[no-any-return]

        return WeightRule(engine_name, names, to_hf, from_hf, optional=optional, kind=CONVERTED)


def hf_conversion(model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> HFConversion | None:
    """transformers' conversion list of ``model`` (a ``PreTrainedModel``, e.g. on the meta device, not
    yet wrapped by FSDP: transformers looks transforms up by class name and ``model_type``) as
    ``save_pretrained`` of a model built from its config uses it (no legacy renames, no prefix
    changes); ``shapes``: HF name -> shape of every tensor of the weight map. ``None`` when the model
    has no conversion (every tensor is saved under its own name) or transformers has no conversion
    mapping."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers 4: no conversion mapping
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    forward = [
        t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)
    ]
    return HFConversion(forward, shapes, model.config) if forward else None
