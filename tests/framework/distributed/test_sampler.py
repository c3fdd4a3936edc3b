import math

import numpy as np
import pytest

from framework.distributed.sampler import DistributedSampler

SIZES = [0, 1, 2, 3, 5, 7, 10, 16, 17, 100, 101]
REPLICAS = [1, 2, 3, 4, 8]


def shards(n, replicas, epoch=0, **kw):
    return [DistributedSampler(n, replicas, r, **kw).indices(epoch) for r in range(replicas)]


def interleave(parts):
    """Undo the rank-strided split: element i of rank r is position i * R + r."""
    return np.stack(parts, axis=1).reshape(-1) if parts[0].size else np.empty(0, np.int64)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize("n", SIZES)
def test_padding_partition(n, replicas, shuffle):
    parts = shards(n, replicas, epoch=3, shuffle=shuffle, seed=11)
    per_rank = math.ceil(n / replicas)
    for p in parts:
        assert p.dtype == np.int64
        assert p.shape == (per_rank,)
    merged = interleave(parts)
    # The padded list is the epoch's order followed by its first entries, cycled.
    order = np.random.default_rng([11, 3]).permutation(n) if shuffle else np.arange(n)
    pad = per_rank * replicas - n
    assert 0 <= pad < replicas
    expected = np.concatenate([order, np.resize(order, pad) if n else order[:0]])
    np.testing.assert_array_equal(merged, expected)
    # Every sample at least once; exactly `pad` duplicates, and they are order[:pad] cycled.
    counts = np.bincount(merged, minlength=n)
    assert (counts >= 1).all()
    assert counts.sum() - n == pad
    if n >= pad:
        assert sorted(np.flatnonzero(counts == 2)) == sorted(order[:pad].tolist())
        assert (counts <= 2).all()
    assert DistributedSampler(n, replicas, 0, shuffle=shuffle).num_padding == pad


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize("n", SIZES)
def test_drop_last_partition(n, replicas, shuffle):
    parts = shards(n, replicas, epoch=2, shuffle=shuffle, seed=5, drop_last=True)
    per_rank = n // replicas
    assert all(p.shape == (per_rank,) for p in parts)
    merged = interleave(parts)
    assert len(np.unique(merged)) == merged.size == per_rank * replicas  # no duplicates
    order = np.random.default_rng([5, 2]).permutation(n) if shuffle else np.arange(n)
    np.testing.assert_array_equal(merged, order[: per_rank * replicas])  # only the tail dropped
    assert DistributedSampler(n, replicas, 0, drop_last=True).num_padding == 0


def test_fewer_samples_than_replicas_cycles():
    parts = shards(2, 5, shuffle=False)
    assert [p.tolist() for p in parts] == [[0], [1], [0], [1], [0]]
    assert [p.tolist() for p in shards(2, 5, shuffle=False, drop_last=True)] == [[]] * 5


def test_unshuffled_is_strided_arange():
    s = DistributedSampler(10, 3, 1, shuffle=False)
    assert s.indices(0).tolist() == [1, 4, 7, 0]  # padded with 0, 1 to 12 = 4 * 3
    assert s.indices(9).tolist() == [1, 4, 7, 0]
    assert DistributedSampler(10, 3, 0, shuffle=False).indices(0).tolist() == [0, 3, 6, 9]
    assert DistributedSampler(10, 3, 2, shuffle=False).indices(0).tolist() == [2, 5, 8, 1]


def test_epoch_changes_permutation_and_is_reproducible():
    s = DistributedSampler(1000, 2, 0, seed=7)
    e0, e1 = s.indices(0), s.indices(1)
    assert not np.array_equal(e0, e1)
    np.testing.assert_array_equal(e0, DistributedSampler(1000, 2, 0, seed=7).indices(0))
    assert not np.array_equal(e0, DistributedSampler(1000, 2, 0, seed=8).indices(0))
    # Same union across ranks in both epochs (1000 divides evenly: a true partition).
    for epoch in (0, 1):
        merged = np.concatenate([p for p in shards(1000, 2, epoch=epoch, seed=7)])
        assert sorted(merged.tolist()) == list(range(1000))


def test_set_epoch_len_iter():
    s = DistributedSampler(11, 4, 3, seed=1)
    assert len(s) == 3
    assert list(s) == s.indices(0).tolist()
    s.set_epoch(5)
    assert s.epoch == 5
    assert list(s) == s.indices(5).tolist()
    np.testing.assert_array_equal(s.indices(), s.indices(5))
    assert all(type(i) is int for i in s)
    assert len(DistributedSampler(11, 4, 3, drop_last=True)) == 2


def test_numpy_integer_arguments():
    s = DistributedSampler(np.int64(10), np.int32(2), np.int64(1), seed=np.uint8(3))
    assert len(s.indices(np.int64(1))) == 5


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((10, 0, 0), {}, ValueError, "num_replicas must be >= 1"),
        ((10, -1, 0), {}, ValueError, "num_replicas must be >= 1"),
        ((10, 2, 2), {}, ValueError, r"rank must be in \[0, 1\]"),
        ((10, 2, -1), {}, ValueError, "rank must be in"),
        ((-1, 2, 0), {}, ValueError, "num_samples must be >= 0"),
        ((10, 2, 0), {"seed": -1}, ValueError, "seed must be >= 0"),
        ((10.0, 2, 0), {}, TypeError, "num_samples must be an integer"),
        ((10, 2, True), {}, TypeError, "rank must be an integer"),
    ],
)
def test_invalid_arguments(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DistributedSampler(*args, **kwargs)


def test_invalid_epoch():
    s = DistributedSampler(10, 2, 0)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        s.indices(-1)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        s.set_epoch(-2)
    with pytest.raises(TypeError, match="epoch must be an integer"):
        s.set_epoch(1.5)
