"""What every engine does the same way, in one place: batch validation, the non-finite step report and
the all-or-nothing restore of live state around a checkpoint load.

Engines import these; nothing here knows an engine (the ``ParallelEngine`` protocol and plain torch
objects only), so the engines stay independent of each other.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from underlay.interfaces import CheckpointError, Device, EngineConfig, InvalidInput, TokenBatch, UnderlayError

__all__ = [
    "EngineBase",
    "LiveState",
    "check_token_batch",
    "export_hf_atomic",
    "load_transaction",
    "report_nonfinite",
]

log = logging.getLogger("underlay.engines")


def check_token_batch(batch: TokenBatch, vocab: int, *, shared_prompts: bool = False) -> None:
    """Validate a ``TokenBatch`` where it enters an engine (``docs/reliability.md`` §7), reading only
    the tensors where they are (give host tensors for no device synchronisation).

    Raises ``InvalidInput`` naming the bad value and the fix for: ``input_ids`` not int64/int32; an
    empty batch (``B = 0``); an ``attention_mask`` or ``loss_mask`` with values other than 0/1; a
    row without tokens; a ``loss_mask`` that marks padding (``attention_mask`` 0: it would change the
    loss-token count that normalises the loss); token ids outside ``[0, vocab)`` (``vocab`` 0: no
    upper bound); ``TokenBatch.prompt_groups`` unless the engine computes shared prompts
    (``shared_prompts``). Changes nothing."""
    if batch.prompt_groups is not None and not shared_prompts:
        raise InvalidInput(
            "TokenBatch.prompt_groups: this engine does not compute shared prompts (the fsdp2 engine "
            "does: docs/roles.md); give the batch without prompt_groups"
        )
    ids, mask, loss = batch.input_ids, batch.attention_mask, batch.loss_mask
    if ids.dtype not in (torch.int64, torch.int32):
        raise InvalidInput(f"TokenBatch.input_ids dtype {ids.dtype}: use int64 token ids")
    if batch.batch_size < 1:
        raise InvalidInput("TokenBatch is empty (B=0); give this rank at least one sequence")
    for name, m in (("attention_mask", mask), ("loss_mask", loss)):
        bad = (m != 0) & (m != 1)
        if bool(bad.any()):
            raise InvalidInput(
                f"TokenBatch.{name} holds values other than 0/1 ({sorted(set(m[bad].tolist()))[:5]}); "
                "masks select tokens, weight the loss in loss_fn instead"
            )
    lengths = mask.sum(dim=1)
    if bool((lengths < 1).any()):
        rows = torch.nonzero(lengths < 1).flatten().tolist()
        raise InvalidInput(f"TokenBatch rows {rows} have no tokens in attention_mask; drop empty sequences")
    padding_loss = (loss != 0) & (mask == 0)
    if bool(padding_loss.any()):
        rows = torch.nonzero(padding_loss.any(dim=1)).flatten().tolist()
        raise InvalidInput(
            f"TokenBatch.loss_mask marks padding (attention_mask 0) in rows {rows[:5]}; the loss "
            "token count would include padding: set loss_mask = loss_mask * attention_mask"
        )
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab and high >= vocab):
        raise InvalidInput(f"TokenBatch.input_ids out of range [0, {vocab}): min {low}, max {high}")


def report_nonfinite(
    what: str,
    reduced: Mapping[str, float],
    local: Mapping[str, torch.Tensor],
    device: torch.device,
    group: Any = None,
) -> bool:
    """After a step's metrics were reduced (``reduced``: the same keys and values on every rank of
    ``group``): ``False`` when all are finite (no communication). Otherwise every rank learns which
    ranks had which non-finite local values (``local``: this rank's metric sums before the
    reduction; missing keys count as finite, e.g. on non-last pipeline stages) through one
    ``all_gather`` of a ``[len(reduced)]`` flag vector on ``device`` over ``group`` (default: the
    world), logs one warning naming them on logger ``underlay.engines`` and returns ``True``: the
    engine then skips its next optimizer step. Collective over ``group`` in that case only; every
    rank takes the same branch because ``reduced`` is the same everywhere."""
    if all(math.isfinite(v) for v in reduced.values()):
        return False
    keys = sorted(reduced)
    flags = torch.tensor(
        [0.0 if k not in local or math.isfinite(float(local[k])) else 1.0 for k in keys], device=device
    )
    rows = [flags]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        rows = [torch.empty_like(flags) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, flags, group=group)
    ranks = dist.get_process_group_ranks(group) if dist.is_initialized() and group is not None else None
    named = []
    for i, row in enumerate(rows):
        bad_here = [k for k, f in zip(keys, row.tolist()) if f]
        if bad_here:
            rank = ranks[i] if ranks is not None else i
            named.append(f"rank {rank}: " + ", ".join(bad_here))
    bad = [k for k in keys if not math.isfinite(reduced[k])]
    log.warning(
        "%s: non-finite %s (%s); the next optimizer_step skips the update on every rank and changes "
        "no parameter (check the loss_fn and the batch of those ranks)",
        what,
        ", ".join(bad),
        "; ".join(named) or "no rank had a non-finite local value: the reduction overflowed",
    )
    return True


@dataclass
class _OptimizerCopy:
    optimizer: torch.optim.Optimizer
    state: Any  # the state mapping object itself (a load may replace it)
    per_param: list[tuple[Any, dict[str, Any]]]  # (key, shallow copy of its state dict)
    groups: list[dict[str, Any]]  # param-group settings (without the params)


class LiveState:
    """A host copy of an engine's live training state: the given tensors' values (parameters, master
    copies, optimizer moments), each torch optimizer's state mapping and param-group settings, and
    each LR scheduler's state. ``restore()`` puts all of it back in place (same tensor objects, same
    state mapping objects), so whatever a failed load wrote is undone.

    Memory: one host copy of every given tensor (what a checkpoint of this rank holds)."""

    def __init__(
        self,
        tensors: Iterable[torch.Tensor],
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any] = (),
    ) -> None:
        self._tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        for t in tensors:
            local = _local(t)
            if id(local) in seen:
                continue
            seen.add(id(local))
            self._tensors.append((local, local.detach().to("cpu", copy=True)))
        self._optims = []
        for opt in optimizers:
            per = [(k, dict(v)) for k, v in opt.state.items()]
            for _, st in per:
                for v in st.values():
                    if torch.is_tensor(v) and id(_local(v)) not in seen:
                        seen.add(id(_local(v)))
                        self._tensors.append((_local(v), _local(v).detach().to("cpu", copy=True)))
            groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
            self._optims.append(_OptimizerCopy(opt, opt.state, per, groups))
        self._schedulers = [(s, copy.deepcopy(s.state_dict())) for s in schedulers]

    @torch.no_grad()
    def restore(self) -> None:
        """Put every value back (in place)."""
        for o in self._optims:
            o.optimizer.state = o.state
            o.state.clear()
            for key, st in o.per_param:
                o.state[key] = st
            for g, saved in zip(o.optimizer.param_groups, o.groups):
                g.update(copy.deepcopy(saved))
        for live, host in self._tensors:
            live.copy_(host.to(live.device))
        for s, st in self._schedulers:
            type(s).load_state_dict(s, copy.deepcopy(st))  # the class's: never a wrapper that failed


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (the object to copy into), else ``t``."""
    to_local = getattr(t, "_local_tensor", None)
    return to_local if isinstance(to_local, torch.Tensor) else t


@contextmanager
def load_transaction(what: str, state: LiveState) -> Iterator[None]:
    """Run a checkpoint load all-or-nothing: any failure inside, ``BaseException``s that are not
    ``KeyboardInterrupt``/``SystemExit`` included (torch's ``CheckpointException`` is one), puts
    ``state`` back and raises ``CheckpointError`` naming ``what`` and the cause (an ``UnderlayError``
    keeps its type); the live state is then exactly what it was before the load."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        state.restore()
        raise
    except BaseException as exc:
        state.restore()
        if isinstance(exc, UnderlayError):
            raise
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
        raise CheckpointError(
            f"{what}: {type(exc).__name__}: {reason}; nothing was changed (the engine's parameters, "
            "optimizer state and LR schedule are as before the call)"
        ) from exc


def export_hf_atomic(
    engine: Any,
    out_dir: str | Path,
    tensors: Iterator[tuple[str, torch.Tensor]],
    write_config: Callable[[Path], None],
    *,
    dtype: torch.dtype | None,
    max_shard_bytes: int,
    buffer_bytes: int,
) -> Path | None:
    """The ``WeightLoader.export_hf`` of every engine: rank 0 streams ``tensors`` (``(hf_name, full
    tensor)`` in the order of ``engine.weight_map``'s rules, collective: every rank iterates them to
    the end) into safetensors shards of at most ``max_shard_bytes`` in ``dtype`` (default the engine's
    ``param_dtype``) inside a fresh sibling directory, ``write_config(dir)`` adds ``config.json`` and
    the source's tokenizer files, and the directory is fsynced and swapped in whole
    (``utils.safe_files``, ``docs/reliability.md`` §4): ``out_dir`` then holds the complete new export,
    or, on any failure, exactly what it held before. ``InvalidInput`` for a bad ``max_shard_bytes`` or
    ``dtype`` before any collective; ``CheckpointError`` on every rank when rank 0 fails. Returns
    ``out_dir`` on rank 0, ``None`` elsewhere."""
    from underlay.engines._hf_export import StreamingShardWriter, export_owned
    from underlay.parallel.agree import agree, describe
    from underlay.parallel.rank import current_rank
    from underlay.utils.safe_files import abort_directory, as_path, begin_directory, commit_directory

    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InvalidInput(f"export_hf: max_shard_bytes={max_shard_bytes!r} must be an int >= 1")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise InvalidInput(
            f"export_hf: dtype={dtype!r} is not a floating torch dtype; use torch.bfloat16, "
            "torch.float16 or torch.float32 (or None for the engine's param_dtype)"
        )
    out = as_path(out_dir, "export_hf: out_dir")
    dtype = dtype or engine.param_dtype
    rank0 = current_rank() == 0
    error: BaseException | None = None
    tmp: Path | None = None
    writer: StreamingShardWriter | None = None
    if rank0:
        try:
            # refuses, before anything changes, a target that is a file or holds what an export does
            # not write (docs/reliability.md §4)
            tmp = begin_directory(out, replaceable=export_owned)
            entries = [
                (hf, shape) for rule in engine.weight_map.rules for hf, shape in rule.hf_shapes().items()
            ]
            writer = StreamingShardWriter(tmp, entries, dtype, max_shard_bytes, buffer_bytes)
        except Exception as exc:
            error = exc
    for name, full in tensors:
        if writer is not None and error is None:
            try:
                writer.add(name, full.to(dtype).cpu())
            except Exception as exc:
                error = exc
        del full
    if writer is not None and tmp is not None:
        try:
            if error is None:
                writer.finish()
                write_config(tmp)
                commit_directory(tmp, out)
        except Exception as exc:
            error = exc
        finally:
            writer.close()
        if error is not None:
            abort_directory(tmp)
    elif tmp is not None:
        abort_directory(tmp)
    agree(error is None, describe(error), what=f"export_hf({out})", error_type=CheckpointError, cause=error)
    return out if rank0 else None


class EngineBase:
    """The members every engine implements identically: the read-only properties over what its
    ``__init__`` sets (``_config``, ``_device``, ``_hf_config``, ``_param_dtype``, ``_global_step``)
    and the offload guard over ``_offloaded`` (kinds of state now on the host)."""

    _config: EngineConfig
    _device: Device
    _hf_config: Any
    _param_dtype: torch.dtype
    _global_step: int
    _offloaded: dict[str, Any]
    _adapter_disabled: bool  # inside ``disable_adapter()`` (LoRA)

    @property
    def config(self) -> EngineConfig:
        """The configuration it was built from."""
        return self._config

    @property
    def device(self) -> Device:
        """The device it computes on."""
        return self._device

    @property
    def hf_config(self) -> Any:
        """The ``transformers`` config of the model."""
        return self._hf_config

    @property
    def param_dtype(self) -> torch.dtype:
        """The parameters' compute dtype (``config.param_dtype``)."""
        return self._param_dtype

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (skipped ones included)."""
        return self._global_step

    def _ensure_onloaded(self, what: str) -> None:
        """``InvalidInput`` naming ``what`` while any state is offloaded to the host."""
        if self._offloaded:
            raise InvalidInput(
                f"{what}: state {sorted(self._offloaded)} is offloaded to the host; call onload() first"
            )

    def _ensure_adapters_on(self) -> None:
        """``InvalidInput`` inside ``disable_adapter()``: ``forward_backward`` would train nothing there."""
        if self._adapter_disabled:
            raise InvalidInput(
                "forward_backward inside disable_adapter(): the adapters are bypassed there, nothing would "
                "train; leave the block first (use it for the reference log-probs of infer)"
            )
