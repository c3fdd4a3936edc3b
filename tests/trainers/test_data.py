"""Tests for trainers.data: data sets, samplers and the resumable DataLoader."""

import numpy as np
import pytest

from trainers.data import ArrayDataset, DataLoader, RandomSampler, load_dataset

SMALL_IMAGES = dict(num_train=500, num_test=200)
SMALL_REGRESSION = dict(num_train=300, num_test=100)


# ------------------------------------------------------------------ data sets


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


def test_module_imports_no_framework_or_torch():
    import trainers.data

    code = trainers.data.__spec__.loader.get_source("trainers.data")
    for banned in ("import framework", "from framework", "import models", "from models", "torch"):
        assert banned not in code


def test_digits_shapes_dtypes_and_split(digits):
    train, test = digits
    assert isinstance(train, ArrayDataset)
    assert train.x.dtype == np.float32 and test.x.dtype == np.float32
    assert train.y.dtype == np.int64 and test.y.dtype == np.int64
    assert train.x.shape[1:] == (1, 8, 8) and test.x.shape[1:] == (1, 8, 8)
    assert train.input_shape == (1, 8, 8)
    assert train.num_classes == 10 and test.num_classes == 10
    assert len(train) + len(test) == 1797
    assert abs(len(test) / 1797 - 0.2) < 0.01
    # Stratified: every class on both sides, in about the overall proportions.
    train_counts = np.bincount(train.y, minlength=10)
    test_counts = np.bincount(test.y, minlength=10)
    assert (train_counts > 0).all() and (test_counts > 0).all()
    frac = test_counts / (train_counts + test_counts)
    assert np.all(np.abs(frac - 0.2) < 0.02)


def test_digits_standardized_with_train_statistics(digits):
    train, test = digits
    assert abs(float(train.x.mean())) < 1e-4
    assert abs(float(train.x.std()) - 1.0) < 1e-4
    # The test set uses the train statistics, so it is only roughly standardized.
    assert abs(float(test.x.mean())) < 0.1
    assert abs(float(test.x.std()) - 1.0) < 0.1


def test_digits_test_fraction_and_seed():
    a_train, a_test = load_dataset("digits", seed=1, test_fraction=0.5)
    assert abs(len(a_test) - 1797 / 2) < 10
    b_train, b_test = load_dataset("digits", seed=1, test_fraction=0.5)
    np.testing.assert_array_equal(a_train.x, b_train.x)
    np.testing.assert_array_equal(a_test.y, b_test.y)
    c_train, _ = load_dataset("digits", seed=2, test_fraction=0.5)
    assert not np.array_equal(a_train.y, c_train.y)


def test_synthetic_images_shapes_and_defaults():
    train, test = load_dataset("synthetic_images", seed=0, **SMALL_IMAGES)
    assert train.x.shape == (500, 3, 32, 32) and test.x.shape == (200, 3, 32, 32)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64
    assert train.y.shape == (500,) and train.num_classes == 10
    assert train.input_shape == (3, 32, 32)
    counts = np.bincount(train.y, minlength=10)
    assert counts.min() >= 45 and counts.max() <= 55  # balanced
    custom, _ = load_dataset(
        "synthetic_images", num_train=7, num_test=3, image_size=5, channels=1, num_classes=3, noise=0.0
    )
    assert custom.x.shape == (7, 1, 5, 5) and custom.num_classes == 3
    assert set(custom.y.tolist()) <= {0, 1, 2}


def test_synthetic_images_determinism():
    a = load_dataset("synthetic_images", seed=3, **SMALL_IMAGES)
    b = load_dataset("synthetic_images", seed=3, **SMALL_IMAGES)
    c = load_dataset("synthetic_images", seed=4, **SMALL_IMAGES)
    for s, t in zip(a, b):
        np.testing.assert_array_equal(s.x, t.x)
        np.testing.assert_array_equal(s.y, t.y)
    assert not np.array_equal(a[0].x, c[0].x)
    # Train and test are different draws.
    assert not np.array_equal(a[0].x[:200], a[1].x)


def test_synthetic_images_same_templates_train_and_test():
    # noise=0: every sample is exactly its class template, shared by train and test.
    train, test = load_dataset("synthetic_images", seed=0, num_train=50, num_test=50, noise=0.0)
    for c in range(10):
        tr, te = train.x[train.y == c], test.x[test.y == c]
        np.testing.assert_array_equal(tr, np.broadcast_to(tr[0], tr.shape))
        np.testing.assert_array_equal(te[0], tr[0])


def test_synthetic_images_are_learnable():
    train, test = load_dataset("synthetic_images", seed=0, num_train=2000, num_test=500, noise=1.0)
    flat = train.x.reshape(len(train), -1)
    means = np.stack([flat[train.y == c].mean(axis=0) for c in range(10)])
    tflat = test.x.reshape(len(test), -1)
    dist = ((tflat[:, None, :] - means[None]) ** 2).sum(-1)
    accuracy = (dist.argmin(1) == test.y).mean()
    assert accuracy > 0.9  # chance is 0.1


def test_synthetic_images_templates_are_smooth():
    train, _ = load_dataset("synthetic_images", seed=0, num_train=20, num_test=1, noise=0.0)
    x = train.x
    neighbour_diff = np.abs(np.diff(x, axis=-1)).mean()
    assert neighbour_diff < 0.3 * np.abs(x).mean()


def test_synthetic_images_make_10k():
    # No time bound here: on a shared 2-core machine it measured 0.8 s alone and 1.9 s
    # under load, so a bound either flakes or proves nothing (speed lives in benchmarks/).
    train, _ = load_dataset("synthetic_images", num_train=10000, num_test=1)
    assert train.x.shape == (10000, 3, 32, 32) and train.x.dtype == np.float32
    assert np.isfinite(train.x).all()
    assert train.y.shape == (10000,) and set(np.unique(train.y)) <= set(range(train.num_classes))


def test_synthetic_regression():
    train, test = load_dataset(
        "synthetic_regression", seed=0, **SMALL_REGRESSION, in_features=8, out_features=2, noise=0.05
    )
    assert train.x.shape == (300, 8) and train.y.shape == (300, 2)
    assert test.x.shape == (100, 8) and test.y.shape == (100, 2)
    assert train.x.dtype == np.float32 and train.y.dtype == np.float32
    assert train.num_classes is None and train.input_shape == (8,)
    # A least-squares fit on train recovers the linear map: residual ~ noise on test.
    xa = np.hstack([train.x, np.ones((300, 1), np.float32)])
    coef, *_ = np.linalg.lstsq(xa, train.y, rcond=None)
    pred = np.hstack([test.x, np.ones((100, 1), np.float32)]) @ coef
    residual_std = float((pred - test.y).std())
    assert 0.03 < residual_std < 0.08
    # Determinism and shared W, b between train and test (checked by the fit above).
    again, _ = load_dataset(
        "synthetic_regression", seed=0, **SMALL_REGRESSION, in_features=8, out_features=2, noise=0.05
    )
    np.testing.assert_array_equal(train.y, again.y)
    other, _ = load_dataset(
        "synthetic_regression", seed=1, **SMALL_REGRESSION, in_features=8, out_features=2, noise=0.05
    )
    assert not np.array_equal(train.y, other.y)


def test_default_regression_shapes():
    train, test = load_dataset("synthetic_regression", **SMALL_REGRESSION)
    assert train.x.shape == (300, 32) and train.y.shape == (300, 1)


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("imagenet", {}, "valid names: cifar10, cifar100, digits, npz, synthetic_images, synthetic_regression"),
        ("digits", {"num_train": 10}, "unknown option.*num_train.*valid options"),
        ("digits", {"test_fraction": 1.0}, "test_fraction"),
        ("digits", {"test_fraction": 0}, "test_fraction"),
        ("synthetic_images", {"num_train": 0}, "num_train"),
        ("synthetic_images", {"num_train": 2.5}, "num_train"),
        ("synthetic_images", {"noise": -1.0}, "noise"),
        ("synthetic_images", {"num_classes": 1}, "num_classes"),
        ("synthetic_images", {"image_sz": 8}, "image_sz.*image_size"),
        ("synthetic_regression", {"in_features": True}, "in_features"),
        ("synthetic_regression", {"seed": -1}, "seed"),
    ],
)
def test_load_dataset_errors(name, options, match):
    with pytest.raises(ValueError, match=match):
        load_dataset(name, **options)


def test_array_dataset_validation():
    with pytest.raises(ValueError, match="same number of samples"):
        ArrayDataset(np.zeros((3, 2)), np.zeros(4))
    with pytest.raises(TypeError):
        ArrayDataset([1, 2], np.zeros(2))
    ds = ArrayDataset(np.arange(10.0).reshape(5, 2), np.arange(5))
    x, y = ds[np.array([4, 0])]
    np.testing.assert_array_equal(y, [4, 0])
    assert ds.num_classes is None and len(ds) == 5


# ------------------------------------------------------------------ sampler and loader


def _indexed(n, features=3):
    """A data set whose x rows encode their sample index, for coverage checks."""
    x = np.repeat(np.arange(n, dtype=np.float32)[:, None], features, axis=1)
    return ArrayDataset(x, np.arange(n, dtype=np.int64))


def _epoch_labels(loader):
    return [y.copy() for _, y in loader]


def test_random_sampler():
    s = RandomSampler(10, seed=5)
    a, b = s.indices(0), s.indices(1)
    assert a.dtype == np.int64 and sorted(a.tolist()) == list(range(10))
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, RandomSampler(10, seed=5).indices(0))
    assert not np.array_equal(a, RandomSampler(10, seed=6).indices(0))
    np.testing.assert_array_equal(RandomSampler(4, shuffle=False).indices(3), np.arange(4))
    assert len(s) == 10


@pytest.mark.parametrize(
    "n, bs, drop_last", [(10, 3, False), (10, 3, True), (12, 4, False), (12, 4, True), (7, 10, False), (1, 1, True)]
)
def test_loader_covers_each_sample_once(n, bs, drop_last):
    loader = DataLoader(_indexed(n), bs, drop_last=drop_last, seed=1)
    expected_batches = n // bs if drop_last else -(-n // bs)
    assert len(loader) == expected_batches
    for epoch in range(2):
        assert loader.epoch == epoch
        batches = list(loader)
        assert len(batches) == expected_batches
        for x, y in batches:
            assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
            np.testing.assert_array_equal(x[:, 0], y.astype(np.float32))  # x, y aligned
        sizes = [len(y) for _, y in batches]
        assert all(s == bs for s in sizes[:-1]) and 0 < sizes[-1] <= bs
        seen = np.concatenate([y for _, y in batches])
        assert len(np.unique(seen)) == len(seen)
        if drop_last:
            assert len(seen) == expected_batches * bs
        else:
            assert sorted(seen.tolist()) == list(range(n))


def test_loader_shuffles_per_epoch_reproducibly():
    ds = _indexed(50)
    a = DataLoader(ds, 8, seed=3)
    b = DataLoader(ds, 8, seed=3)
    a0, a1 = np.concatenate(_epoch_labels(a)), np.concatenate(_epoch_labels(a))
    b0, b1 = np.concatenate(_epoch_labels(b)), np.concatenate(_epoch_labels(b))
    assert not np.array_equal(a0, a1)
    np.testing.assert_array_equal(a0, b0)
    np.testing.assert_array_equal(a1, b1)
    c0 = np.concatenate(_epoch_labels(DataLoader(ds, 8, seed=4)))
    assert not np.array_equal(a0, c0)
    plain = np.concatenate(_epoch_labels(DataLoader(ds, 8, shuffle=False)))
    np.testing.assert_array_equal(plain, np.arange(50))


def test_loader_batches_are_copies():
    ds = _indexed(6)
    x, _ = next(iter(DataLoader(ds, 6, shuffle=False)))
    x += 100
    assert ds.x.max() == 5


def test_set_epoch():
    ds = _indexed(20)
    ref = DataLoader(ds, 6, seed=2)
    epochs = [_epoch_labels(ref) for _ in range(3)]
    loader = DataLoader(ds, 6, seed=2)
    loader.set_epoch(2)
    assert loader.state_dict() == {"epoch": 2, "batch": 0}
    got = _epoch_labels(loader)
    assert all(np.array_equal(g, e) for g, e in zip(got, epochs[2]))
    assert loader.epoch == 3
    # set_epoch of the epoch the loader is in keeps a mid-epoch position (resume-safe).
    loader.load_state_dict({"epoch": 1, "batch": 2})
    loader.set_epoch(1)
    assert loader.state_dict() == {"epoch": 1, "batch": 2}
    loader.set_epoch(0)
    assert loader.state_dict() == {"epoch": 0, "batch": 0}


def _sequence(loader, num_epochs):
    out = []
    for _ in range(num_epochs):
        out.extend((x.copy(), y.copy()) for x, y in loader)
    return out


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 5, 9])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_mid_epoch_matches_uninterrupted(stop_after, drop_last):
    ds = _indexed(23)
    kwargs = dict(batch_size=5, seed=7, drop_last=drop_last)
    reference = _sequence(DataLoader(ds, **kwargs), 3)
    per_epoch = len(DataLoader(ds, **kwargs))

    first = DataLoader(ds, **kwargs)
    taken = []
    it = iter(first)
    while len(taken) < stop_after:
        try:
            x, y = next(it)
        except StopIteration:  # epoch boundary: the loop would start the next epoch
            it = iter(first)
            continue
        taken.append((x.copy(), y.copy()))
    state = first.state_dict()
    assert state == {"epoch": stop_after // per_epoch, "batch": stop_after % per_epoch}

    resumed = DataLoader(ds, **kwargs)
    resumed.load_state_dict(dict(state))
    rest = _sequence(resumed, 3 - state["epoch"])  # rest of this epoch, then full ones
    combined = taken + rest
    assert len(combined) == len(reference)
    for (xa, ya), (xb, yb) in zip(combined, reference):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)


def test_break_keeps_position_and_next_iter_resumes():
    ds = _indexed(17)
    reference = [y for _, y in DataLoader(ds, 4, seed=1)]
    loader = DataLoader(ds, 4, seed=1)
    got = []
    for _, y in loader:
        got.append(y)
        if len(got) == 2:
            break
    assert loader.state_dict() == {"epoch": 0, "batch": 2}
    got.extend(y for _, y in loader)
    assert len(got) == len(reference)
    assert all(np.array_equal(a, b) for a, b in zip(got, reference))
    assert loader.state_dict() == {"epoch": 1, "batch": 0}


def test_state_after_last_batch_names_next_epoch():
    loader = DataLoader(_indexed(8), 4)
    it = iter(loader)
    next(it)
    next(it)  # last batch of epoch 0, generator not resumed yet
    assert loader.state_dict() == {"epoch": 1, "batch": 0}
    # A finished epoch saved as batch == len normalizes to the next epoch.
    loader.load_state_dict({"epoch": 4, "batch": 2})
    assert loader.state_dict() == {"epoch": 5, "batch": 0}


def test_load_state_dict_makes_old_iterator_stale():
    loader = DataLoader(_indexed(20), 5)
    it = iter(loader)
    next(it)
    loader.load_state_dict({"epoch": 3, "batch": 1})
    assert list(it) == []
    assert loader.state_dict() == {"epoch": 3, "batch": 1}


class _ShardSampler:
    """Stand-in for DistributedSampler: every other index of a seeded permutation."""

    def __init__(self, n, rank, world):
        self.n, self.rank, self.world = n, rank, world

    def indices(self, epoch):
        return np.random.default_rng([0, epoch]).permutation(self.n)[self.rank :: self.world]


def test_loader_with_custom_sampler():
    ds = _indexed(11)
    shards = [DataLoader(ds, 2, sampler=_ShardSampler(11, r, 2)) for r in range(2)]
    assert [len(s) for s in shards] == [3, 3]
    seen = np.concatenate([y for s in shards for _, y in s])
    assert sorted(seen.tolist()) == list(range(11))


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda ds: DataLoader(ds, 0), ValueError, "batch_size"),
        (lambda ds: DataLoader(ds, 2.0), ValueError, "batch_size"),
        (lambda ds: DataLoader(ds, 11, drop_last=True), ValueError, "no batches"),
        (lambda ds: DataLoader(ds, 2, sampler=RandomSampler(11)), ValueError, "10 samples"),
        (lambda ds: DataLoader(ds, 2, sampler=object()), TypeError, "indices"),
        (lambda ds: RandomSampler(-1), ValueError, "num_samples"),
    ],
)
def test_loader_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make(_indexed(10))


def test_load_state_dict_errors():
    loader = DataLoader(_indexed(10), 3)
    with pytest.raises(ValueError, match="past the end"):
        loader.load_state_dict({"epoch": 0, "batch": 5})
    with pytest.raises(ValueError, match="keys"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="epoch"):
        loader.load_state_dict({"epoch": -1, "batch": 0})
    with pytest.raises(ValueError, match="epoch"):
        loader.set_epoch(-2)
