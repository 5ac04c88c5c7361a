"""Peak memory of the fused log-prob head vs logits, and of TiledMLP vs the plain MLP.

One H200, bf16, forward + backward, in one run:

1. **Head** (Qwen2-7B-shaped: hidden 3584, vocab 152064, 16384 tokens): per-token log-prob + entropy
   of the labels from the final hidden states, gradients to hidden and the lm_head weight.
   - ``logits``: ``hidden @ W.T`` -> fp32 ``log_softmax`` -> gather, entropy (what an HF forward does);
   - ``fused (<kernel>)``: the registry's LogprobKernel (``triton`` on cuda), never building [N, V];
   - ``fused (torch)``: the portable chunked kernel.
2. **Model** (one Qwen2-7B-shaped decoder layer + embeddings + head, 8 x 2048 tokens):
   - ``hf logits``: the unpatched model (sdpa) returning logits, then log_softmax/gather/entropy;
   - ``packed_forward``: ``prepare_model`` + ``packed_forward`` (packed THD, fused head).
3. **MLP** (hidden 3584, ffn 18944, 16384 tokens, Qwen2MLP): plain vs ``TiledMLP`` with 2/4/8/16 tiles.

Each row: peak extra memory (``max_memory_allocated`` during one call minus the allocation before it;
inputs and weights excluded, gradients included), median time of 3 timed calls after 1 warm-up, and
the max abs difference of the outputs to the first row of its group.

The first row of each group is its baseline. Run on the GPU host::

    python -m benchmarks.gpu.bench_models_memory [--out DIR]

Prints a table and writes ``OUT/models_memory.json``. ``--quick`` uses small shapes (smoke run;
``--device cpu`` then reports no memory).
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks import _harness as harness
from underlay.models import TiledMLP, packed_forward, prepare_model
from underlay.ops.packing import unpad
from underlay.registry import get_logprob_kernel


def measure(
    fn: Callable[[], torch.Tensor], clear: Callable[[], None], device: torch.device, reps: int = 3
) -> tuple[float, float, torch.Tensor]:
    """(median ms, peak extra GiB, output of the measured call) of ``fn`` (forward + backward);
    ``clear`` drops the gradients of earlier calls before the baseline allocation is read."""
    out = fn()  # warm-up (Triton compilation, cuBLAS handles)
    del out
    clear()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out = fn()
    peak = 0.0
    if cuda:
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms = harness.timeit(fn, warmup=0, repeats=reps, device=device).median * 1e3
    return ms, peak, out.detach()


def head_rows(n: int, h: int, v: int, device: torch.device) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    hidden = (torch.randn(n, h, device=device) * 0.5).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(v, h, device=device) * 0.02).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, v, (n,), device=device)

    def zero() -> None:
        hidden.grad = None
        weight.grad = None

    def logits_path() -> torch.Tensor:
        zero()
        logits = (hidden @ weight.T).float()
        lsm = logits.log_softmax(-1)
        lp = lsm.gather(-1, labels[:, None])[:, 0]
        ent = -(lsm.exp() * lsm).sum(-1)
        (lp.sum() + 0.1 * ent.sum()).backward()
        return lp

    def fused(kernel: Any) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            zero()
            res = kernel(hidden, weight, labels, with_entropy=True)
            (res.log_probs.sum() + 0.1 * res.entropy.sum()).backward()
            return res.log_probs  # type: ignore[no-any-return]

        return run

    methods: list[tuple[str, Callable[[], torch.Tensor]]] = [("logits", logits_path)]
    auto = get_logprob_kernel()
    methods.append((f"fused ({auto.name})", fused(auto)))
    if auto.name != "torch":
        methods.append(("fused (torch)", fused(get_logprob_kernel("torch"))))
    return run_group(f"head N={n} H={h} V={v}", methods, zero, device)


def model_rows(batch: int, seqlen: int, quick: bool, device: torch.device) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, Qwen2Config

    dims = (
        dict(
            hidden_size=64,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
        )
        if quick
        else dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
        )
    )
    cfg = Qwen2Config(num_hidden_layers=1, max_position_embeddings=seqlen, tie_word_embeddings=False, **dims)
    torch.manual_seed(0)
    with device:  # initialise on the device (a 152064 x 3584 embedding is slow to fill on the host)
        ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    ours = prepare_model(copy.deepcopy(ref))
    ids = torch.randint(0, cfg.vocab_size, (batch, seqlen), device=device)
    mask = torch.ones_like(ids)
    packed = unpad(ids, mask)

    def hf() -> torch.Tensor:
        ref.zero_grad(set_to_none=True)
        logits = ref(input_ids=ids, attention_mask=mask).logits.float()
        lsm = logits.log_softmax(-1)
        lp = lsm[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        ent = -(lsm.exp() * lsm).sum(-1)[:, :-1]
        (lp.sum() + 0.1 * ent.sum()).backward()
        return torch.cat([lp.new_zeros(batch, 1), lp], dim=1).reshape(-1)

    def packed_run() -> torch.Tensor:
        ours.zero_grad(set_to_none=True)
        out = packed_forward(ours, packed)
        assert out.log_probs is not None and out.entropy is not None
        (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
        return out.log_probs

    def clear() -> None:
        ref.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)

    return run_group(
        f"model 1 layer {batch}x{seqlen} H={cfg.hidden_size} V={cfg.vocab_size}",
        [("hf logits", hf), ("packed_forward", packed_run)],
        clear,
        device,
    )


def mlp_rows(n: int, h: int, f: int, device: torch.device) -> list[dict[str, Any]]:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    torch.manual_seed(0)
    mlp: nn.Module = Qwen2MLP(Qwen2Config(hidden_size=h, intermediate_size=f)).to(device, torch.bfloat16)
    x = torch.randn(1, n, h, device=device, dtype=torch.bfloat16).requires_grad_(True)
    up = torch.randn(1, n, h, device=device, dtype=torch.bfloat16)

    def run(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def go() -> torch.Tensor:
            x.grad = None
            mlp.zero_grad(set_to_none=True)
            y = fn(x)
            (y * up).sum().backward()
            assert x.grad is not None
            return x.grad.reshape(-1)  # compare input gradients

        return go

    methods: list[tuple[str, Callable[[], torch.Tensor]]] = [("plain MLP", run(mlp))]
    for tiles in (2, 4, 8, 16):
        methods.append((f"TiledMLP x{tiles}", run(TiledMLP(mlp, tiles))))

    def clear() -> None:
        x.grad = None
        mlp.zero_grad(set_to_none=True)

    return run_group(f"mlp N={n} H={h} F={f}", methods, clear, device)


def run_group(
    group: str,
    methods: list[tuple[str, Callable[[], torch.Tensor]]],
    clear: Callable[[], None],
    device: torch.device,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    first: torch.Tensor | None = None
    for name, fn in methods:
        ms, peak, out = measure(fn, clear, device)
        out = out.float()
        if first is None:
            first = out
        diff = float((out - first).abs().max())
        rows.append(
            {
                "group": group,
                "method": name,
                "ms": round(ms, 2),
                "peak_gib": round(peak, 3),
                "max_abs_diff": diff,
            }
        )
        del out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = rows[0]["peak_gib"]
    for r in rows:
        r["peak_vs_first"] = round(harness.ratio(r["peak_gib"], base), 3) if base else None
    return rows


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible; run on the GPU host (or --device cpu --quick for a smoke run)")
        return 2

    t0 = time.time()
    if args.quick:
        rows = (
            head_rows(512, 64, 1000, device)
            + model_rows(2, 64, True, device)
            + mlp_rows(512, 64, 256, device)
        )
    else:
        rows = head_rows(16384, 3584, 152064, device)
        rows += model_rows(8, 2048, False, device)
        rows += mlp_rows(16384, 3584, 18944, device)
    meta = {"seconds": round(time.time() - t0, 1), "device": str(device)}
    print(f"# {meta['device']} (fwd+bwd, bf16)")
    print(f"{'group':<44}{'method':<20}{'peak GiB':>10}{'x first':>9}{'ms':>10}{'max|diff|':>12}")
    for r in rows:
        ratio = "-" if r["peak_vs_first"] is None else f"{r['peak_vs_first']:.3f}"
        print(
            f"{r['group']:<44}{r['method']:<20}{r['peak_gib']:>10.3f}{ratio:>9}{r['ms']:>10.1f}{r['max_abs_diff']:>12.2e}"
        )
    firsts: dict[str, dict[str, Any]] = {}
    for r in rows:
        firsts.setdefault(r["group"], r)
    summary = "; ".join(
        f"{g.split(' (')[0]}: "
        + ", ".join(
            f"{r['method']} {r['peak_vs_first']}x" for r in rows if r["group"] == g and r is not first
        )
        for g, first in firsts.items()
    )
    harness.report(
        "models_memory",
        {"meta": meta, "rows": rows},
        f"peak vs the group's first row: {summary}",
        harness.out_dir(args),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
