"""The flex kernel as the fsdp2 engine drives it: many packed layouts, gradients, each call inside a
``torch.compiler.disable`` region under non-reentrant ``torch.utils.checkpoint`` (the engine's eager
recomputation path), then backward. Shared by ``test_flex_attention_cuda.py`` and runnable as a script
on the GPU host to compare compile settings of the process-wide flex function::

    PYTHONPATH=src:. python3 -m tests.gpu._flex_layouts [--engine-scope] [--raw [--dynamic none|true]
        [--fullgraph]] [--plain]

``--engine-scope`` runs the calls under the settings the fsdp2 engine's compiled layers are called
with (dynamo's ``suppress_errors`` on, ``assume_static_by_default`` off, ``activation_memory_budget``
0.85); ``--raw`` replaces the library's flex function by a plain ``torch.compile(flex_attention)``
(with the ``--dynamic`` / ``--fullgraph`` given).

It prints one line: layouts run, graphs compiled, the first error (if any).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from underlay import registry


def random_layouts(n: int, seed: int = 0, max_len: int = 3000) -> list[tuple[int, ...]]:
    """``n`` distinct packed layouts of 1-6 sequences of 1..``max_len`` tokens."""
    rng = random.Random(seed)
    seen: list[tuple[int, ...]] = []
    while len(seen) < n:
        lens = tuple(rng.randint(1, max_len) for _ in range(rng.randint(1, 6)))
        if lens not in seen:
            seen.append(lens)
    return seen


def _call(
    flex: Any, cu: torch.Tensor, max_len: int, window: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    out: torch.Tensor = flex.varlen(q, k, v, cu, cu, max_len, max_len, window=window, softcap=50.0)
    return out


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _checkpointed(body: Any, *xs: torch.Tensor) -> torch.Tensor:
    return checkpoint(body, *xs, use_reentrant=False)  # type: ignore[no-any-return]


def run_layouts(
    layouts: list[tuple[int, ...]],
    *,
    checkpointed: bool = True,
    engine_scope: bool = True,
    heads: tuple[int, int] = (8, 4),
    dim: int = 128,
) -> dict[str, Any]:
    """Forward + backward of the flex kernel (softcap 50, alternating window 4095 / none, GQA) over
    ``layouts`` in bf16 on cuda, under the fsdp2 engine's compile settings when ``engine_scope``.
    Returns ``{"ran": layouts done, "graphs": dynamo graphs compiled
    meanwhile, "error": first exception as text or None}``."""
    from torch._dynamo.utils import counters

    flex = registry.get_attention("flex")
    before = counters["stats"]["unique_graphs"]
    with contextlib.ExitStack() as stack:
        if engine_scope:
            import torch._dynamo.config as dynamo_config
            import torch._functorch.config as functorch_config

            # (a layer compiled with dynamic=True keeps assume_static_by_default=False for its call)
            stack.enter_context(dynamo_config.patch(suppress_errors=True, assume_static_by_default=False))
            stack.enter_context(functorch_config.patch(activation_memory_budget=0.85))
        ran, error = _loop(flex, layouts, checkpointed, heads, dim)
    torch.cuda.synchronize()
    return {"ran": ran, "graphs": counters["stats"]["unique_graphs"] - before, "error": error}


def _loop(
    flex: Any, layouts: list[tuple[int, ...]], checkpointed: bool, heads: tuple[int, int], dim: int
) -> tuple[int, str | None]:
    device = torch.device("cuda")
    ran, error = 0, None
    for i, lens in enumerate(layouts):
        total = sum(lens)
        gen = torch.Generator().manual_seed(i)
        q, k, v = (
            torch.randn(total, h, dim, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
            for h in (heads[0], heads[1], heads[1])
        )
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        window = (4095, 0) if i % 2 else None

        body = functools.partial(_call, flex, cu, max(lens), window)

        try:
            out = _checkpointed(body, q, k, v) if checkpointed else body(q, k, v)
            out.float().square().mean().backward()
        except Exception as exc:  # reported, not raised: the caller compares settings
            error = f"layout {i} {lens}: {type(exc).__name__}: {str(exc)[:1500]}"
            break
        ran += 1
    return ran, error


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dynamic", choices=("none", "true", "false"), default=None)
    ap.add_argument("--fullgraph", action="store_true")
    ap.add_argument("--plain", action="store_true", help="no checkpoint")
    ap.add_argument("--engine-scope", action="store_true")
    ap.add_argument("--raw", action="store_true")
    ap.add_argument("--layouts", type=int, default=12)
    args = ap.parse_args()
    if args.raw:
        from torch.nn.attention.flex_attention import flex_attention

        from underlay.ops import flex as flex_ops

        dynamic = {"none": None, "true": True, "false": False}[args.dynamic or "none"]
        flex_ops._FLEX["compiled"] = torch.compile(flex_attention, dynamic=dynamic, fullgraph=args.fullgraph)
    res = run_layouts(
        random_layouts(args.layouts), checkpointed=not args.plain, engine_scope=args.engine_scope
    )
    print(f"flex_layouts {vars(args)}: {res}")


if __name__ == "__main__":
    main()
