"""Tabular data: feature vectors ``[N, F]`` with integer class labels.

Files (by extension):

- ``.csv``: one column per feature, plus the label column ``data.tabular.label``
  (default ``label``), read with pandas;
- ``.parquet`` / ``.pq``: the same columns, read with pandas + pyarrow
  (``pip install 'fedmpi[tabular]'`` installs both);
- ``.h5`` / ``.hdf5``: datasets ``x`` ``[N, F]`` (any shape ``[N, ...]``) and ``y`` ``[N]``.

Labels must be integers ``>= 0``; features are stored as float32 and
standardised per feature with the training pool's mean and std
(:meth:`fedmpi.data.Dataset.prepare`). A table is checked when it is read: a
feature that is not a finite number (NaN, an empty cell, ±inf, a value beyond
float32) or a label that is not a class id stops with one line naming the file,
the row (CSV: the line) and the column — it would otherwise enter the shared
standardisation statistics and make every update non-finite. fedmpi does not
impute: fill or drop such rows first. :func:`read_named_table` also returns the
feature columns' names, which the silos of one federation must share
(:mod:`fedmpi.data.silos`).

Embedded sets (bundled with scikit-learn, no download): ``breast_cancer``
(569 samples, 30 features, 2 classes) and ``wine`` (178, 13, 3), each split
once into a stratified 80 % pool and 20 % test set (``random_state`` 0).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fedmpi.data.base import (Dataset, channel_stats, check_class_ids, first_non_finite,
    read_h5_array)
from fedmpi.errors import DataError

__all__ = ["EMBEDDED", "TABLE_SUFFIXES", "Table", "finite_features", "load_embedded",
           "load_tabular", "read_named_table", "read_table", "write_table"]

TABLE_SUFFIXES = (".csv", ".parquet", ".pq", ".h5", ".hdf5")
EMBEDDED = ("breast_cancer", "wine")
EMBEDDED_TEST_FRACTION = 0.2


def _suffix(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in TABLE_SUFFIXES:
        raise DataError(f"{path}: unknown table format {suffix or '(no suffix)'!r}; expected "
                        f"one of {', '.join(TABLE_SUFFIXES)}")
    return suffix


def _pandas(path: str):
    try:
        import pandas
    except ImportError:
        raise DataError(f"{path}: reading and writing CSV/Parquet tables needs pandas "
                        "(pip install 'fedmpi[tabular]')") from None
    return pandas


@dataclass(frozen=True)
class Table:
    """A table as read: ``x`` float32 ``[N, ...]``, ``y`` int64 ``[N]``, the feature
    columns' names in file order (CSV, Parquet; None for HDF5 and loaders) and the file
    (or the words naming where the rows came from)."""

    x: np.ndarray
    y: np.ndarray
    columns: Optional[tuple[str, ...]]
    path: str

    def place(self, row: int, column: Optional[str] = None, index: tuple[int, ...] = ()) -> str:
        """Where cell ``row`` (0-based data row) is, in the file's own terms."""
        if self.columns is None:   # HDF5: the dataset element
            return f"x[{', '.join(str(i) for i in (row, *index))}]" if column is None \
                else f"{column}[{row}]"
        where = f"line {row + 2}" if self.path.lower().endswith(".csv") else f"row {row + 1}"
        return f"{where}, column {column!r}"


def read_table(path: str | os.PathLike, label: str = "label") -> tuple[np.ndarray, np.ndarray]:
    """``(x float32 [N, ...], y int64 [N])`` from one CSV, Parquet or HDF5 file."""
    table = read_named_table(path, label)
    return table.x, table.y


def read_named_table(path: str | os.PathLike, label: str = "label",
                     finite: bool = True) -> Table:
    """One CSV, Parquet or HDF5 file as a :class:`Table`, checked (module docstring).
    ``finite=False`` keeps missing and non-finite features as NaN/±inf instead of refusing
    them (``fedmpi stats`` counts them; training never reads a table so)."""
    path = os.fspath(path)
    suffix = _suffix(path)
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not a data file (CSV, Parquet or HDF5); "
                        "name the file itself")
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path}")
    columns: Optional[tuple[str, ...]] = None
    if suffix in (".h5", ".hdf5"):
        import h5py

        try:
            with h5py.File(path, "r") as f:
                missing = [k for k in ("x", "y") if k not in f]
                if missing:
                    raise DataError(f"{path}: missing dataset(s) {', '.join(missing)} "
                                    "(expected x [N, F] and y [N])")
                x, y = read_h5_array(f, "x", path), read_h5_array(f, "y", path)
        except OSError as exc:
            raise DataError(f"{path}: not a readable HDF5 file ({exc})") from None
        label = "y"
    else:
        pd = _pandas(path)
        try:
            frame = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
        except ImportError as exc:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow): "
                            f"{exc}") from None
        except (ValueError, OSError) as exc:   # pandas' parser errors are ValueErrors
            raise DataError(f"{path}: not a readable table ({exc})") from None
        if label not in frame.columns:
            raise DataError(f"{path}: no label column {label!r} (config key data.tabular.label); "
                            f"columns: {', '.join(map(str, frame.columns[:8]))}"
                            f"{', ...' if len(frame.columns) > 8 else ''}")
        names = _csv_header(path) if suffix == ".csv" else [str(c) for c in frame.columns]
        twice = sorted({c for c in names if names.count(c) > 1})
        if twice:   # pandas renames a repeated header to 'c.1': the file is ambiguous
            raise DataError(f"{path}: column {twice[0]!r} appears more than once in the header")
        y = frame[label].to_numpy()
        features = frame.drop(columns=[label])
        columns = tuple(str(c) for c in features.columns)
        try:
            x = features.to_numpy(dtype=np.float64)
        except (ValueError, TypeError):
            bad = [c for c in features.columns
                   if not pd.api.types.is_numeric_dtype(features[c])]
            raise DataError(f"{path}: feature column(s) {', '.join(map(str, bad[:5]))} are not "
                            "numeric (encode them as numbers first)") from None
    table = Table(np.asarray(x), np.asarray(y), columns, path)
    y = table.y
    if y.ndim != 1 or len(y) != len(table.x):
        raise DataError(f"{path}: labels must be one integer per row; got shape {y.shape} for "
                        f"{len(table.x)} rows")
    if len(y) and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0):
        numeric = np.issubdtype(y.dtype, np.floating) or np.issubdtype(y.dtype, np.integer)
        ok = (np.isfinite(y) & (y >= 0) & (y == np.round(y))) if numeric else \
            np.zeros(len(y), dtype=bool)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            value = y[i].item() if hasattr(y[i], "item") else y[i]
            raise DataError(f"{path}: {table.place(i, label)}: label {value!r} is not a class "
                            "id; labels must be integers >= 0")
        y = y.astype(np.int64)
    check_class_ids(y, str(path))
    x = finite_features(table) if finite else np.asarray(table.x, dtype=np.float32)
    if x.ndim == 1:
        x = x[:, None]
    return Table(np.ascontiguousarray(x), y.astype(np.int64), columns, path)


def _csv_header(path: str) -> list[str]:
    """The column names of a CSV file's first line, as written (pandas renames repeats)."""
    import csv

    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        return next(csv.reader(f), [])


def finite_features(table: Table) -> np.ndarray:
    """The features as float32, or a DataError naming the first cell that is not a
    finite number (also one beyond float32's range, which would become inf)."""
    x = np.asarray(table.x)
    if x.dtype.kind not in "biuf":
        raise DataError(f"{table.path}: features must be numbers, got dtype {x.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = x.astype(np.float32)
    first = first_non_finite(x32)
    if first is not None:
        row, rest = first[0], first[1:]
        value = x[first].item()
        column = table.columns[rest[0]] if table.columns is not None and rest else None
        what = ("NaN (an empty or missing value)" if value != value else
                f"{value!r} is not a finite float32")
        raise DataError(f"{table.path}: {table.place(row, column, rest)}: {what}; features "
                        "must be finite numbers (fill or drop such rows first: fedmpi does "
                        "not impute)")
    return x32


def write_table(path: str | os.PathLike, x: np.ndarray, y: np.ndarray, label: str = "label",
                columns: list[str] | None = None) -> Path:
    """Write ``(x [N, F], y [N])`` as ``path`` (format by suffix; CSV columns ``columns`` or
    ``x0..x{F-1}``, then ``label``). Creates the parent directory."""
    path = Path(path)
    suffix = _suffix(str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    x = np.asarray(x)
    if suffix in (".h5", ".hdf5"):
        import h5py

        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=x.astype(np.float32))
            f.create_dataset("y", data=np.asarray(y, dtype=np.int64))
        return path
    pd = _pandas(str(path))
    flat = x.reshape(len(x), int(np.prod(x.shape[1:])))
    names = columns if columns is not None else [f"x{i}" for i in range(flat.shape[1])]
    frame = pd.DataFrame(flat, columns=names)
    frame[label] = np.asarray(y, dtype=np.int64)
    if suffix == ".csv":
        frame.to_csv(path, index=False, float_format="%.9g")   # float32 round-trips exactly
    else:
        try:
            frame.to_parquet(path, index=False)
        except ImportError as exc:
            raise DataError(f"{path}: writing Parquet needs pyarrow (pip install pyarrow): "
                            f"{exc}") from None
    return path


def _dataset(name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
             y_test: np.ndarray) -> Dataset:
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(f"dataset {name!r}: training rows have shape {x_train.shape[1:]}, test "
                        f"rows {x_test.shape[1:]}")
    xt = torch.from_numpy(np.ascontiguousarray(x_train, dtype=np.float32))
    mean, std = channel_stats(xt, 1.0)
    return Dataset(name, xt, torch.from_numpy(y_train.astype(np.int64)),
                   torch.from_numpy(np.ascontiguousarray(x_test, dtype=np.float32)),
                   torch.from_numpy(y_test.astype(np.int64)),
                   num_classes=int(max(y_train.max(initial=0), y_test.max(initial=0))) + 1,
                   mean=mean, std=std, scale=1.0)


def load_tabular(train: str, test: str, label: str = "label") -> Dataset:
    """``data.dataset: tabular``: the pool from ``data.tabular.train``, the test set from
    ``data.tabular.test``."""
    return _dataset("tabular", *read_table(train, label), *read_table(test, label))


def embedded_arrays(name: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``(x float32 [N, F], y int64 [N], feature names)`` of a bundled scikit-learn set."""
    from sklearn import datasets

    bunch = {"breast_cancer": datasets.load_breast_cancer, "wine": datasets.load_wine}[name]()
    return (bunch.data.astype(np.float32), bunch.target.astype(np.int64),
            [str(f).replace(" ", "_") for f in bunch.feature_names])


def load_embedded(name: str) -> Dataset:
    """``breast_cancer`` or ``wine``: stratified 80/20 pool/test split (``random_state`` 0)."""
    from sklearn.model_selection import train_test_split

    x, y, _ = embedded_arrays(name)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=EMBEDDED_TEST_FRACTION, stratify=y, random_state=0)
    return _dataset(name, x_train, y_train, x_test, y_test)
