"""A user's own data: npz (a .npz or a .npy pair), CIFAR-10/100's binary version, augmentation.

Every file is generated here (tests/data_files.py); none is shipped or downloaded.
"""

import os
import pickle

import numpy as np
import pytest

from tests.data_files import cifar_record_bytes, classification_arrays, write_cifar
from trainers.config import SCHEMA
from trainers.data import DATASETS, DataError, DataLoader, RandomCropFlip, load_dataset


def test_the_config_offers_every_data_set_of_the_registry():
    assert set(SCHEMA["data"]["name"].choices) == set(DATASETS)


# ------------------------------------------------------------------ npz


@pytest.fixture
def arrays():
    return classification_arrays(n=90, features=(2, 3, 3), classes=3)


def test_a_npz_file_is_split_stratified_and_seeded(tmp_path, arrays):
    x, y = arrays
    np.savez(tmp_path / "d.npz", x=x, y=y)
    train, test = load_dataset("npz", seed=4, root=str(tmp_path / "d.npz"), test_fraction=0.2)
    assert (len(train), len(test)) == (72, 18) and train.num_classes == test.num_classes == 3
    assert train.input_shape == (2, 3, 3) and train.target_shape == ()
    assert np.bincount(test[np.arange(len(test))][1]).tolist() == [6, 6, 6]  # stratified
    rows = np.concatenate([train.rows, test.rows])
    assert sorted(rows.tolist()) == list(range(90))  # each sample on one side, once
    xb, yb = train[np.arange(5)]
    assert xb.dtype == np.float32 and xb.flags.writeable
    np.testing.assert_array_equal(xb, x[train.rows[:5]])
    np.testing.assert_array_equal(yb, y[train.rows[:5]])
    again, _ = load_dataset("npz", seed=4, root=str(tmp_path / "d.npz"))
    np.testing.assert_array_equal(again.rows, train.rows)
    other, _ = load_dataset("npz", seed=5, root=str(tmp_path / "d.npz"))
    assert not np.array_equal(other.rows, train.rows)


def test_a_folder_of_npy_files_is_memory_mapped_and_batches_are_float32_copies(tmp_path, arrays):
    x, y = arrays
    for folder, (xs, ys) in {"train": (x[:60], y[:60]), "test": (x[60:], y[60:])}.items():
        os.makedirs(tmp_path / folder)
        np.save(tmp_path / folder / "images.npy", xs.astype(np.float16))
        np.save(tmp_path / folder / "labels.npy", ys.astype(np.uint8))
    train, test = load_dataset(
        "npz", root=str(tmp_path / "train"), test_root=str(tmp_path / "test"), x_name="images", y_name="labels"
    )
    assert isinstance(train.x, np.memmap) and not train.x.flags.writeable  # read from the file on demand
    assert train.y.dtype == np.int64 and (len(train), len(test)) == (60, 30) and train.rows is None
    xb, _ = test[0:4]
    assert xb.dtype == np.float32 and xb.flags.writeable and not isinstance(xb, np.memmap)
    np.testing.assert_array_equal(xb, x[60:64].astype(np.float16).astype(np.float32))


def test_float_targets_are_regression(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "r.npz", x=rng.standard_normal((20, 5)), y=rng.standard_normal(20))
    train, test = load_dataset("npz", root=str(tmp_path / "r.npz"))
    assert train.num_classes is None and train.target_shape == (1,) and train.y.dtype == np.float32
    assert len(train) + len(test) == 20


def write_truncated(path, array):
    np.save(path, array)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])


@pytest.mark.parametrize(
    "make, fragments",
    [
        (lambda d, x, y: d / "missing.npz", ["missing.npz does not exist"]),
        (lambda d, x, y: (np.save(d / "x.npy", x), d / "x.npy")[1], ["one .npy file", "folder"]),
        (lambda d, x, y: (np.savez(d / "a.npz", inputs=x, y=y), d / "a.npz")[1], ["no array 'x'", "inputs, y"]),
        (lambda d, x, y: (np.savez(d / "a.npz", x=x[:, 0, 0, 0], y=y), d / "a.npz")[1], ["(samples, features...)"]),
        (
            lambda d, x, y: (np.savez(d / "a.npz", x=x, y=y[:-1]), d / "a.npz")[1],
            ["same number of samples", "90", "89"],
        ),
        (
            lambda d, x, y: (np.savez(d / "a.npz", x=x, y=y - 1), d / "a.npz")[1],
            ["label -1 of sample 0", "out of range"],
        ),
        (lambda d, x, y: (np.savez(d / "a.npz", x=x, y=y.astype(str)), d / "a.npz")[1], ["targets must be", "<U"]),
        (lambda d, x, y: (np.savez(d / "a.npz", x=x.astype(str), y=y), d / "a.npz")[1], ["inputs must be a numeric"]),
        (lambda d, x, y: (np.savez(d / "a.npz", x=x, y=y * 0), d / "a.npz")[1], ["every label is 0"]),
    ],
)
def test_bad_npz_data_is_one_line_naming_the_file(tmp_path, arrays, make, fragments):
    path = make(tmp_path, *arrays)
    with pytest.raises(DataError) as info:
        load_dataset("npz", root=str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith("data")
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_cut_short_files_and_pickles_are_refused_and_run_nothing(tmp_path, arrays):
    x, y = arrays
    os.makedirs(tmp_path / "cut")
    write_truncated(tmp_path / "cut" / "x.npy", x)
    np.save(tmp_path / "cut" / "y.npy", y)
    with pytest.raises(DataError, match=r"cut/x.npy: it is cut short \(.* bytes"):
        load_dataset("npz", root=str(tmp_path / "cut"))
    np.savez(tmp_path / "whole.npz", x=x, y=y)
    data = (tmp_path / "whole.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="cannot read .*cut.npz"):
        load_dataset("npz", root=str(tmp_path / "cut.npz"))

    marker = tmp_path / "code_ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    os.makedirs(tmp_path / "evil")
    np.save(tmp_path / "evil" / "x.npy", np.array([Evil()] * 4, dtype=object), allow_pickle=True)
    np.save(tmp_path / "evil" / "y.npy", np.arange(4))
    (tmp_path / "evil.npz").write_bytes(pickle.dumps({"x": Evil()}))
    for root in ("evil", "evil.npz"):
        with pytest.raises(DataError, match="Python objects .* not read"):
            load_dataset("npz", root=str(tmp_path / root))
    assert not marker.exists()


def test_a_test_set_of_another_shape_is_refused(tmp_path, arrays):
    x, y = arrays
    np.savez(tmp_path / "train.npz", x=x, y=y)
    np.savez(tmp_path / "test.npz", x=x[:, :1], y=y)
    with pytest.raises(DataError, match="test.npz: samples of shape \\(1, 3, 3\\)"):
        load_dataset("npz", root=str(tmp_path / "train.npz"), test_root=str(tmp_path / "test.npz"))


# ------------------------------------------------------------------ CIFAR


@pytest.fixture(scope="module")
def cifar10(tmp_path_factory):
    return write_cifar(tmp_path_factory.mktemp("data"), "cifar10")


def test_cifar10_reads_the_documented_layout_and_normalizes_per_channel(cifar10):
    train, test = load_dataset("cifar10", root=cifar10)
    assert (len(train), len(test), train.num_classes, train.input_shape) == (50000, 10000, 10, (3, 32, 32))
    raw = np.fromfile(os.path.join(cifar10, "data_batch_2.bin"), dtype=np.uint8)[: 3 * cifar_record_bytes("cifar10")]
    records = raw.reshape(3, -1)
    xb, yb = train[np.arange(10000, 10003)]  # the first records of the second file
    assert yb.tolist() == records[:, 0].tolist() == [0, 1, 2]
    pixels = records[:, 1:].reshape(3, 3, 32, 32)  # red, green, blue planes, row by row
    mean = np.array([0.4914, 0.4822, 0.4465], np.float32)[:, None, None]
    std = np.array([0.2470, 0.2435, 0.2616], np.float32)[:, None, None]
    np.testing.assert_allclose(xb, (pixels / np.float32(255) - mean) / std, rtol=1e-6, atol=1e-6)
    assert xb.dtype == np.float32
    xt, _ = test[0:2]
    assert xt.shape == (2, 3, 32, 32)


def test_cifar_root_may_be_the_folder_of_the_files_or_the_one_above(cifar10):
    a, _ = load_dataset("cifar10", root=cifar10)
    b, _ = load_dataset("cifar10", root=os.path.dirname(cifar10))
    np.testing.assert_array_equal(a[np.arange(4)][0], b[np.arange(4)][0])


def test_cifar100_fine_and_coarse_labels(tmp_path):
    root = write_cifar(tmp_path, "cifar100", filled=120)
    fine, _ = load_dataset("cifar100", root=root)
    coarse, test = load_dataset("cifar100", root=str(tmp_path), labels="coarse")
    assert (fine.num_classes, coarse.num_classes, len(fine), len(test)) == (100, 20, 50000, 10000)
    assert fine.y[:120].tolist() == [i % 100 for i in range(120)]
    assert coarse.y[:120].tolist() == [i % 20 for i in range(120)]


def cifar_error(root, name="cifar10") -> str:
    with pytest.raises(DataError) as info:
        load_dataset(name, root=str(root))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_bad_cifar_folders_are_one_line_naming_the_file(tmp_path):
    assert "is not a folder" in cifar_error(tmp_path / "nowhere")
    os.makedirs(tmp_path / "empty")
    assert "holds neither data_batch_1.bin nor cifar-10-batches-bin/data_batch_1.bin" in cifar_error(tmp_path / "empty")
    os.makedirs(tmp_path / "py")
    (tmp_path / "py" / "data_batch_1").write_bytes(b"\x80\x04")  # the Python version: pickles
    assert "Python version" in cifar_error(tmp_path / "py")

    root = write_cifar(tmp_path / "a", "cifar10", filled=4)
    os.unlink(os.path.join(root, "data_batch_4.bin"))
    assert "has no data_batch_4.bin" in cifar_error(root)

    root = write_cifar(tmp_path / "b", "cifar10", filled=4)
    with open(os.path.join(root, "test_batch.bin"), "r+b") as f:
        f.truncate(10000 * 3073 - 1)
    assert "test_batch.bin is 30,729,999 bytes, not 30,730,000 (10,000 records of 3,073 bytes)" in cifar_error(root)

    root = write_cifar(tmp_path / "c", "cifar10", filled=4)
    with open(os.path.join(root, "data_batch_3.bin"), "r+b") as f:
        f.seek(2 * 3073)
        f.write(bytes([11]))
    message = cifar_error(root)
    assert "record 2 of" in message and "data_batch_3.bin has label 11" in message and "cifar100" in message

    root = write_cifar(tmp_path / "d", "cifar100", filled=4)  # CIFAR-100's files read as CIFAR-10's
    assert "holds neither data_batch_1.bin" in cifar_error(root)


# ------------------------------------------------------------------ augmentation


def test_random_crop_flip_crops_padded_images_and_flips_them():
    x = np.arange(2 * 3 * 8 * 8, dtype=np.float32).reshape(2, 3, 8, 8) + 1
    augment = RandomCropFlip(num_samples=5, seed=0, padding=2)
    offsets, flips = augment.draws(epoch=3)
    out = augment(x, np.array([1, 4]), epoch=3)
    padded = np.pad(x, ((0, 0), (0, 0), (2, 2), (2, 2)))
    for i, sample in enumerate((1, 4)):
        dy, dx = offsets[sample]
        want = padded[i, :, dy : dy + 8, dx : dx + 8]
        np.testing.assert_array_equal(out[i], want[:, :, ::-1] if flips[sample] else want)
    again, _ = RandomCropFlip(5, 0, 2).draws(3)
    np.testing.assert_array_equal(again, offsets)
    other, _ = augment.draws(4)
    assert not np.array_equal(other, offsets)
    assert (offsets >= 0).all() and (offsets <= 4).all()


def test_augmented_batches_are_the_same_for_any_batch_size_and_after_a_resume(cifar10):
    train, _ = load_dataset("cifar10", root=cifar10, augment=True, seed=2)
    plain, _ = load_dataset("cifar10", root=cifar10, seed=2)
    whole = DataLoader(train, 8, seed=2)
    batches = [b for _, b in zip(range(3), whole)]
    filled = np.arange(8)  # records with random pixels (the rest of the files are zeros)
    assert not np.array_equal(train.batch(filled, 0)[0], plain.batch(filled, 0)[0])
    # Two half batches (two processes' shares) hold the same augmented samples.
    idx = whole.sampler.indices(0)[:8]
    halves = np.concatenate([train.batch(idx[:4], 0)[0], train.batch(idx[4:], 0)[0]])
    np.testing.assert_array_equal(halves, batches[0][0])
    # A loader restored mid-epoch produces the batches of the one that was not stopped.
    resumed = DataLoader(train, 8, seed=2)
    resumed.load_state_dict({"epoch": 0, "batch": 2})
    np.testing.assert_array_equal(next(iter(resumed))[0], batches[2][0])
    # Evaluation batches (no epoch) are not augmented.
    np.testing.assert_array_equal(train[np.arange(4)][0], plain[np.arange(4)][0])


def test_augment_needs_images():
    with pytest.raises(DataError, match="data.augment crops and flips images"):
        load_dataset("synthetic_regression", augment=True)
