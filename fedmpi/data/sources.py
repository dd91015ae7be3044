"""Loaders for the supported dataset sources, each returning a :class:`Dataset`.

Every loader reads both splits into memory once as raw tensors (files
under ``root``; pool / test sizes; raw dtype):

- ``digits``: scikit-learn's CSV (read without importing scikit-learn); pool 1437,
  test 360; float32.
- ``mnist`` / ``fashionmnist``: ``MNIST/raw/*-ubyte`` / ``FashionMNIST/raw/*-ubyte``;
  60000 / 10000; uint8.
- ``cifar10`` / ``cifar100``: ``cifar-10-batches-py/`` / ``cifar-100-python/``;
  50000 / 10000; uint8.
- ``svhn``: ``train_32x32.mat``, ``test_32x32.mat``; 73257 / 26032; uint8.
- ``stl10``: ``stl10_binary/``; 5000 / 8000 (96x96); uint8.
- ``medmnist:<flag>``: ``<flag>.npz``; train+val / test; uint8.
- ``imagefolder``: ``train/<class>/*``, ``test/<class>/*``; uint8 after resizing.

Missing files raise :class:`~fedmpi.errors.DataError` with the exact path
the loader expects and how to provide it.
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from fedmpi.data.base import Dataset, channel_stats, npz_member
from fedmpi.errors import DataError

__all__ = [
    "DIGITS_NUM_TRAIN",
    "TORCHVISION_DATASETS",
    "digits_file",
    "load_digits",
    "load_imagefolder",
    "load_medmnist",
    "load_torchvision",
]

# --------------------------------------------------------------------- digits
#: Samples ``0 .. DIGITS_NUM_TRAIN - 1`` of scikit-learn's digits form the
#: training pool, the remaining 360 the test set (fixed order, no shuffle).
DIGITS_NUM_TRAIN = 1437
#: Mean and std of the 1437 training-pool images after scaling by 1/16,
#: computed once with ``load_digits().images[:1437] / 16`` (float64).
DIGITS_MEAN = (0.30538611256089077,)
DIGITS_STD = (0.3755071088307581,)


def digits_file() -> str:
    """The digits CSV that scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``),
    located with :func:`importlib.util.find_spec`, which finds the installed package
    without importing it (importing ``sklearn.datasets`` costs about a CPU second:
    scipy, pandas)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return path
    raise DataError("data.dataset='digits': scikit-learn's digits file "
                    "(sklearn/datasets/data/digits.csv.gz) was not found; "
                    "install scikit-learn (pip install scikit-learn)")


def load_digits(augment: bool = False) -> Dataset:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, values 0..16), read
    from its CSV (:func:`digits_file`) as ``sklearn.datasets.load_digits`` reads it:
    64 pixel columns and the label, comma-separated, float64."""
    import gzip

    with gzip.open(digits_file(), "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    x = torch.from_numpy(table[:, :-1].astype(np.float32)).reshape(-1, 1, 8, 8)  # [1797, 1, 8, 8]
    y = torch.from_numpy(table[:, -1].astype(np.int64))
    n = DIGITS_NUM_TRAIN
    return Dataset(
        name="digits",
        x_train=x[:n].contiguous(),
        y_train=y[:n].contiguous(),
        x_test=x[n:].contiguous(),
        y_test=y[n:].contiguous(),
        num_classes=10,
        mean=DIGITS_MEAN,
        std=DIGITS_STD,
        scale=1.0 / 16.0,
        augment=augment,
    )


# ---------------------------------------------------------------- torchvision
@dataclass(frozen=True)
class _TorchvisionSpec:
    """How to read one torchvision dataset and where it keeps its files."""

    cls: str                                  # attribute of torchvision.datasets
    split_arg: str                            # "train" (bool) or "split" ("train"/"test")
    layout: str                               # layout of ``.data``: NHW | NHWC | NCHW
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    expected: Callable[[str], str]            # root -> what torchvision looks for


def _idx_files(root: str, folder: str) -> str:
    raw = os.path.join(root, folder, "raw")
    return (
        f"{raw}{os.sep} with train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        f"t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (the unpacked .gz files)"
    )


# Mean/std: the usual per-channel statistics of each official training split.
TORCHVISION_DATASETS: dict[str, _TorchvisionSpec] = {
    "mnist": _TorchvisionSpec(
        "MNIST", "train", "NHW", 10, (0.1307,), (0.3081,),
        lambda root: _idx_files(root, "MNIST"),
    ),
    "fashionmnist": _TorchvisionSpec(
        "FashionMNIST", "train", "NHW", 10, (0.2860,), (0.3530,),
        lambda root: _idx_files(root, "FashionMNIST"),
    ),
    "cifar10": _TorchvisionSpec(
        "CIFAR10", "train", "NHWC", 10,
        (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616),
        lambda root: (
            f"{os.path.join(root, 'cifar-10-batches-py')}{os.sep} "
            f"(extract cifar-10-python.tar.gz into {root})"
        ),
    ),
    "cifar100": _TorchvisionSpec(
        "CIFAR100", "train", "NHWC", 100,
        (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762),
        lambda root: (
            f"{os.path.join(root, 'cifar-100-python')}{os.sep} "
            f"(extract cifar-100-python.tar.gz into {root})"
        ),
    ),
    "svhn": _TorchvisionSpec(
        "SVHN", "split", "NCHW", 10,
        (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970),
        lambda root: (
            f"{os.path.join(root, 'train_32x32.mat')} and "
            f"{os.path.join(root, 'test_32x32.mat')} "
            f"(from http://ufldl.stanford.edu/housenumbers/)"
        ),
    ),
    "stl10": _TorchvisionSpec(
        "STL10", "split", "NCHW", 10,
        (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713),
        lambda root: (
            f"{os.path.join(root, 'stl10_binary')}{os.sep} with train_X.bin, train_y.bin, "
            f"unlabeled_X.bin, test_X.bin and test_y.bin "
            f"(extract stl10_binary.tar.gz into {root})"
        ),
    ),
}


def _to_nchw(data: Any, layout: str) -> torch.Tensor:
    """Raw image array of the given layout -> contiguous uint8 ``[N, C, H, W]``."""
    x = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(data))
    if layout == "NHW":
        x = x.unsqueeze(1)
    elif layout == "NHWC":
        x = x.permute(0, 3, 1, 2)
    return x.to(torch.uint8).contiguous()


def load_torchvision(name: str, root: str, download: bool, augment: bool = False) -> Dataset:
    """Official train split as the pool, official test split as the test set."""
    import torchvision.datasets as tvd

    spec = TORCHVISION_DATASETS[name]
    cls = getattr(tvd, spec.cls)
    fs_root = os.path.expanduser(root)
    expected = spec.expected(root)
    tensors: list[torch.Tensor] = []
    for train in (True, False):
        if spec.split_arg == "train":
            kwargs: dict[str, Any] = {"train": train}
        else:
            kwargs = {"split": "train" if train else "test"}
        try:
            ds = cls(fs_root, download=download, **kwargs)
        except (RuntimeError, OSError) as exc:
            if download:
                raise DataError(
                    f"dataset {name!r}: download into data.root={root!r} failed ({exc}); "
                    f"check network access or place the files by hand: expected {expected}"
                ) from exc
            raise DataError(
                f"dataset {name!r} not found (or incomplete) under data.root={root!r}: "
                f"expected {expected}, or set data.download: true"
            ) from exc
        labels = getattr(ds, "targets", None)
        if labels is None:
            labels = ds.labels
        tensors.append(_to_nchw(ds.data, spec.layout))
        tensors.append(torch.as_tensor(np.asarray(labels), dtype=torch.int64))
    x_train, y_train, x_test, y_test = tensors
    return Dataset(
        name=name,
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=spec.num_classes,
        mean=spec.mean,
        std=spec.std,
        scale=1.0 / 255.0,
        augment=augment,
    )


# ------------------------------------------------------------------- medmnist
_MEDMNIST_KEYS = (
    "train_images", "train_labels", "val_images", "val_labels", "test_images", "test_labels",
)


def _medmnist_images(arr: np.ndarray, path: str, key: str) -> torch.Tensor:
    if arr.dtype != np.uint8:
        raise DataError(f"{path}: '{key}' must hold uint8 pixels, found dtype {arr.dtype}")
    if arr.ndim == 3:
        return _to_nchw(arr, "NHW")
    if arr.ndim == 4 and arr.shape[-1] == 3:
        return _to_nchw(arr, "NHWC")
    raise DataError(
        f"{path}: '{key}' has shape {arr.shape}; expected 2-D images [N, H, W] or "
        f"[N, H, W, 3] (3-D MedMNIST volumes are not supported)"
    )


def _medmnist_labels(arr: np.ndarray, n: int, path: str, key: str) -> torch.Tensor:
    if arr.shape[0] != n:
        raise DataError(f"{path}: '{key}' has {arr.shape[0]} labels for {n} images")
    flat = arr.reshape(n, -1)
    if flat.shape[1] != 1:
        raise DataError(
            f"{path}: '{key}' has shape {arr.shape}: a multi-label task "
            f"(e.g. chestmnist) is not supported, one class label per image is required"
        )
    if not np.issubdtype(flat.dtype, np.integer) or (n and flat.min() < 0):
        raise DataError(f"{path}: '{key}' must hold non-negative integer class labels")
    return torch.from_numpy(flat[:, 0].astype(np.int64))


def load_medmnist(flag: str, root: str, augment: bool = False) -> Dataset:
    r"""A 2-D MedMNIST ``<flag>.npz`` file (no ``medmnist`` package needed).

    The pool is ``train`` followed by ``val`` (the official validation split
    is training data here; the server hold-out is drawn from the pool);
    the test set is ``test``. Mean and std are computed from the pool.
    """
    name = f"medmnist:{flag}"
    path = os.path.join(root, f"{flag}.npz")
    fs_path = os.path.expanduser(path)
    if not os.path.isfile(fs_path):
        raise DataError(
            f"dataset {name!r} not found: expected the MedMNIST file {path}; download "
            f"{flag}.npz from https://medmnist.com (Zenodo record 10519652) into "
            f"data.root={root!r} (data.download does not fetch MedMNIST)"
        )
    try:
        npz = np.load(fs_path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path} is not a readable .npz file ({exc})") from None
    with npz:
        missing = [k for k in _MEDMNIST_KEYS if k not in npz.files]
        if missing:
            raise DataError(
                f"{path} lacks the MedMNIST arrays {', '.join(missing)} "
                f"(expected {', '.join(_MEDMNIST_KEYS)})"
            )
        parts = {}
        for split in ("train", "val", "test"):
            images = _medmnist_images(npz_member(npz, f"{split}_images", path), path,
                                      f"{split}_images")
            labels = _medmnist_labels(npz_member(npz, f"{split}_labels", path), images.shape[0],
                                      path, f"{split}_labels")
            parts[split] = (images, labels)
    shapes = {tuple(x.shape[1:]) for x, _ in parts.values()}
    if len(shapes) != 1:
        raise DataError(f"{path}: train/val/test images differ in shape: {sorted(shapes)}")
    x_train = torch.cat([parts["train"][0], parts["val"][0]])
    y_train = torch.cat([parts["train"][1], parts["val"][1]])
    x_test, y_test = parts["test"]
    num_classes = int(max(int(y.max()) for _, y in parts.values() if y.numel())) + 1
    mean, std = channel_stats(x_train, 1.0 / 255.0)
    return Dataset(
        name=name, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
        num_classes=num_classes, mean=mean, std=std, scale=1.0 / 255.0, augment=augment,
    )


# ---------------------------------------------------------------- imagefolder
def _read_folder(folder: Any, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode every image of an ``ImageFolder`` into one uint8 tensor."""
    images = []
    for i in range(len(folder)):
        try:
            img, _ = folder[i]
        except Exception as exc:  # noqa: BLE001 - PIL's errors: OSError, DecompressionBombError,
            # SyntaxError, ValueError ... for a damaged or crafted file: name it
            raise DataError(f"cannot read image {folder.samples[i][0]} under {path} "
                            f"({type(exc).__name__}: {exc})") from None
        images.append(img)
    return torch.stack(images).contiguous(), torch.as_tensor(folder.targets, dtype=torch.int64)


def load_imagefolder(root: str, image_size: int = 32, augment: bool = False) -> Dataset:
    r"""``root/train/<class>/*`` as the pool and ``root/test/<class>/*`` as the test set.

    Images are decoded to RGB, resized so the shorter side is ``image_size``,
    centre-cropped to ``image_size x image_size`` and stored as ``uint8``.
    Class indices follow the sorted class-folder names (torchvision's rule),
    and both splits must have the same class folders. Mean and std are
    computed from the pool.
    """
    from torchvision import datasets as tvd
    from torchvision import transforms

    dirs = {split: os.path.join(root, split) for split in ("train", "test")}
    missing = [d for d in dirs.values() if not os.path.isdir(os.path.expanduser(d))]
    if missing:
        raise DataError(
            f"dataset 'imagefolder' needs {dirs['train']}{os.sep}<class>{os.sep}* and "
            f"{dirs['test']}{os.sep}<class>{os.sep}* under data.root={root!r}; "
            f"missing: {', '.join(missing)}"
        )
    transform = transforms.Compose([
        transforms.Resize(image_size),
        transforms.CenterCrop(image_size),
        transforms.PILToTensor(),
    ])
    folders = {}
    for split, path in dirs.items():
        try:
            folders[split] = tvd.ImageFolder(os.path.expanduser(path), transform=transform)
        except FileNotFoundError as exc:  # no class folders, or no images in them
            raise DataError(f"dataset 'imagefolder': {path}: {exc}") from exc
    train_classes, test_classes = folders["train"].classes, folders["test"].classes
    if train_classes != test_classes:
        raise DataError(
            f"dataset 'imagefolder': class folders differ between {dirs['train']} "
            f"({', '.join(train_classes)}) and {dirs['test']} ({', '.join(test_classes)})"
        )
    x_train, y_train = _read_folder(folders["train"], dirs["train"])
    x_test, y_test = _read_folder(folders["test"], dirs["test"])
    mean, std = channel_stats(x_train, 1.0 / 255.0)
    return Dataset(
        name="imagefolder", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
        num_classes=len(train_classes), mean=mean, std=std, scale=1.0 / 255.0, augment=augment,
    )
