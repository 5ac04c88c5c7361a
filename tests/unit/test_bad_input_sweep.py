"""Bad input never escapes as a foreign exception, and nothing of the user's is moved or lost.

A generated sweep: every field of every public config class (the demo's included) and every argument of every public ``ops``
function (from a valid baseline call) gets each adversarial value in turn (wrong types, negative and
zero sizes, NaN/inf, empty, 0-d/3-d/integer/NaN tensors, bad shapes, nested garbage); the export/save
paths (``utils.safe_files.atomic_directory`` as ``export_hf`` uses it, ``Tracking`` and its backends,
``CheckpointManager``/``latest``) get paths that are existing regular files, lie under a file, are
non-empty directories of the user's or are not paths at all. Each call either succeeds or raises an
``underlay.errors`` subclass; the user's file and directory are intact afterwards (no ``<path>.old``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from underlay.demo.config import DemoConfig
from underlay.interfaces import (
    EngineConfig,
    LoraConfig,
    LossContext,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ProfilerConfig,
    UnderlayError,
    from_dict,
)

BAD: dict[str, Any] = {
    "None": None,
    "str": "x",
    "empty_str": "",
    "neg": -1,
    "zero": 0,
    "frac": 1.5,
    "nan": math.nan,
    "inf": math.inf,
    "bool": True,
    "list": [],
    "dict": {},
    "object": object(),
    "bytes": b"x",
    "t0d": torch.tensor(1.0),
    "t3d": torch.randn(2, 2, 2),
    "tempty": torch.zeros(0, 4),
    "tint": torch.ones(3, 4, dtype=torch.long),
    "tnan": torch.full((3, 4), math.nan),
    "tshape": torch.randn(5, 7),
    "nested": [[1, "a"]],
    "negs": [-3, 4],
}


def _hf() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


CONFIGS: dict[type, Callable[[], dict[str, Any]]] = {
    LoraConfig: dict,
    ModelConfig: lambda: {"hf_config": _hf()},
    ParallelConfig: dict,
    OptimConfig: dict,
    ProfilerConfig: dict,
    EngineConfig: lambda: {"model": ModelConfig(hf_config=_hf())},
    DemoConfig: dict,
}


@pytest.mark.parametrize("cls", list(CONFIGS), ids=lambda c: c.__name__)
def test_config_fields_refuse_with_underlay_errors(cls: type) -> None:
    """Every field (and ``from_dict``) with every adversarial value: accepted or an underlay error."""
    foreign = []
    base = CONFIGS[cls]()
    for field in [f.name for f in dataclasses.fields(cls)] + [None]:
        for bad, raw in BAD.items():
            value = raw.clone() if isinstance(raw, torch.Tensor) else raw
            try:
                if field is None:
                    from_dict(cls, value)
                else:
                    cls(**{**base, field: value})
            except UnderlayError:
                pass
            except Exception as exc:
                foreign.append(f"{field}={bad}: {type(exc).__name__}: {exc}")
    assert not foreign, foreign


def _ops_baselines() -> dict[str, tuple[Callable[..., Any], list[Any], dict[str, Any]]]:
    import underlay.ops as o

    x = torch.randn(3, 4)
    m = torch.ones(3, 4, dtype=torch.long)
    m[0, 0] = 0
    ids = torch.randint(0, 8, (3, 4))
    am = torch.ones(3, 4, dtype=torch.long)
    am[1, 3] = 0
    logits, labels = torch.randn(3, 4, 8), torch.randint(0, 8, (3, 4))

    def opt() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    return {
        "aggregate_loss": (o.aggregate_loss, [x, m, "token-mean", LossContext.single(m)], {}),
        "balanced_group_partitions": (o.balanced_group_partitions, [[0, 0, 1, 1], [3, 4, 5, 6], 2], {}),
        "balanced_partitions": (o.balanced_partitions, [[3, 4, 5, 6], 2], {}),
        "build_lr_scheduler": (o.build_lr_scheduler, [opt(), OptimConfig()], {}),
        "clip_by_value": (o.clip_by_value, [x, -0.5, 0.5], {}),
        "constant_with_warmup": (o.constant_with_warmup, [opt(), 2], {}),
        "cosine_with_warmup": (o.cosine_with_warmup, [opt(), 2, 10], {"min_lr_ratio": 0.1}),
        "distributed_masked_mean": (o.distributed_masked_mean, [x, m], {}),
        "distributed_mean_max_min_std": (o.distributed_mean_max_min_std, [x], {"mask": m}),
        "entropy_from_logits": (o.entropy_from_logits, [logits], {"temperature": 1.0, "chunk_size": 2}),
        "greedy_lpt": (o.greedy_lpt, [[3.0, 4.0, 5.0], 2], {}),
        "group_ids_to_index": (o.group_ids_to_index, [[0, 0, 1]], {}),
        "group_mean_std": (o.group_mean_std, [torch.randn(4), [0, 0, 1, 1]], {}),
        "group_normalize": (o.group_normalize, [torch.randn(4), [0, 0, 1, 1]], {"eps": 1e-6}),
        "karmarkar_karp": (o.karmarkar_karp, [[3.0, 4.0, 5.0], 2], {}),
        "linear_logprobs": (
            o.linear_logprobs,
            [torch.randn(5, 6), torch.randn(8, 6), torch.randint(0, 8, (5,))],
            {"temperature": 1.0, "chunk_size": 2},
        ),
        "logprobs_from_logits": (
            o.logprobs_from_logits,
            [logits, labels],
            {"temperature": 1.0, "chunk_size": 2},
        ),
        "masked_mean": (o.masked_mean, [x, m], {}),
        "masked_sum": (o.masked_sum, [x, m], {}),
        "masked_var": (o.masked_var, [x, m], {}),
        "masked_whiten": (o.masked_whiten, [x, m], {"eps": 1e-8}),
        "pad": (o.pad, [torch.randn(int(am.sum())), o.unpad(ids, am)], {}),
        "pad_to_multiple": (o.pad_to_multiple, [x, 3], {"dim": -1}),
        "partition_loads": (o.partition_loads, [[3.0, 4.0, 5.0], [[0], [1, 2]]], {}),
        "plan_micro_batches": (o.plan_micro_batches, [[3, 4, 5], 8], {"min_count": 1, "multiple_of": 1}),
        "position_ids_from_mask": (o.position_ids_from_mask, [am], {}),
        "response_mask": (o.response_mask, [ids, 2], {}),
        "restore_order": (o.restore_order, [[[1, 2], [0]]], {}),
        "unpad": (o.unpad, [ids, am], {}),
        "warmup_stable_decay": (
            o.warmup_stable_decay,
            [opt(), 2, 10],
            {"decay_ratio": 0.2, "min_lr_ratio": 0.1},
        ),
    }


def test_every_public_ops_function_has_a_baseline() -> None:
    import underlay.ops as o

    functions = {n for n in o.__all__ if callable(getattr(o, n)) and not isinstance(getattr(o, n), type)}
    functions -= {"AggregationMode", "collective_device"}  # a type alias; takes only a process group
    assert functions == set(_ops_baselines())


@pytest.mark.parametrize("name", sorted(_ops_baselines()))
def test_ops_refuse_with_underlay_errors(name: str) -> None:
    """The valid baseline call works; each argument replaced by each adversarial value gives a result
    or an underlay error."""
    fn, args, kw = _ops_baselines()[name]
    fn(*args, **kw)
    foreign = []
    for slot in [*range(len(args)), *kw]:
        for bad, raw in BAD.items():
            fn, args, kw = _ops_baselines()[name]
            value = raw.clone() if isinstance(raw, torch.Tensor) else raw
            if isinstance(slot, int):
                args[slot] = value
            else:
                kw[slot] = value
            try:
                fn(*args, **kw)
            except UnderlayError:
                pass
            except Exception as exc:
                foreign.append(f"{slot}={bad}: {type(exc).__name__}: {exc}")
    assert not foreign, foreign


def _atomic(p: Any) -> None:
    from underlay.engines._hf_export import export_owned
    from underlay.utils.safe_files import atomic_directory

    with atomic_directory(p, replaceable=export_owned) as tmp:
        (tmp / "config.json").write_text("{}")


def _tracking(backend: str) -> Callable[[Any], None]:
    def run(p: Any) -> None:
        from underlay.tracking import Tracking

        Tracking((backend,), out_dir=p, rank=0).close()

    return run


def _jsonl(p: Any) -> None:
    from underlay.tracking.backends import JsonlBackend

    JsonlBackend(p).close()


def _tensorboard(p: Any) -> None:
    from underlay.tracking.backends import TensorBoardBackend

    TensorBoardBackend(p).close()


def _read_jsonl(p: Any) -> None:
    from underlay.tracking import read_jsonl

    read_jsonl(p)


def _latest(p: Any) -> None:
    from underlay.checkpoint import latest

    latest(p)


def _manager(p: Any) -> None:
    from types import SimpleNamespace

    from underlay.checkpoint import CheckpointManager

    CheckpointManager(p, engine=SimpleNamespace(device=None))  # type: ignore[arg-type]


PATH_USERS: dict[str, Callable[[Any], None]] = {
    "atomic_directory(export)": _atomic,
    "Tracking(jsonl)": _tracking("jsonl"),
    "Tracking(tensorboard)": _tracking("tensorboard"),
    "JsonlBackend": _jsonl,
    "TensorBoardBackend": _tensorboard,
    "read_jsonl": _read_jsonl,
    "latest": _latest,
    "CheckpointManager": _manager,
}
PATHS = ("file", "under_file", "user_dir", "missing", "empty", "None", "int", "list")
MUST_REFUSE = {  # writing there would move, replace or delete what the user has
    ("atomic_directory(export)", "file"),
    ("atomic_directory(export)", "under_file"),
    ("atomic_directory(export)", "user_dir"),
    ("atomic_directory(export)", "empty"),
    ("Tracking(jsonl)", "file"),
    ("Tracking(tensorboard)", "file"),
    ("TensorBoardBackend", "file"),
    ("JsonlBackend", "user_dir"),
}


@pytest.mark.parametrize("kind", PATHS)
@pytest.mark.parametrize("user", list(PATH_USERS))
def test_paths_refuse_and_keep_the_users_files(user: str, kind: str, tmp_path: Path) -> None:
    file = tmp_path / "file.txt"
    file.write_text("user data")
    mine = tmp_path / "dir"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    path: Any = {
        "file": file,
        "under_file": file / "sub",
        "user_dir": mine,
        "missing": tmp_path / "new" / "deeper",
        "empty": "",
        "None": None,
        "int": 3,
        "list": [],
    }[kind]
    refused = False
    try:
        PATH_USERS[user](path)
    except UnderlayError:
        refused = True
    assert refused or (user, kind) not in MUST_REFUSE, (user, kind)
    assert file.read_text() == "user data" and (mine / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".old")) == []
