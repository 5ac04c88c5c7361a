"""Tokenization + batching throughput of underlay.data against a plain ``datasets.map`` +
``apply_chat_template`` pipeline, on synthetic conversations, on the CPU, in the same run.

Two workloads:

- ``rl``: one user turn (+ a system prompt) rendered with the generation prompt -> left-padded prompt
  batches. underlay: ``RLPromptDataset`` pre-pass + ``collate_prompts``; baseline: ``datasets.map``
  calling ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)`` + padding with
  ``tokenizer.pad``.
- ``sft``: 2-turn conversations (4 messages) -> right-padded batches. underlay: ``SFTDataset``
  (assistant-only loss masks, per-turn ids, turn-consistency enforced) + ``collate_padded``; the
  baseline tokenizes the whole conversation once and builds no masks, so it does less work.

    python -m benchmarks.cpu.bench_data [--n 100000] [--batch 64] [--out DIR]

Prints conversations/s of each pipeline (one timed pass each) and the ratio underlay / baseline; writes
``OUT/data.json``.
"""

from __future__ import annotations

import platform
import random
import time
from typing import Any

from benchmarks import _harness as harness

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "light",
    "green",
    "quick",
    "slow",
    "blue",
    "seven",
    "eight",
    "tree",
    "bird",
]


def conversations(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for _ in range(n):
        rows.append(
            {
                "prompt": [{"role": "user", "content": text(rng.randint(5, 30))}],
                "ground_truth": rng.choice(WORDS),
                "messages": [
                    {"role": "user", "content": text(rng.randint(5, 30))},
                    {"role": "assistant", "content": text(rng.randint(5, 40))},
                    {"role": "user", "content": text(rng.randint(5, 20))},
                    {"role": "assistant", "content": text(rng.randint(5, 40))},
                ],
            }
        )
    return rows


def run(n: int, batch: int) -> dict[str, Any]:
    import datasets
    import tokenizers
    import torch
    import transformers

    from underlay.data.collate import collate_padded, collate_prompts
    from underlay.data.datasets import RLPromptDataset, SFTDataset
    from underlay.demo.tokenizer import train_chat_tokenizer

    datasets.disable_progress_bars()
    rows = conversations(n, seed=0)
    tok = train_chat_tokenizer([" ".join(WORDS)] * 50, vocab_size=128)
    results: dict[str, Any] = {}

    # ---- rl prompts
    t0 = time.perf_counter()
    ds = RLPromptDataset(rows, tok, field_keys=["ground_truth"], system_prompt="be brief", max_length=512)
    for i in range(0, len(ds), batch):
        collate_prompts([ds[j] for j in range(i, min(i + batch, len(ds)))], tok.pad_token_id)
    ours = time.perf_counter() - t0

    t0 = time.perf_counter()
    hf = datasets.Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows]
    )

    def render(ex: dict[str, Any]) -> dict[str, Any]:
        msgs = [{"role": "system", "content": "be brief"}, *ex["prompt"]]
        return {
            "input_ids": tok.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        }

    mapped = hf.map(render, remove_columns=["prompt"])
    for i in range(0, len(mapped), batch):
        part = mapped[i : i + batch]
        tok.pad({"input_ids": part["input_ids"]}, return_tensors="pt")
    base = time.perf_counter() - t0
    check = collate_prompts([ds[0]], tok.pad_token_id).batch.input_ids[0].tolist()
    same = check == list(mapped[0]["input_ids"])
    results["rl"] = {
        "underlay_per_s": n / ours,
        "baseline_per_s": n / base,
        "ratio": harness.ratio(base, ours),
        "same_ids": same,
    }

    # ---- sft with masks
    t0 = time.perf_counter()
    sft = SFTDataset(rows, tok, max_length=512)
    for i in range(0, len(sft), batch):
        collate_padded([sft[j] for j in range(i, min(i + batch, len(sft)))], tok.pad_token_id)
    ours = time.perf_counter() - t0

    t0 = time.perf_counter()
    hf = datasets.Dataset.from_list([{"messages": r["messages"]} for r in rows])
    mapped = hf.map(
        lambda ex: {"input_ids": tok.apply_chat_template(ex["messages"], tokenize=True, return_dict=False)},
        remove_columns=["messages"],
    )
    tok.padding_side = "right"
    for i in range(0, len(mapped), batch):
        tok.pad({"input_ids": mapped[i : i + batch]["input_ids"]}, return_tensors="pt")
    tok.padding_side = "left"
    base = time.perf_counter() - t0
    same = list(sft[0].input_ids) == list(mapped[0]["input_ids"])
    results["sft"] = {
        "underlay_per_s": n / ours,
        "baseline_per_s": n / base,
        "ratio": harness.ratio(base, ours),
        "same_ids": same,
    }
    results["meta"] = {
        "n": n,
        "batch": batch,
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "datasets": datasets.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    return results


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--n", type=int, default=100_000, help="synthetic conversations (default 100000)")
    ap.add_argument("--batch", type=int, default=64, help="batch size of the collation step")
    args = ap.parse_args()
    res = run(args.n, args.batch)
    summary = "; ".join(
        f"{k}: underlay {res[k]['underlay_per_s']:.0f} conv/s vs datasets.map+apply_chat_template "
        f"{res[k]['baseline_per_s']:.0f} ({res[k]['ratio']:.2f}x), same ids {res[k]['same_ids']}"
        for k in ("rl", "sft")
    )
    harness.report("data", res, summary, harness.out_dir(args))


if __name__ == "__main__":
    main()
