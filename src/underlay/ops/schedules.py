"""Learning-rate schedules as ``torch.optim.lr_scheduler.LambdaLR`` factories.

Step ``t`` is the number of ``scheduler.step()`` calls so far (0 before the first). Linear warmup
gives factor ``(t + 1) / warmup_steps`` for ``t < warmup_steps`` (the first update already uses a
non-zero learning rate; full rate at ``t = warmup_steps - 1``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from underlay.interfaces import ConfigError, OptimConfig
from underlay.ops._checks import checked

__all__ = [
    "build_lr_scheduler",
    "constant_with_warmup",
    "cosine_with_warmup",
    "warmup_stable_decay",
]


def _check(warmup_steps: int, total_steps: int | None, **ratios: float) -> None:
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ConfigError(f"warmup_steps={warmup_steps!r} must be an int >= 0")
    if total_steps is not None:
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ConfigError(f"total_steps={total_steps!r} must be an int >= 1")
        if warmup_steps > total_steps:
            raise ConfigError(
                f"warmup_steps={warmup_steps} exceeds total_steps={total_steps}; lower the warmup"
            )
    for name, value in ratios.items():
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name}={value} must be in [0, 1]")


def _warmup(step: int, warmup_steps: int) -> float | None:
    return (step + 1) / warmup_steps if step < warmup_steps else None


@checked
def constant_with_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int) -> LambdaLR:
    """Linear warmup over ``warmup_steps`` then the base learning rate. ``ConfigError`` if negative."""
    _check(warmup_steps, None)

    def factor(step: int) -> float:
        w = _warmup(step, warmup_steps)
        return 1.0 if w is None else w

    return LambdaLR(optimizer, factor)


@checked
def cosine_with_warmup(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup, then half a cosine from 1 to ``min_lr_ratio`` at ``total_steps`` (held after).

    ``ConfigError`` for negative warmup, ``total_steps < 1``, warmup beyond total or a ratio outside
    [0, 1].
    """
    _check(warmup_steps, total_steps, min_lr_ratio=min_lr_ratio)
    span = max(total_steps - warmup_steps, 1)

    def factor(step: int) -> float:
        w = _warmup(step, warmup_steps)
        if w is not None:
            return w
        progress = min(max((step - warmup_steps) / span, 0.0), 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


@checked
def warmup_stable_decay(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    decay_ratio: float = 0.1,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Warmup, a constant phase, then the last ``round(decay_ratio * total_steps)`` steps decay
    linearly to ``min_lr_ratio`` (reached at ``total_steps`` and held after).

    ``ConfigError`` for bad values, or when warmup and decay together exceed ``total_steps``.
    """
    _check(warmup_steps, total_steps, decay_ratio=decay_ratio, min_lr_ratio=min_lr_ratio)
    decay_steps = round(decay_ratio * total_steps)
    if warmup_steps + decay_steps > total_steps:
        raise ConfigError(
            f"warmup_steps={warmup_steps} + decay steps {decay_steps} (decay_ratio={decay_ratio}) exceed "
            f"total_steps={total_steps}; shorten warmup or decay"
        )
    decay_start = total_steps - decay_steps

    def factor(step: int) -> float:
        w = _warmup(step, warmup_steps)
        if w is not None:
            return w
        if decay_steps == 0 or step < decay_start:
            return 1.0
        progress = min((step - decay_start) / decay_steps, 1.0)
        return 1.0 - (1.0 - min_lr_ratio) * progress

    return LambdaLR(optimizer, factor)


@checked
def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim_config: OptimConfig) -> LambdaLR:
    """The scheduler ``optim_config.schedule`` names (``constant``, ``cosine``, ``wsd``) with its
    warmup, total steps and ratios. ``ConfigError`` for an unknown schedule or missing total steps."""
    builders: dict[str, Callable[[], LambdaLR]] = {
        "constant": lambda: constant_with_warmup(optimizer, optim_config.warmup_steps),
        "cosine": lambda: cosine_with_warmup(
            optimizer, optim_config.warmup_steps, _total(optim_config), optim_config.min_lr_ratio
        ),
        "wsd": lambda: warmup_stable_decay(
            optimizer,
            optim_config.warmup_steps,
            _total(optim_config),
            optim_config.decay_ratio,
            optim_config.min_lr_ratio,
        ),
    }
    if optim_config.schedule not in builders:
        raise ConfigError(f"OptimConfig.schedule={optim_config.schedule!r}: use one of {sorted(builders)}")
    return builders[optim_config.schedule]()


def _total(cfg: OptimConfig) -> int:
    if not cfg.total_steps:
        raise ConfigError(f"OptimConfig.schedule={cfg.schedule!r} needs total_steps > 0")
    return int(cfg.total_steps)
