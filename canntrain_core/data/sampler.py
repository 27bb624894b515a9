"""An infinite, resumable, data-parallel sampler over one source or a weighted mixture of several.

The job draws one global stream of samples. Draw ``g`` comes from source ``k`` as that source's draw number
``s`` (``data.order.Mixture``: sources interleaved by weight); source ``k`` with ``n_k`` samples serves its
draw ``s`` as sample ``Permutation(n_k, seed of (k, s // n_k))(s % n_k)`` of its epoch ``s // n_k``. Data-parallel
rank ``r`` of ``dp`` takes draws ``consumed + r``, ``consumed + r + dp``, ... So:

- the position is one number, the draws consumed by the whole job (plus the seed and the sources' sizes
  and weights, which a resume checks). A run resumed on another data-parallel size goes on from the same
  draw: nothing of the epoch is repeated or skipped, whatever the sizes divide;
- nothing of the size of a source is drawn or held; each index costs O(1);
- tokens consumed per source are a closed form of the position (:meth:`ResumableSampler.consumed_per_source`).

The position is advanced by the trainer, not by iteration. A DataLoader pulls indices ahead of what the trainer
has consumed (prefetch, worker queues), so counting yielded indices would save a checkpoint that skips data. The
trainer calls :meth:`ResumableSampler.advance` with the samples this rank consumed; :meth:`state_dict` reports
the job's position, and a new iterator starts there.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from canntrain_core.data.cache import DataError
from canntrain_core.data.order import Mixture, Permutation, mix64

_BLOCK = 4096  # indices computed at a time by an iterator


class ResumableSampler(Sampler[int]):
    """Yields indices into the concatenation of the sources forever; see the module docstring.

    ``sizes``: samples per source (an int for one source); ``weights``: the mixture (None: one source, or
    proportional to the sizes); ``sources``: each source's (name, fingerprint), which a resume checks.
    It has no ``__len__``: it never ends, and a length would let a DataLoader
    pretend an epoch is a finite pass. ``samples_per_epoch`` is one pass's draws per rank.
    """

    def __init__(
        self,
        sizes: int | Sequence[int],
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        weights: Sequence[float] | None = None,
        sources: Sequence[tuple[str, str]] | None = None,
    ):
        sizes = [sizes] if isinstance(sizes, int) else [int(n) for n in sizes]
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if min(sizes) < 1 or sum(sizes) < dp_size:
            raise DataError(
                f"{sum(sizes)} training samples ({', '.join(map(str, sizes))} per source) cannot feed {dp_size} "
                "data-parallel ranks; raise data.max_bytes, give more data or lower data.seq_length"
            )
        self.sizes = sizes
        self.weights = [float(w) for w in weights] if weights is not None else [float(n) for n in sizes]
        if len(self.weights) != len(sizes):
            raise ValueError(f"{len(self.weights)} weights for {len(sizes)} sources")
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.mixture = Mixture(self.weights)
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed = 0  # draws of the whole job so far
        self.sources = [list(x) for x in sources] if sources is not None else None
        self._perms: dict[tuple[int, int], Permutation] = {}

    # ------------------------------------------------------------------ where we are
    @property
    def num_samples(self) -> int:
        return sum(self.sizes)

    @property
    def samples_per_epoch(self) -> int:
        """Draws each rank makes in one pass over the sources (the same on every rank)."""
        return self.num_samples // self.dp_size

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    def consumed_per_source(self) -> list[int]:
        """Samples drawn from each source by the whole job so far."""
        return [int(c) for c in self.mixture.counts(self.consumed)]

    def epochs_per_source(self, draws: int) -> list[float]:
        """Passes over each source that ``draws`` draws of the job make."""
        return [c / n for c, n in zip(self.mixture.counts(draws), self.sizes)]

    def limit(self, n: int) -> None:
        """Draw only from the first ``n`` samples of the first source (``canntrain overfit``: its first rows,
        drawn again and again)."""
        self.sizes, self.weights = [max(1, min(n, self.sizes[0]))], [1.0]
        self.offsets, self.mixture, self._perms = np.zeros(1, dtype=np.int64), Mixture([1.0]), {}

    # ------------------------------------------------------------------ which sample
    def _perm(self, source: int, epoch: int) -> Permutation:
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) > 64:
                self._perms.clear()
            salt = mix64(np.array([self.seed, source * 1_000_003 + epoch], dtype=np.uint64))
            self._perms[key] = Permutation(self.sizes[source], int(salt[0] ^ salt[1]) & 0xFFFFFFFF)
        return self._perms[key]

    def indices(self, draws: np.ndarray) -> np.ndarray:
        """Dataset index (into the sources' concatenation) of each global draw."""
        src, s = self.mixture.locate(draws)
        sizes = np.asarray(self.sizes, dtype=np.int64)[src]
        epoch, within = np.divmod(s, sizes)
        out = np.empty(len(draws), dtype=np.int64)
        for k, e in set(zip(src.tolist(), epoch.tolist())):
            sel = (src == k) & (epoch == e)
            out[sel] = self.offsets[k] + self._perm(k, e)(within[sel])
        return out

    def __iter__(self) -> Iterator[int]:
        # Snapshot: advancing the sampler later must not disturb an iterator already running.
        g = self.consumed + self.dp_rank
        block = max(1, min(_BLOCK, self.samples_per_epoch))  # a block spans an epoch at most
        while True:
            draws = g + self.dp_size * np.arange(block, dtype=np.int64)
            yield from self.indices(draws).tolist()
            g += self.dp_size * block

    def advance(self, n: int) -> None:
        """Record that this rank consumed ``n`` more samples (every rank consumes the same number per step)."""
        if n < 0:
            raise ValueError(f"advance(n) needs n >= 0, got {n}")
        self.consumed += n * self.dp_size

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "consumed_samples": self.consumed,
            "sizes": list(self.sizes),
            "weights": list(self.weights),
            "dp_size": self.dp_size,
            **({"sources": self.sources} if self.sources is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state on any data-parallel size; the saved seed wins so the resumed order is the
        original one. Other sources (sizes) or another mixture (weights) than the checkpoint's is drift."""
        if "consumed_samples" not in state:
            raise DataError(
                f"sampler state has no consumed_samples (keys {sorted(state)}): a checkpoint from before the "
                "global data position; resume it with the canntrain that wrote it"
            )
        sizes, weights = list(state.get("sizes", self.sizes)), list(state.get("weights", self.weights))
        if sizes != self.sizes:
            raise DataError(
                f"the checkpoint was saved for {sizes} training samples per source but the data now has "
                f"{self.sizes}; the data (sources, tokenizer or seq_length) changed since the checkpoint"
            )
        if not np.allclose(np.asarray(weights) / sum(weights), self.mixture.weights):
            raise DataError(
                f"the checkpoint's mixture weights {weights} differ from data.sources' {self.weights}: a changed "
                "mixture would draw other samples; keep the weights, or start a new run from its weights"
            )
        saved = state.get("sources")
        if saved is not None and self.sources is not None:
            for k, ((name, was), (_, now)) in enumerate(zip(saved, self.sources)):
                if was != now:
                    raise DataError(
                        f"data source {name} changed since the checkpoint (fingerprint {was[:12]} -> {now[:12]}): "
                        "its samples are other tokens now; resume with the data it was trained on"
                    )
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise DataError(f"sampler state has invalid values: {state}")
        self.seed = int(state["seed"])
        self._perms = {}
        self.consumed = consumed

    def __repr__(self) -> str:
        return (
            f"ResumableSampler(sizes={self.sizes}, seed={self.seed}, rank {self.dp_rank}/{self.dp_size}, "
            f"consumed {self.consumed} (epoch {self.epoch}))"
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


def train_loader(dataset: Dataset, sampler: ResumableSampler, cfg) -> DataLoader:
    """Every stage's training loader: ``data.batch_size`` rows at a time in ``sampler``'s order, forever, with
    ``data.num_workers`` worker processes (``data.persistent_workers``). The sampler is not advanced by
    iteration: the trainer calls ``sampler.advance(batch_size)`` after each consumed micro-batch, so a checkpoint
    records what was trained on, not what was prefetched. Each iterator draws its workers' base seed from a
    generator of its own, not from torch's global one: a resumed run creates its iterator after restoring that state,
    and the draw shifted LoRA's dropout masks from the uninterrupted run's."""
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.persistent_workers,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )
