"""A seeded, epoch-aware, data-parallel sampler whose position survives checkpoints and world-size changes.

The order is global: epoch ``e`` visits ``torch.randperm(n, generator=seed + e)`` (or ``0..n-1``
without shuffling), cut into global batches of ``global_batch_size`` samples. Rank ``r`` of
``world_size`` takes the contiguous share ``[r * b, (r + 1) * b)`` of each global batch, with
``b = global_batch_size / world_size``: shares are disjoint and, together, the global batch. The
state is global too (epoch and number of samples consumed in it), identical on every rank, so a run
resumed on another number of ranks continues with exactly the samples not yet seen, split the new way.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from underlay.interfaces import CheckpointError, ConfigError

__all__ = ["STATE_VERSION", "ResumableSampler"]

STATE_VERSION = 1


class ResumableSampler:
    """Yields this rank's sample indices, one global batch at a time.

    ``dataset_size`` samples, ``global_batch_size`` per step across all ranks (a multiple of
    ``world_size``), ``seed`` for the per-epoch permutation, ``fingerprint`` identifying the dataset
    (e.g. ``dataset.fingerprint``; a state from another dataset is refused). With ``drop_last=True``
    (default) the ``dataset_size % global_batch_size`` tail of each epoch's permutation is skipped
    (a different tail every epoch when shuffling); with ``False`` the last batch is completed with
    samples from the start of the same permutation, so every rank still gets the same count.
    Raises ``ConfigError`` for inconsistent sizes.
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
        fingerprint: str = "",
    ) -> None:
        if dataset_size < 1:
            raise ConfigError(f"ResumableSampler: dataset_size={dataset_size}; the dataset is empty")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"ResumableSampler: rank={rank} world_size={world_size} is not a valid rank")
        if global_batch_size < 1 or global_batch_size % world_size:
            raise ConfigError(
                f"ResumableSampler: global_batch_size={global_batch_size} must be a positive multiple of "
                f"world_size={world_size}"
            )
        if drop_last and global_batch_size > dataset_size:
            raise ConfigError(
                f"ResumableSampler: global_batch_size={global_batch_size} > dataset_size={dataset_size} with "
                "drop_last=True gives no batch; use drop_last=False or a smaller batch"
            )
        self.dataset_size, self.global_batch_size = dataset_size, global_batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle, self.drop_last, self.fingerprint = shuffle, drop_last, fingerprint
        self.epoch = 0
        self.consumed = 0  # samples of this epoch's order already handed out (all ranks together)
        self._order: list[int] | None = None
        self._order_epoch = -1

    @property
    def per_rank(self) -> int:
        """Samples per rank per batch."""
        return self.global_batch_size // self.world_size

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in one epoch."""
        n, b = self.dataset_size, self.global_batch_size
        return n // b if self.drop_last else -(-n // b)

    def order(self, epoch: int) -> list[int]:
        """The global visiting order of ``epoch`` (the same for a given seed on every rank and run)."""
        if self._order_epoch != epoch or self._order is None:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = torch.randperm(self.dataset_size, generator=gen).tolist()
            else:
                self._order = list(range(self.dataset_size))
            self._order_epoch = epoch
        return self._order

    def _epoch_end(self) -> int:
        n, b = self.dataset_size, self.global_batch_size
        return (n // b) * b if self.drop_last else self.batches_per_epoch * b

    def next_global_batch(self) -> list[int]:
        """The next global batch (all ranks' indices, rank-major) and advance the state."""
        if self.consumed >= self._epoch_end():
            self.epoch, self.consumed = self.epoch + 1, 0
        order = self.order(self.epoch)
        start = self.consumed
        idx = [order[(start + j) % self.dataset_size] for j in range(self.global_batch_size)]
        self.consumed = start + self.global_batch_size
        return idx

    def next_batch(self) -> list[int]:
        """This rank's share of the next global batch (``per_rank`` indices); advances the state the same
        way on every rank."""
        g = self.next_global_batch()
        return g[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches until the end of the current epoch (the next call continues in the next)."""
        if self.consumed >= self._epoch_end():
            self.epoch, self.consumed = self.epoch + 1, 0
        epoch = self.epoch
        while self.epoch == epoch and self.consumed < self._epoch_end():
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position (global, the same on every rank): put it in the checkpoint's
        trainer state (``CheckpointManager.save(step, {"sampler": sampler.state_dict(), ...})``)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "dataset_size": self.dataset_size,
            "fingerprint": self.fingerprint,
            "shuffle": self.shuffle,
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``. The seed, dataset size, fingerprint and shuffle flag must match
        (``CheckpointError`` naming the key otherwise: the order would differ, and "resuming" would
        repeat or skip samples); batch size and world size may differ — the next batch starts at the
        first sample not yet consumed. Nothing changes when validation fails."""
        for key in ("version", "epoch", "consumed", "seed", "dataset_size", "fingerprint", "shuffle"):
            if key not in state:
                raise CheckpointError(
                    f"sampler state has no {key!r}; it was not written by ResumableSampler.state_dict"
                )
        if state["version"] != STATE_VERSION:
            raise CheckpointError(
                f"sampler state version {state['version']!r}; this code reads {STATE_VERSION}"
            )
        for key in ("seed", "dataset_size", "fingerprint", "shuffle"):
            mine = getattr(self, key)
            if state[key] != mine:
                raise CheckpointError(
                    f"sampler state {key}={state[key]!r} but this sampler has {key}={mine!r}: the checkpoint was "
                    "taken on another dataset or seed; resuming would not continue where it stopped"
                )
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if epoch < 0 or not 0 <= consumed <= self._epoch_end() + self.global_batch_size:
            raise CheckpointError(f"sampler state epoch={epoch} consumed={consumed} is out of range")
        self.epoch, self.consumed = epoch, consumed
