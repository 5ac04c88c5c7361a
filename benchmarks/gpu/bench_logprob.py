"""Fused linear -> log-prob + entropy, forward + backward, on one GPU.

Compares, in one run at N=32768, H=4096, V=152064 bf16 (override: ``--shape N H V``):
- ``triton``: underlay's TritonLogprobKernel in its default mode (``_logprob_triton.DEFAULT_MODE``),
  log-prob + entropy, both with upstream gradients; ``triton_fwd_only``: its forward alone;
- ``triton_no_ent``: the same kernel with ``with_entropy=False``;
- ``triton_pointer`` / ``triton_tma_store``: the default mode with ``TritonLogprobKernel(tma="off")`` (pointer
  tile loads and stores) / ``tma="store"`` (dlogits tiles stored through TMA too);
- ``triton_fused`` / ``triton_hybrid`` (whichever is not the default): logits by ``tl.dot`` inside Triton,
  or cuBLAS logits blocks with fp32 output read by the same Triton statistics / dlogits kernels;
- ``chunked_torch``: ``underlay.ops.linear_logprobs`` (log-prob + entropy);
- ``naive_torch``: matmul, float, log_softmax, gather, entropy (materialises [N, V] fp32);
- ``liger_flce``: Liger-Kernel's LigerFusedLinearCrossEntropyLoss (loss only, reduction="sum"), when
  ``liger_kernel`` is importable (carry its wheel);
and the plain bf16 matmul rate ``N x H x V``. Each method: 2 warm-up calls (the first includes Triton's
autotuning), then the median of ``--repeats`` (5) timed forward + backward calls (the harness's
synchronised wall clock); the baselines are the 4-matmul floor, chunked and naive torch and Liger; peak extra memory is
``max_memory_allocated`` during one call minus the allocation before it (inputs excluded, gradients
included).

The goal's figure (issue 35: <= 1.08x the floor in every run) is measured apart, after the table:
``--rounds`` (7) rounds, each timing the floor (4 back-to-back ``h @ W.T``) and then the default kernel
(forward + backward), the median of ``--repeats`` calls each; the summary gives the median, minimum and
maximum of the per-round ratios and whether every round meets ``--goal`` (1.08). Measured in
alternation, clock or thermal drift moves both sides of a ratio alike.

    python -m benchmarks.gpu.bench_logprob [--shape N H V] [--rounds R] [--out DIR]

Prints a table and writes ``OUT/logprob.json``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import _harness as harness
from underlay import registry
from underlay.backends.cuda import _logprob_triton as impl
from underlay.backends.cuda.logprob import TritonLogprobKernel
from underlay.ops import linear_logprobs


def timed(
    fn: Callable[[], None], clear: Callable[[], None], reps: int = 5, warm: int = 2
) -> tuple[float, float]:
    """(median ms, peak extra GiB) of ``fn``; ``clear`` drops gradients before the memory baseline."""
    for _ in range(warm):
        fn()
    clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return event_ms(fn, reps), peak


def event_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median time of ``reps`` calls of ``fn``, in ms (no warm-up: call it warm)."""
    return harness.timeit(fn, warmup=0, repeats=reps, device="cuda").median * 1e3


def interleaved_ratio(
    fn: Callable[[], Any], floor_unit: Callable[[], Any], floor_calls: int, rounds: int, reps: int
) -> dict[str, Any]:
    """``fn``'s time over its floor (``floor_calls`` calls of ``floor_unit``), measured ``rounds`` times
    in alternation (floor, then ``fn``, each the median of ``reps`` timed calls), so clock or thermal
    drift between the two cannot masquerade as kernel time. Returns every round's ratio and milliseconds,
    their median, minimum and maximum ratio. Call both warm."""

    def floor() -> None:
        for _ in range(floor_calls):
            floor_unit()

    ratios, floors, times = [], [], []
    for _ in range(rounds):
        f = event_ms(floor, reps)
        t = event_ms(fn, reps)
        floors.append(f)
        times.append(t)
        ratios.append(harness.ratio(t, f))
    return {
        "rounds": rounds,
        "reps_per_round": reps,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratios": ratios,
        "floor_ms": floors,
        "ms": times,
    }


def main() -> None:
    """Run all methods and print/write the table."""
    ap = harness.parser(__doc__)
    ap.add_argument("--shape", type=int, nargs=3, default=(32768, 4096, 152064), metavar=("N", "H", "V"))
    ap.add_argument(
        "--rounds",
        type=int,
        default=7,
        help="rounds of the interleaved floor ratio (floor, then the default kernel, --repeats calls each)",
    )
    ap.add_argument("--goal", type=float, default=1.08, help="ratio to the floor every round must meet")
    ap.set_defaults(warmup=2)
    args = ap.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        ap.error(f"--rounds {args.rounds} and --repeats {args.repeats} must be >= 1")
    n, h, v = args.shape
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    weight = (torch.randn(v, h, device=dev) * (2.5 / h**0.5)).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), device=dev)
    labels[::17] = -100
    g_lp, g_ent = torch.randn(n, device=dev), torch.randn(n, device=dev)
    hh, ww = hidden.requires_grad_(), weight.requires_grad_()
    registry.get_logprob_kernel("triton")  # the registry's choice must be available here
    kernels = {m: TritonLogprobKernel(registry.get_device(), mode=m) for m in impl.MODES}

    def clear() -> None:
        hh.grad = None
        ww.grad = None

    def ours(with_entropy: bool = True, mode: str = impl.DEFAULT_MODE) -> Callable[[], None]:
        def fn() -> None:
            clear()
            out = kernels[mode](hh, ww, labels, with_entropy=with_entropy)
            loss = (out.log_probs * g_lp).sum()
            if out.entropy is not None:
                loss = loss + (out.entropy * g_ent).sum()
            loss.backward()

        return fn

    def with_tma(setting: str) -> Callable[[], None]:
        """The default mode with ``tma=setting`` (``off``: the kernel before TMA, the same-run baseline;
        ``store``: dlogits stored through TMA too)."""
        kernel = TritonLogprobKernel(registry.get_device(), tma=setting)  # type: ignore[arg-type]

        def fn() -> None:
            clear()
            out = kernel(hh, ww, labels)
            assert out.entropy is not None
            ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()

        return fn

    def ours_fwd(mode: str) -> Callable[[], None]:
        def fn() -> None:
            with torch.no_grad():
                kernels[mode](hidden.detach(), weight.detach(), labels)

        return fn

    def chunked() -> None:
        clear()
        out = linear_logprobs(hh, ww, labels)
        assert out.entropy is not None
        ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()

    def naive() -> None:
        clear()
        logits = (hh @ ww.T).float()
        logp = torch.log_softmax(logits, dim=-1)
        valid = labels != -100
        lp = torch.where(valid, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
        ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()

    def matmul() -> None:
        with torch.no_grad():
            torch.mm(hidden.detach(), weight.detach().T)

    other = next(m for m in impl.MODES if m != impl.DEFAULT_MODE)
    methods: list[tuple[str, Callable[[], None], int]] = [
        ("matmul_bf16", matmul, 1),
        ("triton", ours(), 4),
        ("triton_fwd_only", ours_fwd(impl.DEFAULT_MODE), 1),
        ("triton_no_ent", ours(False), 4),
        ("triton_pointer", with_tma("off"), 4),
        ("triton_tma_store", with_tma("store"), 4),
        (f"triton_{other}", ours(mode=other), 4),
        (f"triton_{other}_fwd", ours_fwd(other), 1),
    ]
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger_loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger() -> None:
            clear()
            liger_loss(ww, hh, labels).backward()

        methods.append(("liger_flce", liger, 3))
    except Exception as exc:  # report, keep benchmarking the rest
        print(f"liger_kernel unavailable: {type(exc).__name__}: {exc}")
    methods += [("chunked_torch", chunked, 4), ("naive_torch", naive, 4)]

    flop = 2.0 * n * h * v
    rows: dict[str, dict[str, Any]] = {}
    for name, fn, gemms in methods:
        try:
            ms, gib = timed(fn, clear, reps=args.repeats, warm=args.warmup)
            rows[name] = {"ms": ms, "peak_extra_gib": gib, "tflops": gemms * flop / ms / 1e9, "gemms": gemms}
        except torch.OutOfMemoryError as exc:
            rows[name] = {"error": f"OOM: {str(exc)[:120]}"}
        clear()
        torch.cuda.empty_cache()
    info: dict[str, Any] = {
        "shape": [n, h, v],
        "torch": torch.__version__,
        "triton": impl.triton.__version__,
        "gpu": torch.cuda.get_device_name(),
        "fwd_best_config": str(getattr(impl._fwd_kernel, "best_config", None)),
        "bwd_best_config": str(getattr(impl._bwd_dlogits_kernel, "best_config", None)),
        "backward_plan(row_split, v_chunk) fused / hybrid": (
            impl.plan_backward(n, h, 2, "fused"),
            impl.plan_backward(n, h, 2, "hybrid"),
        ),
        "mm_path": impl.mm_path(hidden),
        "results": rows,
    }
    for ref in ("liger_flce", "chunked_torch", "naive_torch"):
        if "ms" in rows.get(ref, {}) and "ms" in rows["triton"]:
            info[f"speedup_vs_{ref}"] = harness.ratio(rows[ref]["ms"], rows["triton"]["ms"])
    if "ms" in rows.get("matmul_bf16", {}):
        # Per-token outputs get their upstream gradients only in backward, so any kernel with this contract
        # makes 4 matmuls of this size (forward logits, recomputed logits, grad_hidden, grad_weight).
        info["backward_floor_4_matmuls_ms"] = floor = 4 * rows["matmul_bf16"]["ms"]
        for name in (
            "triton",
            "triton_tma_store",
            "triton_pointer",
            f"triton_{other}",
        ):  # goal (issue 23): <= 1.10
            if "ms" in rows.get(name, {}):
                info[f"backward_ratio_to_floor_{name}"] = harness.ratio(rows[name]["ms"], floor)
    # the goal's figure: the default kernel against its floor, measured in alternation (the floor moves
    # 229-241 ms between runs, and a single sequential pair read 1.083 and 1.105 on the same code)
    inter: dict[str, Any] | None = None
    if "ms" in rows.get("triton", {}) and "ms" in rows.get("matmul_bf16", {}):
        inter = interleaved_ratio(ours(), matmul, 4, args.rounds, args.repeats)
        clear()
        inter["goal"] = args.goal
        inter["every_round_meets_goal"] = inter["ratio_max"] <= args.goal
        info["floor_ratio_interleaved"] = inter
    print(f"shape N={n} H={h} V={v} bf16 | torch {torch.__version__} triton {impl.triton.__version__} | "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print(f"{'method':>16} {'ms':>9} {'peak GiB':>9} {'TFLOP/s':>8} (gemms counted)")
    for name, r in rows.items():
        if "ms" in r:
            print(f"{name:>16} {r['ms']:9.1f} {r['peak_extra_gib']:9.2f} {r['tflops']:8.0f} ({r['gemms']})")
        else:
            print(f"{name:>16} {r['error']}")
    for key, val in info.items():
        if key.startswith(("speedup", "backward", "mm_path")) or key.endswith(("config", "_ms")):
            print(f"{key}: {val}")
    tri = rows.get("triton", {})
    if inter is not None:
        each = ", ".join(f"{r:.3f}" for r in inter["ratios"])
        print(
            f"floor ratio, {inter['rounds']} interleaved rounds (median of {inter['reps_per_round']} calls each): "
            f"median {inter['ratio_median']:.3f}, min {inter['ratio_min']:.3f}, max {inter['ratio_max']:.3f} "
            f"[{each}]; every round <= {args.goal}: {inter['every_round_meets_goal']}"
        )
        ratio_text = (
            f"{inter['ratio_median']:.3f}x the 4-matmul floor (median of {inter['rounds']} interleaved rounds, "
            f"max {inter['ratio_max']:.3f}; goal <= {args.goal} every round: {inter['every_round_meets_goal']})"
        )
    else:
        ratio_text = f"{info.get('backward_ratio_to_floor_triton', float('nan')):.3f}x the 4-matmul floor"
    summary = (
        f"N={n} H={h} V={v}: triton {tri.get('ms', float('nan')):.1f} ms, {ratio_text}, "
        f"peak {tri.get('peak_extra_gib', float('nan')):.2f} GiB"
    )
    harness.report("logprob", info, summary, harness.out_dir(args))


if __name__ == "__main__":
    main()
