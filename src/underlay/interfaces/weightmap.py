"""Declarative weight conversion between an engine's parameters and Hugging Face tensors.

A ``WeightMap`` lists one ``WeightRule`` per engine parameter of a concrete model. A rule names the HF
tensors the parameter is built from and holds two pure functions between the *full* engine tensor (the
layout it has with no tensor parallelism, ``tp == 1``) and those HF tensors, plus how tensor
parallelism splits the full tensor (``tp_dim``, ``tp_parts``, ``tp_unit``). Loaders, exporters and
``ParallelEngine.iter_weights`` are driven by the map, so a new engine or architecture adds rules, not
a loader. Rules for a concrete model come from ``RulePattern``s (a regular expression over engine
parameter names and a builder) through ``WeightMap.resolve``; the reusable rule constructors (rename,
q/k/v fusion with GQA grouping, gate/up fusion, expert stacking) live in
``underlay.engines._weightmap``.

Everything here is plain torch and works on the meta device (shapes are derived without memory).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from underlay.interfaces.errors import ConfigError, InvalidInput

__all__ = ["RuleBuilder", "RulePattern", "WeightMap", "WeightRule"]


@dataclass(frozen=True)
class WeightRule:
    """How one engine parameter maps to Hugging Face tensors.

    - ``engine_name``: the parameter's name in the engine (``ParallelEngine.named_full_parameters``).
    - ``hf_names``: the HF tensors it is built from, in the order ``to_hf`` returns them.
    - ``to_hf(full) -> {hf_name: tensor}``: the full engine tensor (``tp == 1`` layout) to its HF
      tensors. Pure: no communication, no state; the outputs may be views of ``full``.
    - ``from_hf({hf_name: tensor}) -> full``: the inverse; ``from_hf(to_hf(x))`` equals ``x`` exactly.
    - ``tp_dim``: the dimension tensor parallelism splits (``None``: replicated on every tp rank).
    - ``tp_parts``: the full tensor is ``tp_parts`` equal blocks along ``tp_dim`` that are split
      separately; tp rank ``r`` holds the ``r``-th chunk of every block, concatenated (Megatron's
      ``linear_fc1`` = [gate; up] has 2).
    - ``tp_unit``: rows (along ``tp_dim``, per block) that must stay on one rank (a q/k/v query group
      has ``(heads_per_group + 2) * head_dim``).
    - ``optional``: checkpoints may lack it (a value head); loading leaves it as initialised.
    - ``engine_shape``: the full shape of the engine parameter (set by ``WeightMap.resolve``; ``None``
      when the rule was built without one).
    - ``kind``: what the rule does, for messages and ``repr`` (``"rename"``, ``"fuse_qkv"``, ...).
    """

    engine_name: str
    hf_names: tuple[str, ...]
    to_hf: Callable[[torch.Tensor], dict[str, torch.Tensor]] = field(repr=False, compare=False)
    from_hf: Callable[[Mapping[str, torch.Tensor]], torch.Tensor] = field(repr=False, compare=False)
    tp_dim: int | None = None
    tp_parts: int = 1
    tp_unit: int = 1
    optional: bool = False
    engine_shape: tuple[int, ...] | None = None
    kind: str = "rename"

    def __post_init__(self) -> None:
        if not self.hf_names or len(set(self.hf_names)) != len(self.hf_names):
            raise ConfigError(
                f"WeightRule {self.engine_name!r}: hf_names={self.hf_names} must be non-empty and distinct"
            )
        if self.tp_parts < 1 or self.tp_unit < 1:
            raise ConfigError(
                f"WeightRule {self.engine_name!r}: tp_parts={self.tp_parts}, tp_unit={self.tp_unit} must be >= 1"
            )

    def hf_shapes(self, engine_shape: Sequence[int] | None = None) -> dict[str, tuple[int, ...]]:
        """Shape of every HF tensor for an engine parameter of ``engine_shape`` (default: the rule's
        ``engine_shape``), computed on the meta device. ``ConfigError`` when no shape is known."""
        shape = engine_shape if engine_shape is not None else self.engine_shape
        if shape is None:
            raise ConfigError(f"WeightRule {self.engine_name!r} has no engine_shape; pass one")
        out = self.to_hf(torch.empty(tuple(shape), device="meta"))
        return {name: tuple(out[name].shape) for name in self.hf_names}

    def _check_tp(self, length: int, size: int) -> int:
        if self.tp_dim is None:
            return length
        block = length // self.tp_parts
        if length % self.tp_parts or block % (size * self.tp_unit):
            raise ConfigError(
                f"{self.engine_name}: dim {self.tp_dim} of length {length} ({self.tp_parts} block(s) of "
                f"{block}, units of {self.tp_unit}) cannot be split over tp={size} ranks without splitting "
                "a unit (e.g. a query group); choose tp dividing the number of units"
            )
        return block

    def tp_shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Tensor-parallel rank ``rank``'s piece (of ``size``) of the full engine tensor ``full`` (a view
        or a new tensor). The full tensor itself when ``tp_dim`` is ``None`` or ``size == 1``."""
        if not 0 <= rank < size:
            raise InvalidInput(f"tp_shard: rank {rank} is not in [0, {size})")
        if self.tp_dim is None or size == 1:
            return full
        dim = self.tp_dim
        block = self._check_tp(int(full.shape[dim]), size)
        piece = block // size
        blocks = [full.narrow(dim, b * block + rank * piece, piece) for b in range(self.tp_parts)]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=dim)

    def tp_unshard(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full engine tensor from every tp rank's piece, in rank order (inverse of ``tp_shard``)."""
        if not pieces:
            raise InvalidInput(f"tp_unshard {self.engine_name}: no pieces")
        if self.tp_dim is None or len(pieces) == 1:
            return pieces[0]
        dim = self.tp_dim
        parts = [p.chunk(self.tp_parts, dim=dim) for p in pieces]
        return torch.cat([parts[r][b] for b in range(self.tp_parts) for r in range(len(pieces))], dim=dim)


class RuleBuilder(Protocol):
    """Builds the rule of one engine parameter from the match of its name and its full shape."""

    def __call__(self, match: re.Match[str], shape: tuple[int, ...]) -> WeightRule: ...


@dataclass(frozen=True)
class RulePattern:
    """``pattern`` (a regular expression, full-matched against engine parameter names) and the
    ``build`` function that makes the rule of a matching parameter. ``skip=True`` patterns mark engine
    parameters with no HF counterpart (LoRA adapters): they get no rule."""

    pattern: str
    build: RuleBuilder | None = None
    skip: bool = False

    def __post_init__(self) -> None:
        if (self.build is None) != self.skip:
            raise ConfigError(f"RulePattern {self.pattern!r}: give a build function, or skip=True alone")


@dataclass(frozen=True)
class WeightMap:
    """The weight conversion of one concrete model: one rule per engine parameter with HF counterparts.

    - ``rules``: in engine parameter order; engine names and HF names are each unique over all rules.
    - ``tied``: HF alias name -> HF name it shares storage with (``lm_head.weight`` ->
      ``model.embed_tokens.weight`` with tied embeddings). Exports write the canonical name only;
      loading accepts the alias in files (used when the canonical name is absent).
    - ``ignored``: ``fnmatch`` patterns of HF names a checkpoint may hold that this model does not use
      (a causal LM's ``lm_head.weight`` when loading it into a value model): never "unexpected".
    """

    rules: tuple[WeightRule, ...]
    tied: Mapping[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    _by_engine: dict[str, WeightRule] = field(init=False, repr=False, compare=False)
    _by_hf: dict[str, WeightRule] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_engine: dict[str, WeightRule] = {}
        by_hf: dict[str, WeightRule] = {}
        for rule in self.rules:
            if rule.engine_name in by_engine:
                raise ConfigError(f"WeightMap: two rules for engine parameter {rule.engine_name!r}")
            by_engine[rule.engine_name] = rule
            for hf in rule.hf_names:
                if hf in by_hf:
                    raise ConfigError(
                        f"WeightMap: HF tensor {hf!r} is claimed by {by_hf[hf].engine_name!r} and "
                        f"{rule.engine_name!r}"
                    )
                by_hf[hf] = rule
        for alias, target in self.tied.items():
            if target not in by_hf:
                raise ConfigError(f"WeightMap.tied: {alias!r} -> {target!r}, which no rule produces")
        object.__setattr__(self, "_by_engine", by_engine)
        object.__setattr__(self, "_by_hf", by_hf)

    def rule(self, engine_name: str) -> WeightRule:
        """The rule of ``engine_name``; ``InvalidInput`` naming a few known names when there is none."""
        try:
            return self._by_engine[engine_name]
        except KeyError:
            known = list(self._by_engine)[:5]
            raise InvalidInput(
                f"WeightMap: no rule for engine parameter {engine_name!r} (e.g. {known})"
            ) from None

    def rule_for_hf(self, hf_name: str) -> WeightRule | None:
        """The rule that consumes the HF tensor ``hf_name`` (through its tie), or ``None``."""
        return self._by_hf.get(self.tied.get(hf_name, hf_name))

    def hf_names(self) -> list[str]:
        """Every HF name the model's rules produce, in rule order (tied aliases excluded)."""
        return [n for r in self.rules for n in r.hf_names]

    def is_ignored(self, hf_name: str) -> bool:
        """Whether ``hf_name`` matches one of ``ignored``."""
        return any(fnmatch.fnmatchcase(hf_name, p) for p in self.ignored)

    def to_hf(self, named_full: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every ``(engine_name, full tensor)`` of ``named_full``, rule by rule
        (lazy: one engine parameter at a time). ``InvalidInput`` for an engine name without a rule."""
        for engine_name, full in named_full:
            rule = self.rule(engine_name)
            out = rule.to_hf(full)
            for hf in rule.hf_names:
                yield hf, out[hf]

    @classmethod
    def resolve(
        cls,
        params: Iterable[tuple[str, Sequence[int]]],
        patterns: Sequence[RulePattern],
        *,
        tied: Mapping[str, str] | None = None,
        ignored: Sequence[str] = (),
    ) -> WeightMap:
        """The map of a concrete model from its ``(engine_name, full shape)`` list: each name takes the
        first pattern that full-matches it (``skip`` patterns give no rule). ``ConfigError`` naming the
        parameter when no pattern matches, or when a built rule names another engine parameter."""
        compiled = [(re.compile(p.pattern), p) for p in patterns]
        rules: list[WeightRule] = []
        for name, shape in params:
            for regex, pat in compiled:
                match = regex.fullmatch(name)
                if match is None:
                    continue
                if pat.build is not None:
                    rule = pat.build(match, tuple(int(s) for s in shape))
                    if rule.engine_name != name:
                        raise ConfigError(
                            f"RulePattern {pat.pattern!r} built a rule for {rule.engine_name!r} from {name!r}"
                        )
                    if rule.engine_shape is None:
                        rule = _with_shape(rule, tuple(int(s) for s in shape))
                    rules.append(rule)
                break
            else:
                raise ConfigError(
                    f"WeightMap: engine parameter {name!r} matches no rule pattern "
                    f"({[p.pattern for p in patterns]}); add a rule for it"
                )
        return cls(tuple(rules), dict(tied or {}), tuple(ignored))


def _with_shape(rule: WeightRule, shape: tuple[int, ...]) -> WeightRule:
    from dataclasses import replace

    return replace(rule, engine_shape=shape)
