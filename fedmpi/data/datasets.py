"""Dataset loading by name, and generated Gaussian-blob data for tests."""
from __future__ import annotations

import os

import numpy as np
import torch

from fedmpi.data.base import (Dataset, channel_stats, check_class_ids, check_finite,
    read_h5_array)
from fedmpi.data.sources import (TORCHVISION_DATASETS, load_digits, load_imagefolder,
    load_medmnist, load_torchvision)
from fedmpi.errors import DataError

__all__ = ["DATASET_NAMES", "load_dataset", "synthetic_dataset"]

#: Names accepted by :func:`load_dataset` (``medmnist:<flag>`` takes any flag).
DATASET_NAMES: tuple[str, ...] = (
    "digits", *TORCHVISION_DATASETS, "medmnist:<flag>", "imagefolder", "hdf5", "synthetic",
)


def load_dataset(
    name: str,
    root: str | os.PathLike[str] = "./data",
    download: bool = False,
    augment: bool = False,
    image_size: int = 32,
) -> Dataset:
    """Load a dataset into memory as raw tensors.

    Parameters
    ----------
    name:
        ``digits``, ``mnist``, ``fashionmnist``, ``cifar10``, ``cifar100``,
        ``svhn``, ``stl10``, ``medmnist:<flag>`` (e.g. ``medmnist:dermamnist``)
        ``imagefolder`` or ``synthetic`` (10 Gaussian classes of 3×32×32, for
        benchmarks and smoke runs). Case-insensitive except for the MedMNIST flag,
        which is the file stem of ``root/<flag>.npz``.
    root:
        Directory holding the files (``data.root``); ``~`` is expanded.
    download:
        Let torchvision fetch missing files (``data.download``); only the
        torchvision datasets can be downloaded.
    augment:
        Enable random crop + flip of training batches in :meth:`Dataset.prepare`.
    image_size:
        Side length images of ``imagefolder`` are resized and centre-cropped to.

    Raises
    ------
    DataError
        Unknown name, or missing/malformed files (the message names the path
        that was expected and how to provide it).
    """
    root = os.fspath(root)
    key = name.strip()
    lower = key.lower()
    if lower == "digits":
        return load_digits(augment=augment)
    if lower in TORCHVISION_DATASETS:
        return load_torchvision(lower, root, download, augment=augment)
    if lower.startswith("medmnist:"):
        flag = key.split(":", 1)[1].strip()
        if not flag or os.sep in flag or (os.altsep and os.altsep in flag):
            raise DataError(
                f"data.dataset={name!r}: give a MedMNIST flag after 'medmnist:', "
                f"e.g. 'medmnist:organamnist' (reads <data.root>/organamnist.npz)"
            )
        return load_medmnist(flag, root, augment=augment)
    if lower == "hdf5":
        return load_hdf5(root, augment=augment)
    if lower == "synthetic":
        # Benchmarks and smoke tests of 32×32 RGB models without any download.
        return synthetic_dataset(num_train=10000, num_test=2000, num_classes=10,
                                 shape=(3, image_size, image_size), noise=4.0)
    if lower == "imagefolder":
        if image_size < 1:
            raise DataError(f"imagefolder image_size must be >= 1, got {image_size}")
        return load_imagefolder(root, image_size=image_size, augment=augment)
    raise DataError(
        f"unknown data.dataset {name!r}; expected one of: {', '.join(DATASET_NAMES)}"
    )


def load_hdf5(root: str, augment: bool = False) -> Dataset:
    """Arrays from one HDF5 file: ``data.root`` is the file, or a directory holding ``data.h5``.

    Datasets ``x_train`` and ``x_test`` ([N, C, H, W], uint8 raw pixels or
    float32), ``y_train`` and ``y_test`` ([N] integer labels). uint8 images are
    scaled by 1/255; per-channel mean/std come from the training pool.
    """
    import h5py

    path = root if os.path.isfile(root) else os.path.join(root, "data.h5")
    if not os.path.isfile(path):
        raise DataError(f"data.dataset='hdf5': file {path!r} not found; set data.root to an HDF5 "
                        "file with x_train, y_train, x_test, y_test (or a directory holding data.h5)")
    try:
        with h5py.File(path, "r") as f:
            missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in f]
            if missing:
                raise DataError(f"{path}: missing dataset(s) {', '.join(missing)} "
                                "(expected x_train [N,C,H,W], y_train [N], x_test, y_test)")
            arrays = {k: read_h5_array(f, k, path)
                      for k in ("x_train", "y_train", "x_test", "y_test")}
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: not a readable HDF5 file ({exc})") from None
    for k, a in arrays.items():
        kinds = "iu" if k.startswith("y") else "iuf"
        if not isinstance(a, np.ndarray) or a.dtype.kind not in kinds:
            what = "integer labels" if k.startswith("y") else "numeric images"
            raise DataError(f"{path}: dataset {k!r} must hold {what}, got "
                            f"{getattr(a, 'dtype', type(a).__name__)}")
    xtr, xte = arrays["x_train"], arrays["x_test"]
    if xtr.ndim != 4 or xte.ndim != 4 or xtr.shape[1:] != xte.shape[1:]:
        raise DataError(f"{path}: x_train/x_test must be [N, C, H, W] with the same C, H, W; "
                        f"got {xtr.shape} and {xte.shape}")
    for split, x in (("train", xtr), ("test", xte)):
        y = arrays[f"y_{split}"].reshape(-1)
        if len(y) != len(x):
            raise DataError(f"{path}: x_{split} holds {len(x)} samples, y_{split} {len(y)} "
                            "labels; one label per sample")
        if len(y) and int(y.min()) < 0:
            raise DataError(f"{path}: y_{split}[{int(np.argmin(y))}] = {int(y.min())} is not a "
                            "class id; labels must be integers >= 0")
        check_class_ids(y, f"{path}: y_{split}")
        check_finite(x, f"{path}: x_{split}")
    if len(xtr) == 0:
        raise DataError(f"{path}: x_train holds no samples")
    scale = 1 / 255 if xtr.dtype == np.uint8 else 1.0
    as_tensor = (lambda a: torch.from_numpy(np.ascontiguousarray(a))) if xtr.dtype == np.uint8 \
        else (lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)))
    x_train, x_test = as_tensor(xtr), as_tensor(xte)
    y_train = torch.from_numpy(arrays["y_train"].astype(np.int64).reshape(-1))
    y_test = torch.from_numpy(arrays["y_test"].astype(np.int64).reshape(-1))
    mean, std = channel_stats(x_train, scale)
    return Dataset("hdf5", x_train, y_train, x_test, y_test,
                   num_classes=int(max(y_train.max(), y_test.max())) + 1, mean=mean, std=std,
                   scale=scale, augment=augment)


def synthetic_dataset(
    num_train: int = 512,
    num_test: int = 128,
    num_classes: int = 4,
    shape: tuple[int, int, int] = (1, 8, 8),
    seed: int = 0,
    noise: float = 1.0,
) -> Dataset:
    r"""Gaussian class blobs, for tests and smoke runs.

    Class centres :math:`m_c \sim \mathcal{N}(0, I_D)` with
    :math:`D = C \cdot H \cdot W`; a sample of class :math:`y` is
    :math:`x = m_y + \text{noise} \cdot \varepsilon`,
    :math:`\varepsilon \sim \mathcal{N}(0, I_D)`. Labels are balanced
    (``i mod num_classes``, then shuffled). Stored as ``float32`` with
    ``scale = 1`` and mean/std computed from the training pool, so
    :meth:`Dataset.prepare` standardises per channel.
    """
    if num_train < 1 or num_test < 1 or num_classes < 1:
        raise ValueError("num_train, num_test and num_classes must be >= 1")
    rng = np.random.default_rng(seed)
    dim = int(np.prod(shape))
    centres = rng.standard_normal((num_classes, dim))

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = rng.permutation(np.arange(n) % num_classes)
        x = centres[y] + noise * rng.standard_normal((n, dim))
        return (
            torch.from_numpy(x.astype(np.float32).reshape(n, *shape)),
            torch.from_numpy(y.astype(np.int64)),
        )

    x_train, y_train = draw(num_train)
    x_test, y_test = draw(num_test)
    mean, std = channel_stats(x_train, 1.0)
    return Dataset(
        name="synthetic", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
        num_classes=num_classes, mean=mean, std=std, scale=1.0,
    )
