"""Tests for fedmpi.data datasets: loading, preprocessing, augmentation, errors."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits as sk_load_digits

from fedmpi.data.base import Dataset
from fedmpi.data.datasets import load_dataset, synthetic_dataset
from fedmpi.data.augment import random_crop_flip
from fedmpi.data.base import channel_stats
from fedmpi.errors import DataError, UserError


# --------------------------------------------------------------------- digits
def test_digits_fixed_split_matches_sklearn():
    ds = load_dataset("digits")
    bunch = sk_load_digits()
    assert (ds.num_train, ds.num_test) == (1437, 360)
    assert ds.x_train.shape == (1437, 1, 8, 8) and ds.x_train.dtype == torch.float32
    assert ds.y_train.dtype == torch.int64 and ds.input_shape == (1, 8, 8)
    assert ds.num_classes == 10 and ds.scale == pytest.approx(1 / 16)
    assert int(ds.y_test[0]) == int(bunch.target[1437])
    np.testing.assert_array_equal(ds.x_test[0, 0].numpy(), bunch.images[1437])
    np.testing.assert_array_equal(ds.y_train.numpy(), bunch.target[:1437])


def test_digits_are_read_without_importing_sklearn_and_equal_its_loader_bitwise():
    """The CSV is read in a fresh interpreter that never imports scikit-learn; every
    image and label equals sklearn.datasets.load_digits' (float32 of its float64
    pixels), in its order."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "from fedmpi.data.sources import load_digits\n"
            "ds = load_digits()\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')], "
            "'imported'\n"
            "np.save(sys.argv[1], np.concatenate([ds.x_train.reshape(-1, 64), ds.x_test.reshape(-1, 64)]))\n"
            "np.save(sys.argv[2], np.concatenate([ds.y_train, ds.y_test]))\n")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        xs, ys = os.path.join(tmp, "x.npy"), os.path.join(tmp, "y.npy")
        subprocess.run([sys.executable, "-c", code, xs, ys], check=True, env=os.environ.copy())
        x, y = np.load(xs), np.load(ys)
    bunch = sk_load_digits()
    assert x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(x, bunch.images.reshape(-1, 64).astype(np.float32))
    np.testing.assert_array_equal(y, bunch.target)


def test_digits_file_missing_is_a_one_line_data_error(monkeypatch):
    import importlib.util

    from fedmpi.data import sources

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="digits.csv.gz"):
        sources.load_digits()


def test_digits_constants_match_pool_statistics():
    ds = load_dataset("digits")
    mean, std = channel_stats(ds.x_train, ds.scale)
    assert mean == pytest.approx(ds.mean, abs=1e-6)
    assert std == pytest.approx(ds.std, abs=1e-6)


@pytest.mark.parametrize("make", [
    lambda: load_dataset("digits"),
    lambda: synthetic_dataset(num_train=300, num_test=50, num_classes=3, shape=(3, 4, 4)),
])
def test_prepare_standardises_pool_per_channel(make):
    ds = make()
    x = ds.prepare(ds.x_train, train=False)
    assert x.dtype == torch.float32 and x.shape == ds.x_train.shape
    per_channel = x.transpose(0, 1).reshape(x.shape[1], -1)
    np.testing.assert_allclose(per_channel.mean(1).numpy(), 0.0, atol=1e-4)
    np.testing.assert_allclose(per_channel.std(1, unbiased=False).numpy(), 1.0, atol=1e-4)


def test_prepare_formula_uint8():
    x = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    ds = _uint8_dataset(x)
    mean = torch.tensor(ds.mean).view(1, 3, 1, 1)
    std = torch.tensor(ds.std).view(1, 3, 1, 1)
    expected = (x.double() / 255 - mean.double()) / std.double()
    torch.testing.assert_close(ds.prepare(x, train=False), expected.float(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------- augmentation
def _uint8_dataset(x: torch.Tensor, augment: bool = False) -> Dataset:
    y = torch.zeros(len(x), dtype=torch.int64)
    return Dataset(
        name="toy", x_train=x, y_train=y, x_test=x, y_test=y, num_classes=1,
        mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), scale=1 / 255, augment=augment,
    )


def test_augment_shape_determinism_and_effect():
    x = torch.randint(1, 256, (64, 3, 32, 32), dtype=torch.uint8)
    ds = _uint8_dataset(x, augment=True)
    a = ds.prepare(x, train=True, generator=torch.Generator().manual_seed(7))
    b = ds.prepare(x, train=True, generator=torch.Generator().manual_seed(7))
    c = ds.prepare(x, train=True, generator=torch.Generator().manual_seed(8))
    plain = ds.prepare(x, train=False)
    assert a.shape == x.shape and a.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    assert not torch.equal(a, plain)
    # Evaluation batches are never augmented.
    torch.testing.assert_close(plain, _uint8_dataset(x).prepare(x, train=False), rtol=0, atol=0)


def test_random_crop_flip_is_a_padded_window():
    """Every output is a (possibly flipped) 32x32 window of the zero-padded input."""
    x = torch.randint(1, 256, (24, 3, 32, 32), dtype=torch.uint8)
    out = random_crop_flip(x, padding=4, generator=torch.Generator().manual_seed(0))
    assert out.dtype == torch.uint8 and out.shape == x.shape
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    seen_flip, seen_offsets = set(), set()
    for b in range(len(x)):
        match = None
        for i in range(9):
            for j in range(9):
                window = padded[b, :, i:i + 32, j:j + 32]
                for flip in (False, True):
                    if torch.equal(out[b], window.flip(-1) if flip else window):
                        match = (i, j, flip)
        assert match is not None, f"sample {b} is not a crop of its padded input"
        seen_offsets.add(match[:2])
        seen_flip.add(match[2])
    assert seen_flip == {False, True}
    assert len(seen_offsets) > 5


# -------------------------------------------------------------- torchvision
@pytest.mark.parametrize("name, expected", [
    ("cifar10", "cifar-10-batches-py"),
    ("cifar100", "cifar-100-python"),
    ("mnist", os.path.join("MNIST", "raw")),
    ("fashionmnist", os.path.join("FashionMNIST", "raw")),
    ("svhn", "train_32x32.mat"),
    ("stl10", "stl10_binary"),
])
def test_missing_torchvision_files_raise_data_error(tmp_path, name, expected):
    root = str(tmp_path / "nodata")
    with pytest.raises(DataError) as info:
        load_dataset(name, root=root, download=False)
    message = str(info.value)
    assert os.path.join(root, expected) in message
    assert "data.download" in message and repr(name) in message
    assert isinstance(info.value, UserError)


# ------------------------------------------------------------------ medmnist
def _write_medmnist(path, rgb: bool, sizes=(20, 6, 8), num_classes=4, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, n in zip(("train", "val", "test"), sizes):
        shape = (n, 28, 28, 3) if rgb else (n, 28, 28)
        arrays[f"{split}_images"] = rng.integers(0, 256, shape, dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, num_classes, (n, 1)).astype(np.uint8)
    arrays["train_labels"][0, 0] = num_classes - 1  # make the largest class present
    np.savez(path, **arrays)
    return arrays


@pytest.mark.parametrize("rgb", [False, True])
def test_medmnist_npz(tmp_path, rgb):
    arrays = _write_medmnist(tmp_path / "dermamnist.npz", rgb)
    ds = load_dataset("medmnist:dermamnist", root=str(tmp_path))
    channels = 3 if rgb else 1
    assert ds.name == "medmnist:dermamnist"
    assert ds.x_train.shape == (26, channels, 28, 28) and ds.x_train.dtype == torch.uint8
    assert ds.x_test.shape == (8, channels, 28, 28)
    assert ds.num_classes == 4 and ds.scale == pytest.approx(1 / 255)
    # Pool = train followed by val; labels flattened to int64.
    expected_y = np.concatenate([arrays["train_labels"][:, 0], arrays["val_labels"][:, 0]])
    np.testing.assert_array_equal(ds.y_train.numpy(), expected_y)
    assert ds.y_train.dtype == torch.int64
    first = arrays["val_images"][0]
    first = first[None] if not rgb else first.transpose(2, 0, 1)
    np.testing.assert_array_equal(ds.x_train[20].numpy(), first)
    # Mean/std come from the pool.
    x = ds.prepare(ds.x_train, train=False)
    np.testing.assert_allclose(x.transpose(0, 1).reshape(channels, -1).mean(1).numpy(), 0, atol=1e-4)


def test_medmnist_missing_and_malformed(tmp_path):
    with pytest.raises(DataError, match="organamnist.npz") as info:
        load_dataset("medmnist:organamnist", root=str(tmp_path))
    assert os.path.join(str(tmp_path), "organamnist.npz") in str(info.value)
    assert "medmnist.com" in str(info.value)

    np.savez(tmp_path / "broken.npz", train_images=np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(DataError, match="train_labels"):
        load_dataset("medmnist:broken", root=str(tmp_path))

    arrays = _write_medmnist(tmp_path / "multi.npz", rgb=False)
    arrays["train_labels"] = np.zeros((20, 14), np.uint8)
    np.savez(tmp_path / "multi.npz", **arrays)
    with pytest.raises(DataError, match="multi-label"):
        load_dataset("medmnist:multi", root=str(tmp_path))

    with pytest.raises(DataError, match="medmnist:organamnist"):
        load_dataset("medmnist:", root=str(tmp_path))


# --------------------------------------------------------------- imagefolder
def test_imagefolder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("test", 2)):
        for cls in ("cat", "dog"):
            d = tmp_path / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                size = (40 + 7 * i, 50)
                Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(d / f"{i}.png")
    ds = load_dataset("imagefolder", root=str(tmp_path), image_size=16)
    assert ds.x_train.shape == (6, 3, 16, 16) and ds.x_train.dtype == torch.uint8
    assert ds.x_test.shape == (4, 3, 16, 16)
    assert ds.num_classes == 2
    np.testing.assert_array_equal(ds.y_train.numpy(), [0, 0, 0, 1, 1, 1])

    with pytest.raises(DataError) as info:
        load_dataset("imagefolder", root=str(tmp_path / "empty"))
    assert os.path.join(str(tmp_path / "empty"), "train") in str(info.value)


# -------------------------------------------------------------------- misc
def test_unknown_name_lists_valid_names():
    with pytest.raises(DataError) as info:
        load_dataset("imagenet")
    message = str(info.value)
    assert "'imagenet'" in message
    for valid in ("digits", "cifar10", "medmnist:<flag>", "imagefolder"):
        assert valid in message


def test_synthetic_is_seeded_and_balanced():
    a = synthetic_dataset(num_train=100, num_test=20, num_classes=5, seed=3)
    b = synthetic_dataset(num_train=100, num_test=20, num_classes=5, seed=3)
    c = synthetic_dataset(num_train=100, num_test=20, num_classes=5, seed=4)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    assert np.bincount(a.y_train.numpy()).tolist() == [20] * 5
    assert a.x_train.shape == (100, 1, 8, 8) and a.x_train.dtype == torch.float32


def test_to_moves_tensors_and_keeps_metadata():
    ds = load_dataset("digits")
    moved = ds.to("cpu")
    assert moved is not ds and moved.mean == ds.mean and moved.num_classes == 10
    assert moved.x_train.device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prepare_on_cuda_matches_cpu():
    x = torch.randint(0, 256, (32, 3, 32, 32), dtype=torch.uint8)
    ds = _uint8_dataset(x, augment=True)
    gpu = ds.to("cuda")
    out = gpu.prepare(gpu.x_train, train=True, generator=torch.Generator("cuda").manual_seed(0))
    assert out.device.type == "cuda" and out.shape == x.shape
    torch.testing.assert_close(gpu.prepare(gpu.x_train, train=False).cpu(), ds.prepare(x, train=False))


def _write_idx(path, array: np.ndarray) -> None:
    """Write a uint8 array in the MNIST IDX format."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_mnist_layout_from_raw_files(tmp_path):
    """The torchvision path: official files -> uint8 [N, 1, 28, 28] pool and test set."""
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    x_tr = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
    x_te = rng.integers(0, 256, (3, 28, 28), dtype=np.uint8)
    _write_idx(raw / "train-images-idx3-ubyte", x_tr)
    _write_idx(raw / "train-labels-idx1-ubyte", np.arange(7) % 10)
    _write_idx(raw / "t10k-images-idx3-ubyte", x_te)
    _write_idx(raw / "t10k-labels-idx1-ubyte", np.array([9, 8, 7]))
    ds = load_dataset("mnist", root=str(tmp_path))
    assert ds.x_train.shape == (7, 1, 28, 28) and ds.x_train.dtype == torch.uint8
    np.testing.assert_array_equal(ds.x_train[:, 0].numpy(), x_tr)
    np.testing.assert_array_equal(ds.x_test[:, 0].numpy(), x_te)
    assert ds.y_test.tolist() == [9, 8, 7] and ds.y_train.dtype == torch.int64
    assert ds.num_classes == 10 and ds.mean == (0.1307,)


def test_hdf5_dataset_roundtrip_and_missing_file(tmp_path):
    import h5py
    from fedmpi.errors import DataError

    rng = np.random.default_rng(0)
    path = tmp_path / "silo.h5"
    with h5py.File(path, "w") as f:
        f["x_train"] = rng.integers(0, 256, (20, 3, 4, 4), dtype=np.uint8)
        f["y_train"] = np.arange(20) % 3
        f["x_test"] = rng.integers(0, 256, (6, 3, 4, 4), dtype=np.uint8)
        f["y_test"] = np.arange(6) % 3
    ds = load_dataset("hdf5", root=str(path))
    assert ds.num_classes == 3 and ds.input_shape == (3, 4, 4) and ds.x_train.dtype == torch.uint8
    x = ds.prepare(ds.x_train, train=False)
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 0.05
    with pytest.raises(DataError, match="nothere"):
        load_dataset("hdf5", root=str(tmp_path / "nothere.h5"))


def test_synthetic_dataset_by_name_is_32x32_rgb():
    ds = load_dataset("synthetic")
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10
