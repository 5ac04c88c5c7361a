"""Peak memory of chunked log-probs vs the naive ``log_softmax(...).gather(...)`` on CPU (bf16).

    python -m benchmarks.cpu.bench_logprob_memory [--out DIR]   # defaults N=8192, V=152064, H=32
H only sets the size of the (small) weight and the matmul cost: the memory at stake is the ``[N, V]``
logits. H is small because bf16 GEMMs on this CPU have no fast kernel (one ``[512, 152064] @ [152064,
128]`` bf16 product takes ~30 s here).
Each variant runs forward+backward in its own subprocess; the extra memory is the peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs`` once the inputs exist) minus the resident set at that
moment. Prints the table and the naive/chunked ratios (the naive variants are the baselines); writes
``OUT/logprob_memory.json``. Variants:

- ``naive_logits``: ``log_softmax(logits.float() / T).gather(labels)`` from bf16 logits ``[N, V]``.
- ``logprobs_from_logits``: the same from the same logits through ``underlay.ops`` (chunked, fp32).
- ``naive_linear``: ``hidden @ weight.T`` then the naive path (HF lm_head + log_softmax).
- ``linear_logprobs``: ``underlay.ops.linear_logprobs`` from hidden states (never holds [N, V]).

The naive variants need ~3.5 x N x V x 4 bytes; when ``MemAvailable`` is too small for that (or the
run is killed for memory) they run at a smaller N and the table says so (their memory is linear in N).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import _harness as harness

VARIANTS = ("naive_logits", "logprobs_from_logits", "naive_linear", "linear_logprobs")


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    assert match is not None, key
    return int(match.group(1)) * 1024


def _mem_available() -> int:
    match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return int(match.group(1)) * 1024 if match else 0


def child(variant: str, n: int, vocab: int, hidden_size: int, chunk: int) -> dict[str, float]:
    """Run one variant in this process; return its extra peak bytes and seconds."""
    from underlay.ops import linear_logprobs, logprobs_from_logits

    torch.manual_seed(0)
    labels = torch.randint(0, vocab, (n,))
    if variant in ("naive_logits", "logprobs_from_logits"):
        logits = torch.empty(n, vocab, dtype=torch.bfloat16)
        for start in range(0, n, 256):  # fill in slices: no fp32 temporary of the whole tensor
            logits[start : start + 256] = torch.randn(min(256, n - start), vocab) * 2
        logits.requires_grad_()
        inputs: tuple[torch.Tensor, ...] = (logits,)
    else:
        hidden = torch.randn(n, hidden_size).bfloat16().requires_grad_()
        weight = (torch.randn(vocab, hidden_size) * hidden_size**-0.5).bfloat16().requires_grad_()
        inputs = (hidden, weight)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    base = _status("VmRSS")
    start = time.perf_counter()
    if variant == "naive_logits":
        lp = torch.log_softmax(inputs[0].float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    elif variant == "logprobs_from_logits":
        lp = logprobs_from_logits(inputs[0], labels, chunk_size=chunk)
    elif variant == "naive_linear":
        logits = inputs[0] @ inputs[1].t()
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    else:
        lp = linear_logprobs(inputs[0], inputs[1], labels, with_entropy=False, chunk_size=chunk).log_probs
    lp.sum().backward()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - base
    return {"extra_peak_bytes": float(peak), "seconds": seconds, "n": float(n)}


def run_variant(variant: str, n: int, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-m", __spec__.name if __spec__ else "benchmarks.cpu.bench_logprob_memory"]
    cmd += ["--child", variant, "--n", str(n), "--vocab", str(args.vocab)]
    cmd += ["--hidden", str(args.hidden), "--chunk", str(args.chunk)]
    # make this subprocess the OOM killer's first choice, never a neighbour's process
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        preexec_fn=lambda: Path("/proc/self/oom_score_adj").write_text("1000"),
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--child", choices=VARIANTS)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=256, help="tokens per chunk of the chunked variants")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.n, args.vocab, args.hidden, args.chunk)))
        return
    gib = 2.0**30
    naive_need = 3.5 * args.n * args.vocab * 4  # fp32 copy + log_softmax + fp32 grad, with slack
    naive_n = args.n
    while naive_n > 256 and naive_need * naive_n / args.n > 0.85 * _mem_available():
        naive_n //= 2
    results = {}
    for variant in VARIANTS:
        n = naive_n if variant.startswith("naive") else args.n
        while True:
            try:
                results[variant] = run_variant(variant, n, args)
                break
            except RuntimeError as exc:  # killed for memory: halve N (memory is linear in N)
                if not variant.startswith("naive") or n <= 256 or "(-9)" not in str(exc):
                    raise
                n //= 2
        r = results[variant]
        print(
            f"{variant:22s} N={n:6d} extra peak {r['extra_peak_bytes'] / gib:8.3f} GiB  {r['seconds']:7.1f} s"
        )

    def per_full_n(variant: str) -> float:
        r = results[variant]
        return r["extra_peak_bytes"] * args.n / r["n"]

    lines = [
        f"N={args.n}, V={args.vocab}, H={args.hidden} (linear variants), bf16 inputs, chunk={args.chunk} tokens, "
        "forward+backward of sum(log_probs).",
        "",
        "| variant | N run | extra peak GiB (at N run) | extra peak GiB at N | seconds |",
        "|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        r = results[variant]
        note = "" if r["n"] == args.n else " (scaled linearly)"
        lines.append(
            f"| {variant} | {int(r['n'])} | {r['extra_peak_bytes'] / gib:.3f} | "
            f"{per_full_n(variant) / gib:.3f}{note} | {r['seconds']:.1f} |"
        )
    ratio_logits = harness.ratio(per_full_n("naive_logits"), max(per_full_n("logprobs_from_logits"), 1.0))
    ratio_linear = harness.ratio(per_full_n("naive_linear"), max(per_full_n("linear_logprobs"), 1.0))
    print("\n".join(lines))
    summary = (
        f"N={args.n} V={args.vocab}: naive_logits / logprobs_from_logits extra peak {ratio_logits:.1f}x, "
        f"naive_linear / linear_logprobs {ratio_linear:.1f}x"
    )
    harness.report(
        "logprob_memory", {"variants": results, "args": vars(args)}, summary, harness.out_dir(args)
    )


if __name__ == "__main__":
    main()
