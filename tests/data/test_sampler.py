"""The order of samples: a computed permutation, weighted mixtures, and a position that resumes on any number of
data-parallel ranks (no sample of the epoch repeated or skipped) and names a changed dataset or mixture."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from canntrain_core.data import DataError, ResumableSampler
from canntrain_core.data.order import Mixture, Permutation


def take(sampler: ResumableSampler, n: int) -> list[int]:
    return list(itertools.islice(iter(sampler), n))


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4099])
def test_permutation_is_a_bijection(n):
    got = Permutation(n, seed=11)(np.arange(n))
    assert sorted(got.tolist()) == list(range(n))
    assert n < 17 or got.tolist() != list(range(n))
    assert np.array_equal(got, Permutation(n, seed=11)(np.arange(n)))  # deterministic
    assert n < 17 or not np.array_equal(got, Permutation(n, seed=12)(np.arange(n)))


def test_permutation_of_61_million_holds_nothing_of_that_size():
    p = Permutation(61_000_000, seed=3)
    idx = p(np.arange(0, 61_000_000, 1_000_003))
    assert len(set(idx.tolist())) == len(idx) and idx.max() < 61_000_000
    assert sum(a.nbytes for a in vars(p).values() if isinstance(a, np.ndarray)) < 100


def test_mixture_proportions_within_one_percent_over_10000_samples():
    for weights in ([0.7, 0.3], [0.5, 0.3, 0.2], [0.01, 0.99]):
        m = Mixture(weights)
        src, nth = m.locate(np.arange(10_000))
        counts = np.bincount(src, minlength=len(weights))
        assert np.all(np.abs(counts / 10_000 - np.asarray(weights)) < 0.01), (weights, counts)
        assert np.array_equal(counts, m.counts(10_000))
        for k in range(len(weights)):  # each source's draws are numbered 0, 1, 2, ... in order
            assert np.array_equal(nth[src == k], np.arange(counts[k]))
        # every prefix is within one sample of its share (Megatron's greedy blend has the same bound)
        for g in (1, 7, 99, 1234, 9999, 70_001):
            assert np.all(np.abs(m.counts(g) - g * np.asarray(weights)) <= 1.0 + 1e-9)


def test_state_round_trip_ignores_prefetch_and_the_seed_of_the_new_run():
    s = ResumableSampler(50, seed=3)
    it = iter(s)
    [next(it) for _ in range(23)]  # the loader pulled 23 indices ahead...
    s.advance(17)  # ...but the trainer consumed only 17
    state = s.state_dict()
    assert state["consumed_samples"] == 17 and state["seed"] == 3 and state["sizes"] == [50]
    expected = take(s, 60)  # what the original yields next, across an epoch boundary
    fresh = ResumableSampler(50, seed=999)  # the saved seed wins
    fresh.load_state_dict(torch.load(_saved(state), weights_only=True))
    assert take(fresh, 60) == expected


def _saved(state, path=None):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)  # as a checkpoint carries it
    buf.seek(0)
    return buf


def test_epochs_roll_over_with_new_orders():
    s = ResumableSampler(10, seed=0)
    first = take(s, 30)
    e0, e1, e2 = first[:10], first[10:20], first[20:]
    assert sorted(e0) == sorted(e1) == sorted(e2) == list(range(10))
    assert e0 != e1
    s.advance(25)
    assert s.epoch == 2 and take(s, 5) == e2[5:]


@pytest.mark.parametrize("before, after", [(1, 2), (2, 3), (4, 1), (3, 2)])
def test_a_run_resumed_on_another_data_parallel_size_sees_every_sample_of_the_epoch_once(before, after):
    n, batch = 103, 3
    ranks = [ResumableSampler(n, seed=5, dp_rank=r, dp_size=before) for r in range(before)]
    seen = []
    for _ in range(5):  # five steps of `batch` per rank
        for s in ranks:
            seen += take(s, batch)
        for s in ranks:
            s.advance(batch)
    state = torch.load(_saved(ranks[0].state_dict()), weights_only=True)
    resumed = [ResumableSampler(n, seed=5, dp_rank=r, dp_size=after) for r in range(after)]
    for s in resumed:
        s.load_state_dict(state)
    left = n - len(seen)
    steps = left // (batch * after)
    for _ in range(steps):
        for s in resumed:
            seen += take(s, batch)
        for s in resumed:
            s.advance(batch)
    tail = left - steps * batch * after  # the last, partial round: rank r's first draws
    for r, s in enumerate(resumed):
        seen += take(s, batch)[: max(0, min(batch, (tail - r + after - 1) // after))]
    assert sorted(seen) == list(range(n))  # no sample repeated, none skipped
    # and the order is the one-process order: the job draws one global stream
    single = ResumableSampler(n, seed=5)
    assert set(seen[: 5 * batch * before]) == set(take(single, 5 * batch * before))


def test_a_mixture_draws_by_weight_each_source_on_its_own_epochs():
    s = ResumableSampler([40, 1000], seed=1, weights=[0.5, 0.5], sources=[("small", "a"), ("big", "b")])
    idx = np.asarray(take(s, 200))
    small, big = idx[idx < 40], idx[idx >= 40] - 40
    assert len(small) == len(big) == 100
    assert sorted(small[:40].tolist()) == list(range(40))  # the small source's first epoch...
    assert small[:40].tolist() != small[40:80].tolist()  # ...and its second, in another order
    assert len(set(big.tolist())) == 100  # the big one is not repeated
    s.advance(200)
    assert s.consumed_per_source() == [100, 100]
    assert s.epochs_per_source(200) == [2.5, 0.1]


def test_a_changed_dataset_or_mixture_is_named_on_resume():
    s = ResumableSampler([40, 60], seed=1, weights=[0.7, 0.3], sources=[("web", "f1"), ("code", "f2")])
    s.advance(10)
    state = s.state_dict()
    with pytest.raises(DataError, match=r"data source code changed since the checkpoint \(fingerprint f2 -> f3\)"):
        ResumableSampler([40, 60], seed=1, weights=[0.7, 0.3], sources=[("web", "f1"), ("code", "f3")]).load_state_dict(
            state
        )
    with pytest.raises(DataError, match=r"mixture weights \[0\.7, 0\.3\] differ"):
        ResumableSampler([40, 60], seed=1, weights=[0.5, 0.5], sources=[("web", "f1"), ("code", "f2")]).load_state_dict(
            state
        )
    with pytest.raises(DataError, match=r"saved for \[40, 60\] training samples per source"):
        ResumableSampler([40, 61], seed=1, weights=[0.7, 0.3]).load_state_dict(state)
    with pytest.raises(DataError, match=r"cannot feed 4 data-parallel ranks"):
        ResumableSampler(3, seed=0, dp_rank=0, dp_size=4)
