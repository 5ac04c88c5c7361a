"""The demo's task: answer with the word the user names (``say cat`` -> ``cat``).

A tiny randomly initialised model learns it within a few dozen GRPO steps on a CPU: the answer is one
token of a locally trained BPE vocabulary, so a random policy already hits it with probability about
``1 / vocab_size``, and the shaped reward (partial credit for naming any task word) gives every group
a signal from the first step. Rows are written as jsonl or parquet and read back through
:mod:`underlay.data.datasets` like any user dataset.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from underlay.interfaces import InvalidInput

__all__ = ["PARTIAL_REWARD", "SYSTEM_PROMPT", "WORDS", "make_rows", "reward", "write_dataset"]

WORDS = ("cat", "dog", "sun", "tree", "fish", "bird", "moon", "star")
"""The words prompts name (each becomes one token of the demo tokenizer)."""

PARTIAL_REWARD = 0.2
"""Reward for answering with a task word other than the one asked for."""

SYSTEM_PROMPT = "echo"
"""The demo's system prompt (rendered by the chat template before the user turn)."""


def make_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt": [{"role": "user", "content": "say <w>"}], "ground_truth": w, "id": i}``
    drawn with ``random.Random(seed)``. Raises ``InvalidInput`` for ``n < 1``."""
    if n < 1:
        raise InvalidInput(f"make_rows(n={n}): need at least one row")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        w = rng.choice(WORDS)
        rows.append({"prompt": [{"role": "user", "content": f"say {w}"}], "ground_truth": w, "id": i})
    return rows


def write_dataset(path: str | Path, n: int, seed: int) -> Path:
    """Write :func:`make_rows` to ``path`` (``.jsonl`` or ``.parquet``, chosen by the suffix);
    returns the path. Raises ``InvalidInput`` for another suffix."""
    p = Path(path)
    rows = make_rows(n, seed)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".jsonl":
        p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), p)
    else:
        raise InvalidInput(f"write_dataset: {p} must end in .jsonl or .parquet")
    return p


def reward(response: str, ground_truth: str) -> float:
    """1.0 when the first word of ``response`` is ``ground_truth``; :data:`PARTIAL_REWARD` when it is
    another word of :data:`WORDS`; else 0.0."""
    words = response.split()
    if not words:
        return 0.0
    if words[0] == ground_truth:
        return 1.0
    return PARTIAL_REWARD if words[0] in WORDS else 0.0
