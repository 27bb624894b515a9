"""An infinite, resumable, data-parallel sampler.

Epoch e visits ``torch.randperm(num_samples)`` drawn from a generator seeded with ``seed + e``;
data-parallel rank r takes every dp_size-th index starting at r, cut to ``num_samples // dp_size``
so all ranks step in lockstep and no sample is seen twice in an epoch.

The position is advanced by the trainer, not by iteration. A DataLoader pulls indices ahead of
what the trainer has consumed (prefetch, worker queues), so counting yielded indices would save a
checkpoint that skips data. The trainer calls :meth:`ResumableSampler.advance` with the number of
samples it actually consumed; :meth:`state_dict` reports that, and a new iterator starts there.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from canntrain_core.data.cache import DataError

_STATE_KEYS = ("seed", "epoch", "position", "dp_rank", "dp_size")


class ResumableSampler(Sampler[int]):
    """Yields dataset indices forever; see the module docstring for order and state.

    It deliberately has no ``__len__``: it never ends, and a length would let a DataLoader
    pretend an epoch is a finite pass. ``samples_per_epoch`` is the per-rank epoch length.
    """

    def __init__(self, num_samples: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if num_samples < dp_size:
            raise DataError(
                f"{num_samples} training samples cannot feed {dp_size} data-parallel ranks; "
                "raise data.max_bytes or lower data.seq_length"
            )
        self.num_samples = num_samples
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.epoch = 0
        self.position = 0  # samples this rank has consumed in the current epoch

    @property
    def samples_per_epoch(self) -> int:
        """Samples each rank sees per epoch (the same on every rank)."""
        return self.num_samples // self.dp_size

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's indices for `epoch`, in order."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_samples, generator=g)
        return perm[self.dp_rank :: self.dp_size][: self.samples_per_epoch].tolist()

    def __iter__(self) -> Iterator[int]:
        # Snapshot: advancing the sampler later must not disturb an iterator already running.
        epoch, position = self.epoch, self.position
        while True:
            yield from self.epoch_indices(epoch)[position:]
            epoch, position = epoch + 1, 0

    def advance(self, n: int) -> None:
        """Record that the trainer consumed `n` more samples on this rank (rolls over epochs)."""
        if n < 0:
            raise ValueError(f"advance(n) needs n >= 0, got {n}")
        epochs, self.position = divmod(self.position + n, self.samples_per_epoch)
        self.epoch += epochs

    @property
    def consumed_samples(self) -> int:
        """Samples consumed on this rank since epoch 0."""
        return self.epoch * self.samples_per_epoch + self.position

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state; the saved seed wins so the resumed order is the original one.

        A state saved with another dp_size is converted through the global count of samples
        consumed in the current epoch. Ranks interleave (rank r holds perm[r::dp]), so the
        consumed samples are exactly perm[:position * old_dp_size] under any dp_size; the new
        position is that count // new dp_size. When it does not divide, up to dp_size - 1
        samples are seen twice in this epoch (never skipped). Ranks keep their own dp_rank.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise DataError(f"sampler state is missing {', '.join(missing)}; got keys {sorted(state)}")
        saved_n = state.get("num_samples", self.num_samples)
        if saved_n != self.num_samples:
            raise DataError(
                f"sampler state was saved for {saved_n} training samples but this dataset has "
                f"{self.num_samples}; the data (corpus, tokenizer or seq_length) changed since the checkpoint"
            )
        epoch, position, old_dp = int(state["epoch"]), int(state["position"]), int(state["dp_size"])
        if position < 0 or epoch < 0 or old_dp < 1:
            raise DataError(f"sampler state has invalid values: {state}")
        self.seed = int(state["seed"])
        self.epoch = epoch
        self.position = 0
        if old_dp == self.dp_size:
            self.advance(position)
        else:
            consumed_globally = position * old_dp
            self.advance(consumed_globally // self.dp_size)

    def __repr__(self) -> str:
        return (
            f"ResumableSampler(num_samples={self.num_samples}, seed={self.seed}, rank {self.dp_rank}/"
            f"{self.dp_size}, epoch {self.epoch}, position {self.position}/{self.samples_per_epoch})"
        )


def val_share(rows: int, n_samples: int, batch_size: int, dp_rank: int, dp_size: int, raise_what: str) -> list:
    """This data-parallel rank's share of the first ``n_samples`` of ``rows`` validation rows, as batches of
    row indices (every stage's ``val_batches`` stacks its rows by them).

    The evaluated set depends only on ``n_samples`` (rounded down to whole batches on every rank), not on the
    layout: rank r takes rows r, r + dp_size, ... So the mean over ranks of their mean losses is the loss of
    one process evaluating the same set. No rows (``data.val_fraction: 0``): no batches; fewer than one
    batch on every rank: a DataError ending with ``raise_what`` (the keys that give more).
    """
    if rows == 0:
        return []
    per_round = batch_size * dp_size
    total = min(n_samples, rows) // per_round * per_round
    if total == 0:
        raise DataError(
            f"the val split has {rows} rows, fewer than one batch on every rank ({batch_size} x {dp_size}); "
            f"{raise_what}"
        )
    mine = range(dp_rank, total, dp_size)
    return [list(mine[k : k + batch_size]) for k in range(0, len(mine), batch_size)]
