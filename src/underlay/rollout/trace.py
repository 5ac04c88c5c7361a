"""Rollout trace (what each rollout was) and rollout replay (dump chosen steps, feed them back later).

``RolloutTracer`` writes one row per rollout (prompt, response, reward, log-probs, timing, extras) for a
deterministic sample of rollouts, to ``jsonl`` by default and to mlflow / wandb tables when those
packages are installed. ``RolloutReplay`` saves the rollouts of chosen steps (tensors as safetensors,
text as JSON: nothing is unpickled on load) and, in replay mode, returns them instead of calling the
generator, refusing a dump whose configuration key differs from the current one.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import shutil
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from underlay.interfaces import BackendUnavailable, CheckpointError, ConfigError, InvalidInput
from underlay.parallel.rank import current_rank

__all__ = ["RolloutRecord", "RolloutReplay", "RolloutTracer", "config_key", "read_trace"]

TRACE_BACKENDS = ("jsonl", "mlflow", "wandb")


@dataclass(frozen=True)
class RolloutRecord:
    """One rollout. ``prompt``/``response``: text or token ids; ``log_probs``: per response token
    (the sampler's or the trainer's, as the caller decides); ``gen_seconds``: generation wall time of
    the batch it was in; ``extra``: any JSON-able values (answer, finish reason, weight version...)."""

    step: int
    index: int
    prompt: str | list[int]
    response: str | list[int]
    reward: float
    log_probs: list[float] | None = None
    gen_seconds: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The JSON row (non-finite floats become ``None``)."""
        raw = asdict(self)
        raw["reward"] = _finite(self.reward)
        if self.log_probs is not None:
            raw["log_probs"] = [_finite(x) for x in self.log_probs]
        raw["extra"] = dict(self.extra)
        return raw


def _finite(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _sampled(seed: int, step: int, index: int, rate: float) -> bool:
    """Deterministic Bernoulli(rate) per (seed, step, index): the same rollouts are traced on every
    run and every rank, whatever the batch order."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < rate


class RolloutTracer:
    """Writes sampled ``RolloutRecord`` rows.

    ``sample_rate`` in [0, 1]: the fraction of rollouts kept (deterministic in ``seed``, step and
    index). ``backends``: ``"jsonl"`` (``out_dir/rollouts.rank{r}.jsonl``, one row per line, flushed
    per call), ``"mlflow"`` (a table artifact per step through ``mlflow.log_table``), ``"wandb"`` (a
    ``wandb.Table`` per step in the active run). Every rank traces its own rollouts. Raises
    ``ConfigError`` for a bad rate or backend name and ``BackendUnavailable`` when mlflow/wandb is
    asked for but not installed.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        sample_rate: float = 1.0,
        backends: Sequence[str] = ("jsonl",),
        seed: int = 0,
        rank: int | None = None,
    ) -> None:
        if isinstance(sample_rate, bool) or not 0.0 <= float(sample_rate) <= 1.0:
            raise ConfigError(f"RolloutTracer sample_rate={sample_rate!r}: use a number in [0, 1]")
        unknown = [b for b in backends if b not in TRACE_BACKENDS]
        if unknown or isinstance(backends, str) or len(set(backends)) != len(backends):
            raise ConfigError(
                f"RolloutTracer backends={backends!r}: a sequence of distinct names from {TRACE_BACKENDS}"
            )
        self.rate, self.seed = float(sample_rate), seed
        self.rank = current_rank() if rank is None else rank
        self.out_dir = Path(out_dir)
        self._mods: dict[str, Any] = {}
        for b in backends:
            if b != "jsonl":
                try:
                    self._mods[b] = importlib.import_module(b)
                except ImportError as exc:
                    raise BackendUnavailable(
                        "rollout trace",
                        b,
                        f"the {b!r} package is not installed",
                        ["jsonl"],
                        f"pip install {b}",
                    ) from exc
        self._file: Any = None
        if "jsonl" in backends:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    @property
    def path(self) -> Path:
        """The jsonl file of this rank."""
        return self.out_dir / f"rollouts.rank{self.rank}.jsonl"

    def record(self, records: Sequence[RolloutRecord]) -> int:
        """Write the sampled subset of ``records``; returns how many were written. Raises
        ``InvalidInput`` for a record with a negative step or index."""
        kept = []
        for r in records:
            if r.step < 0 or r.index < 0:
                raise InvalidInput(f"RolloutRecord step={r.step} index={r.index}: both must be >= 0")
            if _sampled(self.seed, r.step, r.index, self.rate):
                kept.append(r.row())
        if not kept:
            return 0
        if self._file is not None:
            for row in kept:
                self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()
        by_step: dict[int, list[dict[str, Any]]] = {}
        for row in kept:
            by_step.setdefault(int(row["step"]), []).append(row)
        cols = ["step", "index", "prompt", "response", "reward", "gen_seconds", "log_probs", "extra"]
        for step, rows in by_step.items():
            table = [[json.dumps(r[c]) if c in ("log_probs", "extra") else r[c] for c in cols] for r in rows]
            if "mlflow" in self._mods:
                data = {c: [t[i] for t in table] for i, c in enumerate(cols)}
                self._mods["mlflow"].log_table(
                    data=data, artifact_file=f"rollouts/rank{self.rank}_step{step}.json"
                )
            if "wandb" in self._mods:
                wandb = self._mods["wandb"]
                wandb.log({f"rollouts/rank{self.rank}": wandb.Table(columns=cols, data=table)}, step=step)
        return len(kept)

    def close(self) -> None:
        """Flush and close the jsonl file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RolloutTracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a jsonl trace file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def config_key(config: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of ``config`` (what determines the rollouts: model, weights
    version, data, sampling settings, seeds). Raises ``InvalidInput`` when it is not JSON-able."""
    try:
        canon = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"rollout replay key must be JSON-able: {exc}") from exc
    return hashlib.sha256(canon.encode()).hexdigest()


def _diff(saved: Mapping[str, Any], mine: Mapping[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k in sorted(set(saved) | set(mine), key=str):
        a, b = saved.get(k, "<absent>"), mine.get(k, "<absent>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: dump {a!r} != now {b!r}")
    return out


class RolloutReplay:
    """Dump the rollouts of chosen steps, or replay them instead of generating.

    ``mode``: ``"off"`` (always generate), ``"record"`` (generate; save steps in ``steps``, all when
    ``None``), ``"replay"`` (load the saved rollouts of steps in ``steps`` instead of generating;
    other steps generate). ``config`` is the JSON-able configuration the rollouts depend on; a dump
    records it and replay refuses (``ConfigError`` naming the differing keys) a dump made under
    another one. Rollouts are ``{name: tensor}`` (saved as safetensors) plus optional JSON ``meta``.
    Files: ``root/step{step:08d}.rank{rank}.safetensors`` and ``.json``, written atomically.
    """

    def __init__(
        self,
        root: str | Path,
        config: Mapping[str, Any],
        *,
        mode: Literal["off", "record", "replay"] = "off",
        steps: Collection[int] | None = None,
        rank: int | None = None,
    ) -> None:
        if mode not in ("off", "record", "replay"):
            raise ConfigError(f"RolloutReplay mode={mode!r}: use 'off', 'record' or 'replay'")
        self.root, self.mode = Path(root), mode
        self.config = json.loads(json.dumps(dict(config)))
        self.key = config_key(self.config)
        self.steps = None if steps is None else frozenset(int(s) for s in steps)
        self.rank = current_rank() if rank is None else rank

    def _paths(self, step: int) -> tuple[Path, Path]:
        base = f"step{step:08d}.rank{self.rank}"
        return self.root / f"{base}.safetensors", self.root / f"{base}.json"

    def _chosen(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def save(
        self, step: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None = None
    ) -> Path:
        """Write the rollouts of ``step`` (tensors copied to the cpu); returns the tensor file."""
        from safetensors.torch import save_file

        self.root.mkdir(parents=True, exist_ok=True)
        st, js = self._paths(step)
        data = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        tmp_st, tmp_js = st.with_name(st.name + ".tmp"), js.with_name(js.name + ".tmp")
        save_file(data, str(tmp_st), metadata={"key": self.key})
        side = {
            "key": self.key,
            "config": self.config,
            "step": step,
            "rank": self.rank,
            "meta": dict(meta or {}),
        }
        tmp_js.write_text(json.dumps(side, indent=1), encoding="utf-8")
        os.replace(tmp_st, st)
        os.replace(tmp_js, js)
        return st

    def load(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The saved ``(tensors, meta)`` of ``step``. Raises ``CheckpointError`` when there is none and
        ``ConfigError`` when it was made under another configuration."""
        from safetensors.torch import load_file

        st, js = self._paths(step)
        if not st.is_file() or not js.is_file():
            raise CheckpointError(
                f"no rollout dump for step {step} rank {self.rank} in {self.root}; record it first "
                "(mode='record') or drop the step from the replay steps"
            )
        side = json.loads(js.read_text(encoding="utf-8"))
        if side.get("key") != self.key:
            diff = _diff(side.get("config", {}), self.config)
            raise ConfigError(
                f"rollout dump {st} was made under another configuration ({'; '.join(diff[:5]) or 'key differs'}); "
                "replay it with the configuration that made it"
            )
        tensors = load_file(str(st))
        return tensors, dict(side.get("meta", {}))

    def __call__(
        self,
        step: int,
        generate: Callable[[], tuple[dict[str, torch.Tensor], Mapping[str, Any]]],
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The rollouts of ``step``: replayed from the dump (replay mode, chosen step) or from
        ``generate()`` (saved when recording a chosen step)."""
        if self.mode == "replay" and self._chosen(step):
            return self.load(step)
        tensors, meta = generate()
        if self.mode == "record" and self._chosen(step):
            self.save(step, tensors, meta)
        return dict(tensors), dict(meta)

    def clear(self) -> None:
        """Delete every dump of this rank under ``root``."""
        for p in self.root.glob(f"step*.rank{self.rank}.*"):
            if p.is_file():
                p.unlink()
        if self.root.is_dir() and not any(self.root.iterdir()):
            shutil.rmtree(self.root, ignore_errors=True)
