"""Vocab-parallel fused log-prob kernel against the unsharded kernel (issue 8), under torchrun.

Every rank holds a contiguous vocabulary shard of the head weight and calls the registry's
``LogprobKernel`` (``triton`` on cuda) with ``vocab_group``; the same kernel without sharding on the
full weight is the reference, and a float64 torch computation is the ground truth. Compared: log-probs,
entropy, the hidden gradient (all-reduced by the kernel) and this rank's weight-gradient rows, for a
loss with random per-token weights. bf16 inputs, fp32 math.

    torchrun --nproc_per_node 2 benchmarks/gpu/multigpu/vocab_parallel_logprob.py

Prints one line per quantity; writes ``$OUT/vocab_parallel_logprob_w<world>.json`` (rank 0); exit 1
when a sharded result differs from the unsharded one by more than 1e-3 (log-probs/entropy, absolute)
or 2e-2 (gradients, relative to their max).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def run(
    kernel: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, g: Any, group: Any
) -> Any:
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    out = kernel(h, w, labels, with_entropy=True, vocab_group=group)
    (out.log_probs * g[0] + out.entropy * g[1]).sum().backward()
    return out.log_probs.detach(), out.entropy.detach(), h.grad, w.grad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    from underlay.parallel.distributed import init_distributed
    from underlay.registry import get_device, get_logprob_kernel

    dev = get_device(args.device)
    env = init_distributed(dev)
    rank, world = env.rank, env.world_size
    if args.vocab % world:
        raise SystemExit(f"--vocab {args.vocab} must be divisible by the world size {world}")
    device = dev.torch_device() if dev.is_accelerator else torch.device("cpu")
    dtype = torch.bfloat16 if dev.is_accelerator else torch.float32
    gen = torch.Generator().manual_seed(0)  # identical inputs on every rank
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=gen)).to(device, dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    labels[::17] = -100
    labels = labels.to(device)
    g = (
        torch.randn(args.tokens, generator=gen).to(device),
        torch.randn(args.tokens, generator=gen).to(device),
    )
    kernel = get_logprob_kernel()
    vl = args.vocab // world
    rows = slice(rank * vl, (rank + 1) * vl)
    lp_s, ent_s, gh_s, gw_s = run(kernel, hidden, weight[rows], labels, g, dist.group.WORLD)
    lp_f, ent_f, gh_f, gw_f = run(kernel, hidden, weight, labels, g, None)
    with torch.no_grad():
        logits = hidden.double() @ weight.double().T
        lsm = logits.log_softmax(-1)
        keep = labels >= 0
        lp_64 = lsm.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1) * keep
        ent_64 = -(lsm.exp() * lsm).sum(-1) * keep

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))

    res = {
        "logp_vs_unsharded": float((lp_s - lp_f).abs().max()),
        "entropy_vs_unsharded": float((ent_s - ent_f).abs().max()),
        "grad_hidden_rel": rel(gh_s, gh_f),
        "grad_weight_rel": rel(gw_s, gw_f[rows]),
        "logp_vs_fp64": float((lp_s.double() - lp_64).abs().max()),
        "entropy_vs_fp64": float((ent_s.double() - ent_64).abs().max()),
    }
    ok = (
        res["logp_vs_unsharded"] < 1e-3
        and res["entropy_vs_unsharded"] < 1e-3
        and res["grad_hidden_rel"] < 2e-2
        and res["grad_weight_rel"] < 2e-2
    )
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag)
    if rank == 0:
        for k, v in res.items():
            print(f"vocab-parallel world={world} kernel={kernel.name} {k}: {v:.3e}")
        print(f"vocab-parallel world={world}: {'PASS' if float(flag) == 0 else 'FAIL'}")
        out = Path(os.environ.get("OUT", "."))
        out.mkdir(parents=True, exist_ok=True)
        (out / f"vocab_parallel_logprob_w{world}.json").write_text(
            json.dumps(
                {"results": res, "kernel": kernel.name, "ok": float(flag) == 0, "args": vars(args)}, indent=2
            )
        )
    dist.destroy_process_group()
    return 0 if float(flag) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
