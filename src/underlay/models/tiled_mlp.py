"""TiledMLP: a position-wise module computed in token tiles, recomputed tile by tile in backward.

A transformer MLP on ``N`` tokens keeps ``[N, ffn]`` activations (gate, up, their product) for the
backward pass; at long sequence lengths that is the largest activation of the layer. :class:`TiledMLP`
runs the module on ``tiles`` slices of the tokens under ``no_grad`` in forward (only the input and the
output are kept) and, in backward, recomputes one tile at a time and back-propagates it, so at most one
tile's intermediates exist at once. Gradients are exact (up to floating-point summation order of the
parameter gradients, which are accumulated in fp32 for half-precision parameters).

The wrapped module must be position-wise (each token's output depends only on that token), as the MLP
and the MoE block of every supported architecture are, and must be deterministic (no dropout in
training).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from underlay.interfaces import ConfigError, InvalidInput

__all__ = ["TiledMLP", "apply_tiled_mlp", "check_tileable", "tiled_forward"]


_TUPLE_RETURNS: dict[type[nn.Module], bool] = {}


def _tuple_return(cls: type[nn.Module]) -> bool:
    """Whether ``cls.forward`` has a ``return a, b`` statement (e.g. gpt-oss's MoE block returns the
    hidden states and the router scores), which a tile-and-concatenate wrapper cannot reproduce. Read
    from the source once per class; a class without readable source counts as single-output."""
    found = _TUPLE_RETURNS.get(cls)
    if found is None:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
        except (OSError, TypeError, SyntaxError):
            tree = None
        found = tree is not None and any(
            isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) for node in ast.walk(tree)
        )
        _TUPLE_RETURNS[cls] = found
    return found


def _mlp_modules(model: nn.Module) -> list[nn.Module]:
    return [
        module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "mlp" and any(True for _ in module.parameters())
    ]


def check_tileable(model: nn.Module) -> None:
    """Raise ``ConfigError`` when a decoder ``mlp`` module of ``model`` cannot be tiled: its forward
    returns a tuple (gpt-oss's MoE block returns router scores next to the hidden states)."""
    for module in _mlp_modules(model):
        if _tuple_return(type(module)):
            raise ConfigError(
                f"tiled_mlp_tiles: {type(module).__name__}.forward returns a tuple, and TiledMLP tiles "
                "modules that return one tensor; pass tiled_mlp_tiles=None for this model"
            )


def _call_tile(fn: Callable[[torch.Tensor], torch.Tensor], part: torch.Tensor, ndim: int) -> torch.Tensor:
    """``fn`` on a ``[n, H]`` tile, shown to it with the input's rank (``[1, ..., 1, n, H]``) because
    modules such as MoE blocks unpack ``batch, seq, hidden``; returns ``[n, H_out]``."""
    shaped = part.reshape(*([1] * (ndim - 2)), *part.shape) if ndim > 2 else part
    out = fn(shaped)
    return out.reshape(part.shape[0], out.shape[-1])


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[[torch.Tensor], torch.Tensor],
        tiles: int,
        x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.fn, ctx.tiles, ctx.params = fn, tiles, params
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            outs = [_call_tile(fn, part, x.dim()) for part in flat.tensor_split(tiles, dim=0)]
        out = torch.cat(outs, dim=0)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        params: Sequence[torch.Tensor] = ctx.params
        needs = [p.requires_grad for p in params]
        wanted = [p for p, n in zip(params, needs) if n]
        flat = x.reshape(-1, x.shape[-1]).detach()
        g_flat = grad_out.reshape(-1, grad_out.shape[-1])
        acc: list[torch.Tensor | None] = [None] * len(wanted)
        gx_parts: list[torch.Tensor] = []
        bounds = torch.arange(flat.shape[0]).tensor_split(ctx.tiles)
        for idx in bounds:
            if idx.numel() == 0:
                continue
            lo, hi = int(idx[0]), int(idx[-1]) + 1
            part = flat[lo:hi].requires_grad_(ctx.needs_input_grad[2])
            with torch.enable_grad():
                y = _call_tile(ctx.fn, part, x.dim())
            inputs = ([part] if part.requires_grad else []) + wanted
            grads = torch.autograd.grad(y, inputs, g_flat[lo:hi], allow_unused=True) if inputs else ()
            if part.requires_grad:
                gx_parts.append(grads[0])
                grads = grads[1:]
            for i, g in enumerate(grads):
                if g is None:
                    continue
                g32 = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
                prev = acc[i]
                acc[i] = g32 if prev is None else prev + g32
        gx = torch.cat(gx_parts).reshape(x.shape) if gx_parts else None
        it = iter(acc)
        param_grads: list[torch.Tensor | None] = []
        for p, n in zip(params, needs):
            total = next(it) if n else None
            param_grads.append(None if total is None else total.to(p.dtype))
        return (None, None, gx, *param_grads)


def tiled_forward(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tiles: int,
    params: Sequence[torch.Tensor],
) -> torch.Tensor:
    """``fn(x)`` computed over ``tiles`` slices of the flattened tokens of ``x [..., H]`` with
    recomputation in backward. ``params`` are the tensors ``fn`` reads whose gradients are wanted
    (the module's parameters). Returns ``[..., H_out]``; gradients flow to ``x`` and ``params``.
    Raises ``InvalidInput`` for ``tiles < 1`` or a 0-d input."""
    if not isinstance(tiles, int) or tiles < 1:
        raise InvalidInput(f"tiled_forward: tiles={tiles!r} must be an int >= 1")
    if x.dim() < 1:
        raise InvalidInput("tiled_forward: x must have a feature dimension")
    n_tokens = x.numel() // max(int(x.shape[-1]), 1)
    grad_wanted = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
    if tiles == 1 or n_tokens < 2 or not grad_wanted:
        return fn(x)
    out: torch.Tensor = _TiledFunction.apply(  # type: ignore[no-untyped-call]
        fn, min(tiles, n_tokens), x, *params
    )
    return out


class TiledMLP:
    """Replacement ``forward`` for a position-wise module that runs it in ``tiles`` token tiles.

    ``TiledMLP(mlp, tiles)(x)`` equals ``mlp(x)`` for ``x [..., hidden]`` in value and gradients
    (inputs and the module's parameters) while keeping only one tile's intermediates alive in backward.
    :func:`apply_tiled_mlp` installs it as ``mlp.forward`` so that the module tree and parameter names
    (HF checkpoint keys) stay unchanged. Without autograd (``no_grad`` / inference) it is a plain call.
    """

    def __init__(self, module: nn.Module, tiles: int) -> None:
        if not isinstance(tiles, int) or tiles < 1:
            raise ConfigError(f"TiledMLP: tiles={tiles!r} must be an int >= 1")
        self.module = module
        self.tiles = tiles

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = type(self.module).forward(self.module, x)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The module's output on ``x``, computed in tiles (see the class docstring)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        return tiled_forward(self._plain, x, self.tiles, params)

    def __repr__(self) -> str:
        return f"TiledMLP({type(self.module).__name__}, tiles={self.tiles})"


def apply_tiled_mlp(model: nn.Module, tiles: int | None) -> int:
    """Install (``tiles >= 1``) or remove (``None``) :class:`TiledMLP` on the ``mlp`` module of every
    decoder layer of ``model`` (in place, idempotent). Returns the number of modules changed.
    Raises ``ConfigError`` for an invalid ``tiles`` or an MLP :func:`check_tileable` refuses (before
    anything changes)."""
    if tiles is not None and (not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1):
        raise ConfigError(f"tiled_mlp_tiles={tiles!r}: must be an int >= 1 or None")
    if tiles is not None:
        check_tileable(model)
    count = 0
    for module in _mlp_modules(model):
        current = module.__dict__.get("forward")
        if tiles is None:
            if isinstance(current, TiledMLP):
                del module.__dict__["forward"]
                count += 1
            continue
        if isinstance(current, TiledMLP):
            current.tiles = tiles
        else:
            module.forward = TiledMLP(module, tiles)
        count += 1
    return count
