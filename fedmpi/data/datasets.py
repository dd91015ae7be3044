"""Dataset loading by name, and generated Gaussian-blob data for tests."""
from __future__ import annotations

import os

import numpy as np
import torch

from fedmpi.data.base import Dataset, channel_stats
from fedmpi.data.sources import (
    TORCHVISION_DATASETS,
    load_digits,
    load_imagefolder,
    load_medmnist,
    load_torchvision,
)
from fedmpi.errors import DataError

__all__ = ["DATASET_NAMES", "Dataset", "load_dataset", "synthetic_dataset"]

#: Names accepted by :func:`load_dataset` (``medmnist:<flag>`` takes any flag).
DATASET_NAMES: tuple[str, ...] = (
    "digits", *TORCHVISION_DATASETS, "medmnist:<flag>", "imagefolder",
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
        or ``imagefolder``. Case-insensitive except for the MedMNIST flag,
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
    if lower == "imagefolder":
        if image_size < 1:
            raise DataError(f"imagefolder image_size must be >= 1, got {image_size}")
        return load_imagefolder(root, image_size=image_size, augment=augment)
    raise DataError(
        f"unknown data.dataset {name!r}; expected one of: {', '.join(DATASET_NAMES)}"
    )


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
