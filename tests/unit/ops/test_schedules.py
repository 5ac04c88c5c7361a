"""LR schedule factories: values at chosen steps and argument errors."""

from __future__ import annotations

import math

import pytest
import torch

from underlay.interfaces import ConfigError, OptimConfig
from underlay.ops import build_lr_scheduler, constant_with_warmup, cosine_with_warmup, warmup_stable_decay

LR = 0.2


def _lrs(make: object, steps: int) -> list[float]:
    param = torch.nn.Parameter(torch.randn(2))
    opt = torch.optim.SGD([param], lr=LR)
    sched = make(opt)  # type: ignore[operator]
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_constant_with_warmup() -> None:
    lrs = _lrs(lambda o: constant_with_warmup(o, 4), 7)
    assert lrs == pytest.approx([LR * f for f in (0.25, 0.5, 0.75, 1, 1, 1, 1)])
    assert _lrs(lambda o: constant_with_warmup(o, 0), 3) == pytest.approx([LR] * 3)


def test_cosine_with_warmup() -> None:
    lrs = _lrs(lambda o: cosine_with_warmup(o, 2, 10, min_lr_ratio=0.1), 13)
    assert lrs[:2] == pytest.approx([LR * 0.5, LR])
    for t in range(2, 13):
        progress = min((t - 2) / 8, 1.0)
        assert lrs[t] == pytest.approx(LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))))
    assert lrs[10] == pytest.approx(LR * 0.1) and lrs[12] == pytest.approx(LR * 0.1)


def test_warmup_stable_decay() -> None:
    lrs = _lrs(lambda o: warmup_stable_decay(o, 2, 10, decay_ratio=0.4, min_lr_ratio=0.2), 12)
    # decay over the last 4 steps (6..10) linearly from 1 to 0.2
    expect = [0.5, 1, 1, 1, 1, 1, 1, 0.8, 0.6, 0.4, 0.2, 0.2]
    assert lrs == pytest.approx([LR * f for f in expect])


@pytest.mark.parametrize(
    "make",
    [
        lambda o: constant_with_warmup(o, -1),
        lambda o: cosine_with_warmup(o, 0, 10, min_lr_ratio=1.5),
        lambda o: cosine_with_warmup(o, 11, 10),
        lambda o: cosine_with_warmup(o, 0, 0),
        lambda o: warmup_stable_decay(o, 0, 10, decay_ratio=-0.1),
        lambda o: warmup_stable_decay(o, 8, 10, decay_ratio=0.5),
    ],
)
def test_bad_arguments_raise(make: object) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(1))], lr=LR)
    with pytest.raises(ConfigError):
        make(opt)  # type: ignore[operator]


def test_build_from_optim_config() -> None:
    cfg = OptimConfig(lr=LR, schedule="cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    assert _lrs(lambda o: build_lr_scheduler(o, cfg), 4) == _lrs(
        lambda o: cosine_with_warmup(o, 2, 10, 0.1), 4
    )
    wsd = OptimConfig(lr=LR, schedule="wsd", warmup_steps=1, total_steps=10, decay_ratio=0.2)
    assert _lrs(lambda o: build_lr_scheduler(o, wsd), 11)[-1] == pytest.approx(0.0)
    const = OptimConfig(lr=LR, warmup_steps=3)
    assert _lrs(lambda o: build_lr_scheduler(o, const), 4) == pytest.approx([LR / 3, 2 * LR / 3, LR, LR])
