"""Attention on one GPU (H200): dispatch overhead of the underlay backends and the remove-padding gain.

1. Causal varlen forward+backward TFLOP/s through each cuda attention backend (``get_attention(name)``)
   against calling the kernel it wraps directly (torch's ``varlen_attn``; flash-attn's
   ``flash_attn_varlen_func`` when installed). Dispatch overhead = backend / direct - 1 (goal < 3%).
2. The same tokens on a long-tailed length mix: packed varlen against padded SDPA (right padding,
   ``is_causal`` flash; and SDPA with the padding mask, as a model without remove-padding runs it).

bf16, head_dim 128, 32 q heads, 8 kv heads, 64k tokens. Run from the repository root:

    python -m benchmarks.gpu.bench_attention [--out DIR]

Times are medians over ``--repeats`` (default 25) calls after ``--warmup`` (5) through the harness
(synchronised wall clock; gradients dropped before each call); the multi-second padded-mask steps: 2
after 1. Prints a table and writes ``OUT/attention.json``.
"""

from __future__ import annotations

import inspect
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import _harness as harness
from underlay import registry
from underlay.backends.portable.attention import TorchAttention
from underlay.interfaces import AttentionKernel
from underlay.ops.attention import attention_spec

HQ, HK, D = 32, 8, 128
TOTAL = 64 * 1024
MAX_LEN = 8192
DTYPE = torch.bfloat16


def long_tailed_lengths(total: int, seed: int = 0) -> list[int]:
    """Log-normal lengths (median ~600, tail to ``MAX_LEN``) summing exactly to ``total``."""
    gen = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    while sum(lens) < total:
        x = math.exp(math.log(600) + 1.1 * float(torch.randn((), generator=gen)))
        lens.append(int(min(MAX_LEN, max(16, x))))
    lens[-1] -= sum(lens) - total
    if lens[-1] < 1:
        lens.pop(-1)
        lens[-1] += total - sum(lens)
    return lens


def causal_flops(lens: list[int]) -> float:
    """Forward+backward FLOPs of causal attention (fwd 4*s*s*D*H/2 per sequence, bwd 2.5x fwd)."""
    fwd = sum(2.0 * s * s * D * HQ for s in lens)
    return 3.5 * fwd


_TIMING = {"warmup": 5, "repeats": 25}


def bench(fn: Callable[[], Any], grads: list[torch.Tensor], few: int = 0) -> float:
    """Median milliseconds of ``fn`` with the gradients of ``grads`` dropped before each call
    (``few``: that many calls after 1 warm-up, for steps that take seconds)."""

    def call() -> None:
        for g in grads:
            g.grad = None
        fn()

    warmup, repeats = (1, few) if few else (_TIMING["warmup"], _TIMING["repeats"])
    return harness.timeit(call, warmup=warmup, repeats=repeats, device="cuda").median * 1e3


def interleaved(
    a: Callable[[], Any], b: Callable[[], Any], grads: list[torch.Tensor], rounds: int = 5
) -> tuple[float, float]:
    """Median over ``rounds`` alternating measurements of ``a`` and ``b`` (cancels clock drift)."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(bench(a, grads))
        tb.append(bench(b, grads))
    return statistics.median(ta), statistics.median(tb)


def direct_varlen(name: str) -> Callable[..., torch.Tensor] | None:
    """The kernel a backend wraps, called with the same arguments the backend passes."""
    if name == "torch":
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return None
        params = inspect.signature(varlen_attn).parameters
        kw: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
            return lambda q, k, v, cu, m: varlen_attn(q, k, v, cu, cu, m, m, **kw)
        g = HQ // HK
        return lambda q, k, v, cu, m: varlen_attn(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), cu, cu, m, m, **kw
        )
    if name == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return lambda q, k, v, cu, m: flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True)
    return None


def main() -> None:
    ap = harness.parser(__doc__)
    ap.set_defaults(warmup=5, repeats=25)
    args = ap.parse_args()
    _TIMING.update(warmup=args.warmup, repeats=args.repeats)
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU")
    dev = registry.get_device("cuda").torch_device()
    torch.manual_seed(0)
    lens = long_tailed_lengths(TOTAL)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    max_len = max(lens)
    q = torch.randn(TOTAL, HQ, D, device=dev, dtype=DTYPE, requires_grad=True)
    k = torch.randn(TOTAL, HK, D, device=dev, dtype=DTYPE, requires_grad=True)
    v = torch.randn(TOTAL, HK, D, device=dev, dtype=DTYPE, requires_grad=True)
    dout = torch.randn(TOTAL, HQ, D, device=dev, dtype=DTYPE)
    flops = causal_flops(lens)
    spec = attention_spec(q, k, v, "varlen", causal=True)
    rows: list[dict[str, Any]] = []

    def fwd_bwd(f: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            f().backward(dout)

        return step

    # --- 1. dispatch overhead per cuda backend -----------------------------------------------------
    kernels: list[AttentionKernel] = []
    for bs in registry.backends("attention"):
        if (
            bs.name == "eager"
            or not bs.works_with("cuda")
            or not registry.probe("attention", bs.name).available
        ):
            continue
        kern = registry.get_attention(bs.name)
        if kern.supports(spec):
            print(f"skip {bs.name}: {kern.supports(spec)}")
            continue
        kernels.append(kern)
    packed_ms: float | None = None
    for kern in kernels:
        direct = direct_varlen(kern.name)
        path = kern.varlen_path(spec)[0] if isinstance(kern, TorchAttention) else kern.name

        def via_backend(kern: AttentionKernel = kern) -> torch.Tensor:
            return kern.varlen(q, k, v, cu, cu, max_len, max_len, causal=True)

        with torch.no_grad():
            got = via_backend()
            ref = direct(q, k, v, cu, max_len) if direct is not None else got
            same = float((got.float() - ref.float()).abs().max())
        if direct is None:
            t_b = statistics.median(bench(fwd_bwd(via_backend), [q, k, v]) for _ in range(3))
            t_d = None
        else:

            def via_direct(fd: Callable[..., torch.Tensor] = direct) -> torch.Tensor:
                return fd(q, k, v, cu, max_len)

            t_b, t_d = interleaved(fwd_bwd(via_backend), fwd_bwd(via_direct), [q, k, v])
        packed_ms = t_b if packed_ms is None else packed_ms
        rows.append(
            {
                "what": f"varlen causal fwd+bwd, backend {kern.name} ({path})",
                "ms": t_b,
                "direct_ms": t_d,
                "tflops": flops / t_b / 1e9,
                "direct_tflops": None if t_d is None else flops / t_d / 1e9,
                "overhead_pct": None if t_d is None else 100.0 * (t_b / t_d - 1.0),
                "max_abs_diff_vs_direct": same,
            }
        )

    # --- 2. remove-padding gain: same tokens, padded --------------------------------------------
    b, s = len(lens), -(-max_len // 64) * 64  # slots rounded up to a multiple of 64 for the kernels
    pq = torch.zeros(b, s, HQ, D, device=dev, dtype=DTYPE)
    pk = torch.zeros(b, s, HK, D, device=dev, dtype=DTYPE)
    pv = torch.zeros(b, s, HK, D, device=dev, dtype=DTYPE)
    mask = torch.zeros(b, s, dtype=torch.bool, device=dev)
    for i, n in enumerate(lens):  # right padding
        a = int(cu[i])
        pq[i, :n], pk[i, :n], pv[i, :n] = q.detach()[a : a + n], k.detach()[a : a + n], v.detach()[a : a + n]
        mask[i, :n] = True
    pq.requires_grad_(True), pk.requires_grad_(True), pv.requires_grad_(True)
    pdout = torch.randn(b, s, HQ, D, device=dev, dtype=DTYPE) * mask[..., None, None]

    def padded_flash() -> None:
        o = F.scaled_dot_product_attention(
            pq.transpose(1, 2), pk.transpose(1, 2), pv.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        o.transpose(1, 2).backward(pdout)

    torch_kernel = registry.get_attention("torch")

    def padded_masked() -> None:
        torch_kernel.padded(pq, pk, pv, attention_mask=mask, causal=True).backward(pdout)

    t_pf = bench(padded_flash, [pq, pk, pv], few=5)
    try:
        t_pm: float | None = bench(padded_masked, [pq, pk, pv], few=2)
    except torch.OutOfMemoryError:
        t_pm = None
        torch.cuda.empty_cache()
    for what, t in (
        ("padded SDPA is_causal (right padding, no mask), fwd+bwd", t_pf),
        ("padded SDPA + padding mask (backend torch.padded), fwd+bwd", t_pm),
    ):
        if t is None:
            print(f"{what}: out of memory")
            continue
        rows.append(
            {
                "what": what,
                "ms": t,
                "tflops_useful": flops / t / 1e9,
                "packed_speedup": (t / packed_ms) if packed_ms else None,
            }
        )

    # --- report -----------------------------------------------------------------------------------
    print(
        f"\nattention bench: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
        f"Hq={HQ} Hk={HK} D={D}, {TOTAL} tokens in {len(lens)} seqs (max {max_len}, median "
        f"{int(statistics.median(lens))}), padded to {b}x{s} = {b * s} slots"
    )
    print(f"{'case':<66} {'ms':>8} {'TFLOP/s':>8} {'direct ms':>10} {'overhead':>9} {'packed x':>9}")
    for r in rows:
        tf = r.get("tflops", r.get("tflops_useful"))
        dm = r.get("direct_ms")
        ov = r.get("overhead_pct")
        sp = r.get("packed_speedup")
        print(
            f"{r['what']:<66} {r['ms']:>8.2f} {tf:>8.1f} "
            f"{'' if dm is None else f'{dm:.2f}':>10} {'' if ov is None else f'{ov:+.2f}%':>9} "
            f"{'' if sp is None else f'{sp:.2f}x':>9}"
        )
    result = {
        "config": {"dtype": "bf16", "hq": HQ, "hk": HK, "head_dim": D, "total_tokens": TOTAL},
        "lengths": {"count": len(lens), "max": max_len, "median": statistics.median(lens), "values": lens},
        "useful_flops_fwd_bwd": flops,
        "rows": rows,
        "goal": "dispatch overhead < 3%",
    }
    overheads = ", ".join(
        f"{r['what'].split()[0]} {r['overhead_pct']:+.1f}%" for r in rows if "overhead_pct" in r
    )
    packed = [r["packed_speedup"] for r in rows if r.get("packed_speedup")]
    summary = f"dispatch overhead vs the wrapped kernel: {overheads or 'n/a'}; packed vs padded up to " + (
        f"{max(packed):.1f}x" if packed else "n/a"
    )
    harness.report("attention", result, summary, harness.out_dir(args))


if __name__ == "__main__":
    main()
