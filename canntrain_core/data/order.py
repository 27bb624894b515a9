"""The order samples are drawn in, computed rather than stored: a seeded permutation of any size and a weighted
mixture of several sources, each answering "which sample is the g-th?" in O(1) time and memory.

- :class:`Permutation` is a bijection of ``[0, n)`` built from a 4-round Feistel network over the smallest
  power of four that holds ``n`` (cycle-walking brings an index that lands outside back inside). Nothing of
  size ``n`` is drawn or kept: 61 M samples cost what 61 do, where ``torch.randperm(n).tolist()`` would hold
  0.5 GB per rank.
- :class:`Mixture` interleaves sources by weight (Megatron's blends, OLMo-core's source mixtures): the
  ``j``-th sample of source ``k`` is placed at time ``(j + 1/2) / w_k``, and samples are taken in time order,
  so after any number of draws every source is within one sample of its share. The order of one period of
  ``PERIOD`` draws is computed once (a few ms); draw ``g`` is period ``g // PERIOD``, position ``g % PERIOD``.
"""

from __future__ import annotations

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a well-spread 64-bit hash of each element (uint64 in, uint64 out)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def unit_hash(values: np.ndarray, salt: int) -> np.ndarray:
    """A deterministic number in [0, 1) for each integer of ``values`` (the same on every machine)."""
    with np.errstate(over="ignore"):
        h = mix64(np.asarray(values, dtype=np.uint64) + mix64(np.array([salt], dtype=np.uint64))[0])
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class Permutation:
    """A seeded bijection of ``[0, n)``; ``perm(idx)`` maps an array of indices (see the module docstring)."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        self.half_bits = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
        self.half_mask = np.uint64((1 << self.half_bits) - 1)
        seeds = np.arange(self.ROUNDS, dtype=np.uint64) + np.uint64(seed & 0xFFFFFFFF) * np.uint64(self.ROUNDS + 1)
        self.keys = mix64(seeds ^ np.uint64(0x9E3779B97F4A7C15))

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        b = np.uint64(self.half_bits)
        left, right = x >> b, x & self.half_mask
        for key in self.keys:
            left, right = right, left ^ (mix64(right ^ key) & self.half_mask)
        return (left << b) | right

    def __call__(self, idx) -> np.ndarray:
        x = np.asarray(idx, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index {int(x.max())} out of range for a permutation of {self.n}")
        y = self._encrypt(x)
        outside = y >= np.uint64(self.n)
        while outside.any():  # cycle-walk: at most a few steps, the domain is < 4n
            y[outside] = self._encrypt(y[outside])
            outside = y >= np.uint64(self.n)
        return y.astype(np.int64)


class Mixture:
    """Draw ``g`` → (source, that source's draw number), for sources weighted ``weights`` (see the docstring)."""

    PERIOD = 1 << 16

    def __init__(self, weights: list[float]):
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or len(w) == 0 or not np.all(w > 0):
            raise ValueError(f"mixture weights must be positive, got {weights}")
        self.weights = w / w.sum()
        k = len(w)
        if k == 1:
            self.source = np.zeros(self.PERIOD, dtype=np.int16)
            self.rank = np.arange(self.PERIOD, dtype=np.int64)
        else:
            times, owners, ranks = [], [], []
            for s, ws in enumerate(self.weights):
                j = np.arange(int(np.ceil(self.PERIOD * ws)) + 1, dtype=np.int64)
                times.append((j + 0.5) / ws)
                owners.append(np.full(len(j), s, dtype=np.int16))
                ranks.append(j)
            t, o, r = np.concatenate(times), np.concatenate(owners), np.concatenate(ranks)
            order = np.lexsort((o, t))[: self.PERIOD]  # by time, ties by source
            self.source, self.rank = o[order], r[order]
        self.per_period = np.bincount(self.source, minlength=k).astype(np.int64)

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw number within that source) of each global draw ``g``."""
        g = np.asarray(g, dtype=np.int64)
        period, pos = np.divmod(g, self.PERIOD)
        src = self.source[pos].astype(np.int64)
        return src, period * self.per_period[src] + self.rank[pos]

    def counts(self, g: int) -> np.ndarray:
        """How many of the first ``g`` draws came from each source."""
        period, pos = divmod(int(g), self.PERIOD)
        return period * self.per_period + np.bincount(self.source[:pos], minlength=len(self.per_period))
