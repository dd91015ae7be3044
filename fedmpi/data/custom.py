"""A user's dataset (``data.dataset: "pkg.module:fn"`` or ``fedmpi.run(data=...)``) as a
:class:`~fedmpi.data.Dataset`.

Accepted: a :class:`Dataset` as it is, or a pair ``(train, test)`` of map-style
datasets (``len(ds)`` and ``ds[i] -> (x, label)``, e.g. torch ``TensorDataset``
or torchvision datasets with a tensor transform). The pair is read once into
float32 tensors ``[N, ...]`` (``scale`` 1, per-channel mean/std of the pool);
the class count is ``len(train.classes)`` when the dataset has ``classes``,
else the largest label + 1.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from fedmpi.data.base import Dataset, channel_stats, check_class_ids, check_finite
from fedmpi.errors import ConfigError
from fedmpi.imports import accepts, blame, named, resolve

__all__ = ["as_dataset", "dataset_factory"]

DATASET_EXPECTED = ("a callable () -> fedmpi.data.Dataset or (train, test) map-style datasets "
                    "of (x, label) items")


def dataset_factory(obj: Any, key: str = "data.dataset") -> Callable[[], Dataset]:
    """A zero-argument callable returning the pooled :class:`~fedmpi.data.Dataset`
    (converted with :func:`as_dataset`); ``obj`` is ``pkg.module:fn`` or the object."""
    if isinstance(obj, str):
        obj = resolve(obj, key, DATASET_EXPECTED)
    if not callable(obj):   # an object: a Dataset or a (train, test) pair
        return lambda: as_dataset(obj, key)
    if not accepts(obj, 0):
        raise ConfigError(f"config key {key!r}: {named(obj)} must be callable without "
                          f"arguments ({DATASET_EXPECTED})")

    def load() -> Dataset:
        with blame(key, obj):
            made = obj()
        return as_dataset(made, key)

    return load


def _stack(ds: Any, what: str, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        n = len(ds)
        items = [ds[i] for i in range(n)]
    except Exception as exc:  # noqa: BLE001 - user code: report which key produced it
        raise ConfigError(f"config key {key!r}: reading the {what} dataset failed: "
                          f"{type(exc).__name__}: {exc}") from None
    if n == 0:
        raise ConfigError(f"config key {key!r}: the {what} dataset is empty")
    try:
        xs = [torch.as_tensor(np.asarray(x), dtype=torch.float32) for x, _ in items]
        ys = torch.as_tensor([int(y) for _, y in items], dtype=torch.int64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config key {key!r}: {what} items must be (x, integer label) pairs "
                          f"({exc})") from None
    if len({tuple(x.shape) for x in xs}) != 1:
        raise ConfigError(f"config key {key!r}: {what} inputs differ in shape")
    x = torch.stack(xs)
    if x.dim() == 1:
        x = x[:, None]
    return x.contiguous(), ys


def as_dataset(obj: Any, key: str = "data.dataset") -> Dataset:
    """``obj`` as a :class:`Dataset` (see the module docstring); ConfigError naming ``key``."""
    if isinstance(obj, Dataset):
        for split, x in (("train", obj.x_train), ("test", obj.x_test)):
            check_finite(x, f"config key {key!r}: the {split} inputs")
        return obj
    if not (isinstance(obj, (tuple, list)) and len(obj) == 2):
        raise ConfigError(f"config key {key!r} must give a fedmpi.data.Dataset or a (train, "
                          f"test) pair of map-style datasets, got {type(obj).__name__}")
    train, test = obj
    x_train, y_train = _stack(train, "train", key)
    x_test, y_test = _stack(test, "test", key)
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ConfigError(f"config key {key!r}: train inputs have shape "
                          f"{tuple(x_train.shape[1:])}, test inputs {tuple(x_test.shape[1:])}")
    classes = getattr(train, "classes", None)
    num_classes = len(classes) if classes is not None else \
        int(max(y_train.max(), y_test.max())) + 1
    if min(int(y_train.min()), int(y_test.min())) < 0 or \
            max(int(y_train.max()), int(y_test.max())) >= num_classes:
        raise ConfigError(f"config key {key!r}: labels must lie in [0, {num_classes})")
    check_class_ids(y_train.numpy(), f"config key {key!r}: the train labels")
    for split, x in (("train", x_train), ("test", x_test)):
        check_finite(x, f"config key {key!r}: the {split} inputs")
    mean, std = channel_stats(x_train, 1.0)
    name = type(train).__name__
    return Dataset(name, x_train, y_train, x_test, y_test, num_classes=num_classes, mean=mean,
                   std=std, scale=1.0)
