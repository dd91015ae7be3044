"""The run log's schema, shared by :mod:`~fedmpi.log.writer` and :mod:`~fedmpi.log.reader`:
version, statuses, root attributes, the event columns, and the HDF5 walks both sides use
(schema check, round-axis datasets, events, string decoding). The layout is documented
in :mod:`fedmpi.log`."""
from __future__ import annotations

import os
from typing import Any

import h5py
import numpy as np

from fedmpi.errors import LogFormatError

__all__ = ["EVENT_DTYPES", "ROOT_ATTRS", "SCHEMA_VERSION", "STATUSES", "PathLike",
           "all_datasets", "check_schema", "load_dataset", "read_events", "round_series",
           "to_python"]

SCHEMA_VERSION = "1"
STATUSES = ("running", "completed", "failed", "interrupted")

#: Root attributes every log has.
ROOT_ATTRS = ("schema_version", "fedmpi_version", "config_yaml", "world_size", "status")
#: ``/events`` columns and their dtypes.
EVENT_DTYPES = {"round": np.int64, "rank": np.int64, "client": np.int64,
                "message": h5py.string_dtype()}

PathLike = str | os.PathLike


def check_schema(f: h5py.File, path: str) -> None:
    if "schema_version" not in f.attrs:
        raise LogFormatError(f"{path}: HDF5 file is not a fedmpi log (no schema_version attribute)")
    version = to_python(f.attrs["schema_version"])
    if version != SCHEMA_VERSION:
        raise LogFormatError(f"{path}: unsupported log schema_version {version!r}; "
                             f"this fedmpi reads {SCHEMA_VERSION!r}")
    missing = [name for name in ROOT_ATTRS if name not in f.attrs]
    if missing:
        raise LogFormatError(f"{path}: fedmpi log lacks root attribute(s) {', '.join(missing)}")
    if "clients/num_samples" not in f:
        raise LogFormatError(f"{path}: fedmpi log lacks /clients/num_samples")


def all_datasets(f: h5py.File) -> dict[str, h5py.Dataset]:
    found: dict[str, h5py.Dataset] = {}

    def visit(name: str, obj: h5py.HLObject) -> None:   # returning non-None stops the walk
        if isinstance(obj, h5py.Dataset):
            found[name] = obj

    f.visititems(visit)
    return found


def round_series(f: h5py.File) -> dict[str, h5py.Dataset]:
    """Datasets with a resizable round axis (everything resizable but /events)."""
    return {key: ds for key, ds in all_datasets(f).items()
            if not key.startswith("events/") and ds.maxshape and ds.maxshape[0] is None}


def read_events(events: h5py.Group) -> dict[str, np.ndarray]:
    n = min(len(events[name]) for name in EVENT_DTYPES)
    return {name: load_dataset(events[name], n) for name in EVENT_DTYPES}


def load_dataset(ds: h5py.Dataset, rows: int | None) -> np.ndarray:
    """Dataset contents (the first ``rows`` rows if given); strings as ``str``."""
    if h5py.check_string_dtype(ds.dtype) is not None:
        ds = ds.asstr()
    return ds[:rows] if rows is not None else ds[()]


def to_python(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.dtype.kind in "OS":
        return [v.decode() if isinstance(v, bytes) else v for v in value.tolist()]
    return value
