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

    The compiled function is called with its own dynamo settings, whatever the caller's:

    - default shape handling (static first, automatic dynamic after), with the head count and head dim
      of ``q``/``k``/``v`` (dims 1 and 3) marked static: the batch and sequence lengths of a packed
      stream change every micro-batch and compile once more, symbolically, while flex's kernels cannot
      take a symbolic head dim. ``torch.compile(dynamic=True)`` keeps ``assume_static_by_default=False``
      for the whole call of its compiled function, eager regions included, so without this a flex call
      under a layer compiled that way (the fsdp2 engine's, under full recompute) compiled all-dynamic;
    - floats specialised (``specialize_float``): the scale and the softcap (a float in the score
      function's closure) are constants of the graph, one graph per value. Under dynamo's default a
      float that changed between calls (a second model, another cap) became a tensor input, flex's
      score function needed its ``.item()``, and the flex call broke out of the graph into flex's eager
      path (the ``AssertionError`` below on torch 2.11);
    - ``suppress_errors`` off and ``fail_on_recompile_limit_hit`` on, with a recompile limit of 64 (one
      graph per head shape, dtype, scale, softcap and mask function a process uses): flex has no
      working eager fallback while dynamo is active (it fails with an ``AssertionError`` about
      FakeTensors in flex's autograd), so a compile error or an exhausted limit must surface as itself;
    - the partitioner's ``activation_memory_budget`` at 1.0 (flex's graph is not the caller's to
      partition);
    - flex's main Triton kernel for every query length (``kernel_options`` ``BACKEND="TRITON"``, merged
      under the caller's own): below 128 queries inductor otherwise lowers to its decoding kernel, an
      inference kernel that found no valid configuration for a short packed stream (92 tokens, GQA,
      head dim 128) once the length was symbolic (``NoValidChoicesError``).

    Raises whatever ``torch.compile`` raises on a case flex cannot compile."""
    if device_type == "cpu":
        return _eager_flex
    found = _FLEX.get("compiled")
    if found is None:
        from torch.nn.attention.flex_attention import flex_attention

        # automatic dynamic shapes: the first packed length compiles a static graph, the next one a
        # graph symbolic in the length, which serves every later length
        found = _FLEX.setdefault("compiled", _isolated(torch.compile(flex_attention)))
    return cast(Callable[..., torch.Tensor], found)


_RECOMPILE_LIMIT = 64
"""Graphs of the compiled flex function per process: one per head shape, dtype, scale, softcap, mask
function and grad mode in use (a training process uses a handful)."""


def _own_settings() -> tuple[dict[str, Any], dict[str, Any]]:
    """The dynamo and functorch settings flex compiles under, by the names this torch has (the recompile
    limit was ``cache_size_limit`` / ``fail_on_cache_limit_hit`` in older releases)."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    dynamo: dict[str, Any] = {
        "suppress_errors": False,
        "assume_static_by_default": True,
        "automatic_dynamic_shapes": True,
        "specialize_float": True,
    }
    for limit, fail in (
        ("recompile_limit", "fail_on_recompile_limit_hit"),
        ("cache_size_limit", "fail_on_cache_limit_hit"),
    ):
        if hasattr(dynamo_config, limit) and hasattr(dynamo_config, fail):
            dynamo.update({limit: _RECOMPILE_LIMIT, fail: True})
            break
    functorch = (
        {"activation_memory_budget": 1.0} if hasattr(functorch_config, "activation_memory_budget") else {}
    )
    return dynamo, functorch


def _main_kernel() -> dict[str, Any]:
    """The kernel option that keeps flex on its main (training) Triton kernel at every query length:
    ``BACKEND="TRITON"``, or the older ``FORCE_USE_FLEX_ATTENTION`` where this torch has no ``BACKEND``
    (its ``FlexKernelOptions`` lacks the key, or, before torch 2.8, the type itself)."""
    from torch.nn.attention import flex_attention

    options = getattr(flex_attention, "FlexKernelOptions", None)
    if "BACKEND" in getattr(options, "__annotations__", {}):
        return {"BACKEND": "TRITON"}
    return {"FORCE_USE_FLEX_ATTENTION": True}


def _isolated(compiled: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """``compiled`` called under flex's own compile settings (see :func:`flex_attention_fn`)."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    dynamo, functorch = _own_settings()
    main_kernel = _main_kernel()

    # never traced: from a compiled caller's graph (the padded route inside a compiled layer) this is a
    # graph break, so the settings below hold while the flex function compiles
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        for t in (q, k, v):  # [B, H, S, D]: heads and head dim stay static
            torch._dynamo.mark_static(t, 1)
            torch._dynamo.mark_static(t, 3)
        kwargs["kernel_options"] = {**main_kernel, **(kwargs.get("kernel_options") or {})}
        with dynamo_config.patch(**dynamo), functorch_config.patch(**functorch):
            return cast(torch.Tensor, compiled(q, k, v, *args, **kwargs))

    return cast(Callable[..., torch.Tensor], call)


@lru_cache(maxsize=64)
def softcap_score_mod(cap: float) -> Callable[..., torch.Tensor]:
    """``score -> cap * tanh(score / cap)`` as a flex ``score_mod`` (applied after the scale, as in
    Gemma 2 and in ``eager_attention``). The same object for the same ``cap``."""

    def score_mod(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return score_mod
