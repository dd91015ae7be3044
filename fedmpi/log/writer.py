"""Writing a run log: :class:`LogWriter` (rank 0 only).

One row per round in every round-axis dataset, one flush per round (and on events and
status changes); a write the file system refuses becomes
:class:`~fedmpi.job.outputs.OutputError` and every later write is refused. HDF5 writes
the file through :class:`~fedmpi.log.undo.UndoFile`: a flush that fails (a full disk,
a quota, an I/O error) is undone, so the log stays readable as of its last successful
flush — every round logged before the failure — whatever the disk did. The layout is
documented in :mod:`fedmpi.log`.

Longer than ~350 lines: one class, the writer of the schema (create, resume, append,
events, status), each step validated before the file is touched.
"""
from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Mapping
from typing import Any, Callable, Optional, TypeVar

import h5py
import numpy as np

from fedmpi.errors import LogFormatError
from fedmpi.log.row import RoundRow
from fedmpi.job.outputs import OutputError, quiet_h5py_errors, write_failed
from fedmpi.job.safefile import create_temp
from fedmpi.log.undo import UndoFile

from fedmpi.log.schema import (EVENT_DTYPES, SCHEMA_VERSION, STATUSES, PathLike, check_schema,
    read_events, round_series, to_python)

__all__ = ["LogWriter"]

_BOOL_CLIENT_FIELDS = frozenset({"selected", "excluded"})
_RESERVED_GROUPS = frozenset({"rounds", "clients", "events"})
_CHUNK_BYTES = 1 << 16   # target chunk size of round-axis datasets
_MAX_CHUNK_ROWS = 1024

_F = TypeVar("_F", bound=Callable[..., Any])


def _writes(method: _F) -> _F:
    """A method that writes the file: an I/O failure becomes :class:`OutputError`
    naming the file, and every later write is refused with the same error."""
    @functools.wraps(method)
    def wrapper(self: "LogWriter", *args: Any, **kwargs: Any) -> Any:
        if self.broken is not None:
            raise OutputError(self.broken)
        try:
            return method(self, *args, **kwargs)
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, LogFormatError):
                raise
            self._break(exc)
            raise OutputError(self.broken) from None
    return wrapper  # type: ignore[return-value]


class LogWriter:
    """Writer of a run's HDF5 log. Rank 0 is the only writer.

    Each :meth:`append_round` adds one row to every round-axis dataset and
    flushes the file once. Datasets are chunked and resizable on the round
    axis.

    Parameters
    ----------
    path
        Log file; created (truncated) unless ``resume``.
    config_yaml
        Resolved config as YAML text (root attribute ``config_yaml``).
    world_size
        Number of MPI processes of this run (root attribute ``world_size``).
    num_clients
        K, the number of clients.
    num_samples
        Training samples per client, shape [K].
    class_counts
        Per-client class histogram of the partition, shape [K, C].
    fedmpi_version
        Version string of the writing package.
    resume
        Open the existing log in ``"r+"`` instead, check its schema version,
        keep only the rounds before ``resume_rounds`` (and their events), set
        status back to ``"running"`` and record the new world size in the
        root attribute ``resumed_world_sizes`` and in an event. The root
        attributes ``config_yaml`` and ``fedmpi_version`` are replaced by the
        given ones (an event notes a changed config).
    resume_rounds
        Number of completed rounds to keep; rows with ``round >= resume_rounds``
        are dropped (rounds are numbered from 0, so this keeps
        ``resume_rounds`` rows). ``None`` keeps every complete row.

    Raises
    ------
    LogFormatError
        On resume, when the file is missing, is not a fedmpi log of this
        schema version, or has a different number of clients.
    """

    def __init__(self, path: PathLike, *, config_yaml: str, world_size: int,
                 num_clients: int, num_samples: np.ndarray, class_counts: np.ndarray,
                 fedmpi_version: str, resume: bool = False,
                 resume_rounds: int | None = None, fingerprint: str | None = None) -> None:
        self.path = os.fspath(path)
        self.broken: Optional[str] = None
        self.num_clients = int(num_clients)
        num_samples = np.asarray(num_samples, dtype=np.int64)
        class_counts = np.asarray(class_counts, dtype=np.int64)
        if num_samples.shape != (self.num_clients,):
            raise ValueError(f"num_samples has shape {num_samples.shape}, "
                             f"expected ({self.num_clients},)")
        if class_counts.ndim != 2 or class_counts.shape[0] != self.num_clients:
            raise ValueError(f"class_counts has shape {class_counts.shape}, "
                             f"expected ({self.num_clients}, C)")

        self._file: h5py.File | None = None
        self._io: Optional[UndoFile] = None           # what HDF5 writes through
        self._flushed_rounds = 0                      # rows in the file as of its last flush
        self._series: dict[str, h5py.Dataset] = {}   # round-axis datasets by path
        self._open(config_yaml, world_size, fedmpi_version, num_samples, class_counts, resume,
                   resume_rounds, fingerprint)

    @_writes
    def _open(self, config_yaml: str, world_size: int, fedmpi_version: str,
              num_samples: np.ndarray, class_counts: np.ndarray, resume: bool,
              resume_rounds: int | None, fingerprint: str | None) -> None:
        if resume:
            self._open_resume(config_yaml, world_size, fedmpi_version, resume_rounds)
        else:
            self._create(config_yaml, world_size, fedmpi_version, num_samples, class_counts)
        f = self._writable()
        f.attrs.update(writer_host=socket.gethostname(), writer_pid=os.getpid())
        if fingerprint is not None:
            f.attrs["fingerprint"] = fingerprint
        self._flush()

    def _break(self, exc: BaseException) -> None:
        """Remember a refused write, and put the file back as of its last flush
        (:class:`~fedmpi.log.undo.UndoFile`); from now on the file is not written again."""
        io = self._io
        cause = io.error if io is not None and io.error is not None else exc
        kept = io is not None and io.rollback()
        self.broken = str(write_failed(self.path, cause)) + (
            f"; the log is kept as of its last flush ({self._flushed_rounds} rounds)"
            if kept else "")
        quiet_h5py_errors()

    def _flush(self) -> None:
        """Record the time of this flush (``flushed_at``), flush the file and make it the
        state a failed later write returns to."""
        f = self._writable()
        f.attrs["flushed_at"] = time.time()
        f.flush()
        if self._io is not None:
            self._io.commit()
        self._flushed_rounds = len(self._series["rounds/round"]) \
            if "rounds/round" in self._series else 0

    # -- opening -----------------------------------------------------------------

    def _create(self, config_yaml: str, world_size: int, fedmpi_version: str,
                num_samples: np.ndarray, class_counts: np.ndarray) -> None:
        # libver v108: dense attribute storage (config_yaml may exceed 64 KiB)
        # without the v3 superblock, whose "open for write" flag would make a
        # log of a killed run unreadable until `h5clear`.
        # created under an exclusive temporary name, renamed over the log once it is
        # one (fedmpi.job.safefile: a planted link at the log's name is never followed)
        fd, tmp = create_temp(self.path, readable=True)
        self._io = UndoFile(fd, os.fspath(tmp))
        try:
            f = self._file = h5py.File(self._io, "w", libver="v108", locking="best-effort")
            f.attrs.update(schema_version=SCHEMA_VERSION, fedmpi_version=fedmpi_version,
                           config_yaml=config_yaml, world_size=int(world_size), status="running")
            f.create_dataset("clients/num_samples", data=num_samples)
            f.create_dataset("partition/class_counts", data=class_counts)
            events = f.create_group("events")
            for name, dtype in EVENT_DTYPES.items():
                events.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype,
                                      chunks=(256,))
            self._create_series("rounds/round", np.empty((), dtype=np.int64), 0)
            f.flush()
            self._io.commit()
            os.replace(tmp, self.path)
            self._io.path = self.path
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)

    def _open_resume(self, config_yaml: str, world_size: int, fedmpi_version: str,
                     resume_rounds: int | None) -> None:
        if os.path.islink(self.path) or not os.path.isfile(self.path):
            raise LogFormatError(f"{self.path}: cannot resume, no such log file (or a link)")
        try:
            fd = os.open(self.path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
        except OSError as exc:
            raise LogFormatError(f"{self.path}: cannot resume, cannot open the log for "
                                 f"writing ({exc.strerror})") from None
        self._io = UndoFile(fd, self.path)
        try:
            f = self._file = h5py.File(self._io, "r+", locking="best-effort")
        except OSError as exc:
            self._io.close()
            self._io = None
            raise LogFormatError(f"{self.path}: cannot resume, "
                                 f"not a readable HDF5 log ({exc})") from exc
        try:
            check_schema(f, self.path)
            k = f["clients/num_samples"].shape[0]
            if k != self.num_clients:
                raise LogFormatError(f"{self.path}: log has {k} clients, "
                                     f"the config has {self.num_clients}")
            self._series = round_series(f)
            if "rounds/round" not in self._series:
                raise LogFormatError(f"{self.path}: not a fedmpi log (no /rounds/round)")
        except LogFormatError:
            f.close()
            self._io.close()
            self._io = None
            raise

        # A killed writer may have grown some datasets further than others.
        n = min(len(ds) for ds in self._series.values())
        if resume_rounds is not None:
            rounds = self._series["rounds/round"][:n]
            n = int(np.searchsorted(rounds, resume_rounds, side="left"))
        for ds in self._series.values():
            ds.resize(n, axis=0)

        events = read_events(f["events"])
        keep = np.ones(len(events["round"]), dtype=bool)
        if resume_rounds is not None:
            keep = events["round"] < resume_rounds
        for name, values in events.items():
            ds = f["events"][name]
            ds.resize(int(keep.sum()), axis=0)
            ds[:] = values[keep]

        old_world_size = int(f.attrs["world_size"])
        old_config = to_python(f.attrs["config_yaml"])
        history = [int(w) for w in np.atleast_1d(f.attrs.get("resumed_world_sizes", []))]
        if "stop_reason" in f.attrs:   # the resumed run decides its own end
            del f.attrs["stop_reason"]
        f.attrs.update(status="running", world_size=int(world_size),
                       resumed_world_sizes=np.array(history + [int(world_size)], dtype=np.int64),
                       fedmpi_version=fedmpi_version, config_yaml=config_yaml)
        start = n if resume_rounds is None else int(resume_rounds)
        self.event(start, 0, -1, f"resumed at round {start} with world_size={world_size} "
                                 f"(was {old_world_size})")
        if old_config != config_yaml:
            self.event(start, 0, -1, "config_yaml changed on resume")

    # -- writing -----------------------------------------------------------------

    @property
    def rounds_written(self) -> int:
        """Number of rows of the round-axis datasets."""
        return len(self._series["rounds/round"])

    def append_row(self, row: RoundRow) -> None:
        """Append one :class:`~fedmpi.log.row.RoundRow` (:meth:`append_round`)."""
        self.append_round(row.round, row.scalars, row.clients, row.arrays)

    @_writes
    def append_round(self, round: int, scalars: Mapping[str, float],
                     per_client: Mapping[str, np.ndarray] = {},
                     arrays: Mapping[str, np.ndarray] = {}) -> None:
        """Append one round and flush.

        Parameters
        ----------
        round
            Round number; must be greater than the last one written.
        scalars
            ``/rounds/<name>``: int64 for names starting with ``bytes_``,
            float64 otherwise. A ``round`` key, if given, must equal ``round``.
        per_client
            ``/clients/<name>``, each of shape [K]: bool for ``selected``,
            ``excluded`` and bool arrays, float64 otherwise.
        arrays
            ``"<group>/<name>"`` -> array stored as a row of a [R, *shape]
            dataset: bool arrays stay bool, others are stored as float64.
        """
        f = self._writable()
        n = self.rounds_written
        if n and round <= self._series["rounds/round"][n - 1]:
            raise ValueError(f"round {round} is not after the last round written "
                             f"({self._series['rounds/round'][n - 1]})")

        # Validate and convert everything before the file is touched.
        rows: dict[str, np.ndarray] = {"rounds/round": np.asarray(round, dtype=np.int64)}
        for name, scalar in scalars.items():
            if name == "round":
                if int(scalar) != round:
                    raise ValueError(f"scalars['round']={scalar} differs from round={round}")
                continue
            _check_name(name, "scalar")
            rows[f"rounds/{name}"] = (_as_int(name, scalar) if name.startswith("bytes_")
                                      else np.asarray(float(scalar)))
        for name, value in per_client.items():
            _check_name(name, "per-client array")
            if name == "num_samples":
                raise ValueError("per_client['num_samples'] would overwrite /clients/num_samples")
            a = np.asarray(value)
            a = a.astype(bool if name in _BOOL_CLIENT_FIELDS or a.dtype == bool else np.float64)
            if a.shape != (self.num_clients,):
                raise ValueError(f"per_client[{name!r}] has shape {a.shape}, "
                                 f"expected ({self.num_clients},)")
            rows[f"clients/{name}"] = a
        for key, array in arrays.items():
            group, _, name = key.strip("/").partition("/")
            if not name or group in _RESERVED_GROUPS:
                raise ValueError(f"arrays key {key!r} must be '<group>/<name>' with a group "
                                 f"other than {sorted(_RESERVED_GROUPS)}")
            a = np.asarray(array)
            rows[f"{group}/{name}"] = a.astype(bool if a.dtype == bool else np.float64)
        for key, a in rows.items():
            if key in self._series:
                if self._series[key].shape[1:] != a.shape:
                    raise ValueError(f"{key}: row of shape {a.shape}, the log has "
                                     f"{self._series[key].shape[1:]}")
            elif key in f:
                raise ValueError(f"{key} already exists in the log as a static dataset")

        for key, a in rows.items():
            if key not in self._series:
                self._create_series(key, a, n)
        for key, ds in self._series.items():
            ds.resize(n + 1, axis=0)
            ds[n] = rows[key] if key in rows else ds.fillvalue
        self._flush()

    def _create_series(self, key: str, row: np.ndarray, n: int) -> h5py.Dataset:
        """Create a round-axis dataset with ``n`` rows of its fill value."""
        fill: Any
        if row.dtype == bool:
            fill = False
        elif row.dtype.kind == "i":
            fill = -1 if key == "rounds/round" else 0
        else:
            fill = np.nan
        rows_per_chunk = int(np.clip(_CHUNK_BYTES // max(row.nbytes, 1), 1, _MAX_CHUNK_ROWS))
        ds = self._file.create_dataset(key, shape=(n, *row.shape), maxshape=(None, *row.shape),
                                       dtype=row.dtype, chunks=(rows_per_chunk, *row.shape),
                                       fillvalue=fill)
        self._series[key] = ds
        return ds

    @_writes
    def set_attr(self, path: str, name: str, value: Any) -> None:
        """Set attribute ``name`` of group or dataset ``path`` ("" or "/" is the root).

        A missing group is created. Strings and sequences of strings are stored
        as UTF-8 variable-length strings.
        """
        f = self._writable()
        key = path.strip("/")
        obj = f if not key else f[key] if key in f else f.require_group(key)
        obj.attrs[name] = _attr_value(value)

    @_writes
    def write_static(self, path: str, data: np.ndarray) -> None:
        """Write a dataset without a round axis, replacing an earlier one.

        String arrays (e.g. ``fedvg/layer_names``) are stored with
        :func:`h5py.string_dtype`; other arrays keep their dtype.
        """
        f = self._writable()
        key = path.strip("/")
        if key in self._series or key.partition("/")[0] == "events":
            raise ValueError(f"{key} is a round-axis or event dataset, not a static one")
        a = np.asarray(data)
        if a.dtype.kind in "UO":
            a = a.astype(object)
            dtype = h5py.string_dtype()
        else:
            dtype = a.dtype
        if key in f:
            del f[key]
        f.create_dataset(key, data=a, dtype=dtype)

    @_writes
    def event(self, round: int, rank: int, client: int, message: str) -> None:
        """Append a row to ``/events`` (``client`` -1 means none) and flush."""
        f = self._writable()
        events = f["events"]
        n = min(len(events[name]) for name in EVENT_DTYPES)
        for name, value in zip(EVENT_DTYPES, (int(round), int(rank), int(client), str(message))):
            ds = events[name]
            ds.resize(n + 1, axis=0)
            ds[n] = value
        self._flush()

    @_writes
    def set_status(self, status: str) -> None:
        """Set the root attribute ``status`` (one of :data:`STATUSES`) and flush."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        f = self._writable()
        f.attrs["status"] = status
        self._flush()

    @_writes
    def set_run_info(self, text: str) -> None:
        """Set the root attribute ``run_info`` (JSON: what ran, :mod:`fedmpi.job.provenance`)
        and flush."""
        f = self._writable()
        f.attrs["run_info"] = text
        self._flush()

    @property
    def status(self) -> str:
        return to_python(self._writable().attrs["status"])

    def close(self) -> None:
        """Flush and close the file; later calls do nothing. After a failed write
        the HDF5 handle is closed with its writes discarded, so the file stays as of its
        last flush (left open, HDF5 would close it at interpreter exit through a file
        object already torn down)."""
        if self.broken is not None:
            self._abandon()
        elif self._file is not None and self._file.id.valid:
            try:
                self._flush()
                self._file.close()
                if self._io is not None:
                    self._io.commit()
                    self._io.close()
            except (OSError, RuntimeError) as exc:
                self._break(exc)
                raise OutputError(self.broken) from None
        self._file = None

    def _abandon(self) -> None:
        """Close the HDF5 handle of a broken log, its writes discarded
        (:meth:`~fedmpi.log.undo.UndoFile.discard`): the bytes on disk stay those of the
        last flush."""
        if self._io is not None:
            self._io.discard()
        if self._file is not None and self._file.id.valid:
            try:
                self._file.close()
            except (OSError, RuntimeError):
                pass
        if self._io is not None:
            self._io.close()
        self._file = None

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close; on an exception, a status still "running" becomes
        "interrupted" (KeyboardInterrupt) or "failed"."""
        if (exc_type is not None and self._file is not None and self.broken is None
                and self.status == "running"):
            self.set_status("interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed")
        self.close()

    def _writable(self) -> h5py.File:
        if self._file is None:
            raise ValueError(f"{self.path}: log is closed")
        return self._file


def _attr_value(value: Any) -> Any:
    if isinstance(value, str):
        return value
    a = np.asarray(value)
    return a.astype(h5py.string_dtype()) if a.dtype.kind == "U" else a


def _check_name(name: str, what: str) -> None:
    if not name or "/" in name:
        raise ValueError(f"{what} name {name!r} must be non-empty and contain no '/'")


def _as_int(name: str, value: Any) -> np.ndarray:
    if not isinstance(value, (int, np.integer)):
        value = float(value)
        if not value.is_integer():
            raise ValueError(f"scalar {name!r} must be an integer, got {value}")
    return np.asarray(int(value), dtype=np.int64)
