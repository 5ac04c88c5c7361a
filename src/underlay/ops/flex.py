"""``torch.nn.attention.flex_attention`` helpers shared by the kernels that use it (the ``flex``
attention backend and the shared-prompt attention of :mod:`underlay.ops.prompt_sharing`).

:func:`flex_attention_fn` returns the function to call on a device: the one process-wide
``torch.compile(flex_attention)`` off the cpu (the documented way to get the fused Triton kernel; eager
flex materialises the ``[S_q, S_k]`` scores), plain ``flex_attention`` on the cpu (forward only:
torch has no cpu backward for it). :func:`softcap_score_mod` is the Gemma-2 style score modification,
one function object per cap so a compiled flex does not recompile for a new closure.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import lru_cache
from typing import Any, cast

import torch

__all__ = ["flex_attention_fn", "softcap_score_mod"]

_FLEX: dict[str, Callable[..., Any]] = {}
"""``"compiled"`` -> ``torch.compile(flex_attention)``, built on first use (a compiled function)."""


def _eager_flex(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Uncompiled ``flex_attention`` without its "called without torch.compile" warning (on the cpu
    the unfused path is the only one, and the caller chose it)."""
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile.*")
        return cast(torch.Tensor, flex_attention(*args, **kwargs))


def flex_attention_fn(device_type: str) -> Callable[..., torch.Tensor]:
    """The ``flex_attention`` callable for tensors on ``device_type``: compiled once per process for an
    accelerator, eager for ``"cpu"``. Same signature as ``torch.nn.attention.flex_attention``.

    The compiled function is called under dynamo's default shape settings (static first, automatic
    dynamic after), ``suppress_errors`` off and the partitioner's ``activation_memory_budget`` at 1.0,
    whatever the caller's: ``torch.compile(dynamic=True)`` keeps ``assume_static_by_default=False`` for
    the whole call of the compiled function, eager regions inside included, so a flex call under a
    layer compiled that way (the fsdp2 engine's, under full recompute) was compiled all-dynamic, which
    torch's flex cannot do; it then ran flex's eager path while dynamo was active, which fails with an
    ``AssertionError`` about FakeTensors in flex's autograd. A compile error must surface as itself, and
    flex's graph is not the caller's to partition. Raises whatever ``torch.compile`` raises on a case
    flex cannot compile."""
    if device_type == "cpu":
        return _eager_flex
    found = _FLEX.get("compiled")
    if found is None:
        from torch.nn.attention.flex_attention import flex_attention

        # automatic dynamic shapes: the first packed length compiles a static graph, the next one a
        # graph symbolic in the length, which serves every later length
        found = _FLEX.setdefault("compiled", _isolated(torch.compile(flex_attention)))
    return cast(Callable[..., torch.Tensor], found)


def _isolated(compiled: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """``compiled`` called under flex's own compile settings (see :func:`flex_attention_fn`)."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        with (
            dynamo_config.patch(
                suppress_errors=False, assume_static_by_default=True, automatic_dynamic_shapes=True
            ),
            functorch_config.patch(activation_memory_budget=1.0),
        ):
            return cast(torch.Tensor, compiled(*args, **kwargs))

    return call


@lru_cache(maxsize=64)
def softcap_score_mod(cap: float) -> Callable[..., torch.Tensor]:
    """``score -> cap * tanh(score / cap)`` as a flex ``score_mod`` (applied after the scale, as in
    Gemma 2 and in ``eager_attention``). The same object for the same ``cap``."""

    def score_mod(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return score_mod
