"""HDF5 run log: :class:`LogWriter` (rank 0 only) and :func:`read`.

Layout, ``schema_version`` "1" (R rounds, K clients; DESIGN.md section 5)::

    / attrs                  schema_version, fedmpi_version, config_yaml, world_size,
                             status (running|completed|failed|interrupted),
                             resumed_world_sizes (only after a resume),
                             stop_reason (only for a run completed before train.rounds:
                             privacy.target_epsilon),
                             fingerprint (run-defining config hash, fedmpi.rundir),
                             writer_host, writer_pid, flushed_at (Unix time of the
                             last flush; issue 18), run_info (JSON: the model, data
                             and silo files with SHA-256, method and its parameters,
                             weighting, transforms as they ran; fedmpi.provenance)
    /rounds/round            [R]        int64
    /rounds/<name>           [R]        int64 for ``bytes_*``, float64 otherwise
    /clients/num_samples     [K]        int64
    /clients/<name>          [R, K]     bool for selected/excluded, float64 otherwise
    /partition/class_counts  [K, C]     int64
    /<group>/<name>          [R, ...]   per-round arrays, e.g. fedvg/grad_norm [R, K, L]
    /<group>/<name>          [...]      static datasets, e.g. fedvg/layer_names [L]
    /events/round, rank, client, message   [E]   int64, int64, int64, str

Every dataset with a round axis is chunked and resizable along axis 0
(``maxshape[0] is None``); that is how :func:`read` tells them from static
datasets. All of them always have the same length: a dataset first named at
round r > 0 gets r rows of its fill value (NaN, False, or 0 for ``bytes_*``),
and a name left out of one :meth:`LogWriter.append_round` gets a fill row.

The file is flushed once per round (and on events and status changes), so a
killed run leaves a log that is readable up to its last flushed round. Each
flush records its time (``flushed_at``), so a log still ``running`` whose
writer is gone is recognisable (:func:`ended_without_status`). A write that
the file system refuses (disk full) raises
:class:`~fedmpi.outputs.OutputError` naming the file; the writer then refuses
further writes (HDF5's state after a failed flush is not trustworthy).

Longer than ~350 lines: the writer and the reader of one schema live together so they cannot drift apart.
"""
from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import h5py
import numpy as np
import yaml

from fedmpi.errors import LogFormatError
from fedmpi.outputs import OutputError, quiet_h5py_errors, write_failed
from fedmpi.safefile import create_temp

if TYPE_CHECKING:
    import pandas

__all__ = ["SCHEMA_VERSION", "STATUSES", "LogWriter", "RunLog", "as_run_log", "read"]

SCHEMA_VERSION = "1"
STATUSES = ("running", "completed", "failed", "interrupted")

_ROOT_ATTRS = ("schema_version", "fedmpi_version", "config_yaml", "world_size", "status")
_EVENT_DTYPES = {"round": np.int64, "rank": np.int64, "client": np.int64,
                 "message": h5py.string_dtype()}
_BOOL_CLIENT_FIELDS = frozenset({"selected", "excluded"})
_RESERVED_GROUPS = frozenset({"rounds", "clients", "events"})
_CHUNK_BYTES = 1 << 16   # target chunk size of round-axis datasets
_MAX_CHUNK_ROWS = 1024

PathLike = str | os.PathLike
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
        """Remember a refused write; from now on the file is not written again."""
        self.broken = str(write_failed(self.path, exc))
        quiet_h5py_errors()

    def _flush(self) -> None:
        """Record the time of this flush (``flushed_at``) and flush the file."""
        f = self._writable()
        f.attrs["flushed_at"] = time.time()
        f.flush()

    # -- opening -----------------------------------------------------------------

    def _create(self, config_yaml: str, world_size: int, fedmpi_version: str,
                num_samples: np.ndarray, class_counts: np.ndarray) -> None:
        # libver v108: dense attribute storage (config_yaml may exceed 64 KiB)
        # without the v3 superblock, whose "open for write" flag would make a
        # log of a killed run unreadable until `h5clear`.
        # created under an exclusive temporary name, renamed over the log once it is
        # one (fedmpi.safefile: a planted link at the log's name is never followed)
        fd, tmp = create_temp(self.path)
        os.close(fd)
        try:
            f = self._file = h5py.File(tmp, "w", libver="v108", locking="best-effort")
            f.attrs.update(schema_version=SCHEMA_VERSION, fedmpi_version=fedmpi_version,
                           config_yaml=config_yaml, world_size=int(world_size), status="running")
            f.create_dataset("clients/num_samples", data=num_samples)
            f.create_dataset("partition/class_counts", data=class_counts)
            events = f.create_group("events")
            for name, dtype in _EVENT_DTYPES.items():
                events.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype,
                                      chunks=(256,))
            self._create_series("rounds/round", np.empty((), dtype=np.int64), 0)
            f.flush()
            os.replace(tmp, self.path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)

    def _open_resume(self, config_yaml: str, world_size: int, fedmpi_version: str,
                     resume_rounds: int | None) -> None:
        if os.path.islink(self.path) or not os.path.isfile(self.path):
            raise LogFormatError(f"{self.path}: cannot resume, no such log file (or a link)")
        try:
            f = self._file = h5py.File(self.path, "r+", locking="best-effort")
        except OSError as exc:
            raise LogFormatError(f"{self.path}: cannot resume, "
                                 f"not a readable HDF5 log ({exc})") from exc
        try:
            _check_schema(f, self.path)
            k = f["clients/num_samples"].shape[0]
            if k != self.num_clients:
                raise LogFormatError(f"{self.path}: log has {k} clients, "
                                     f"the config has {self.num_clients}")
            self._series = _round_series(f)
            if "rounds/round" not in self._series:
                raise LogFormatError(f"{self.path}: not a fedmpi log (no /rounds/round)")
        except LogFormatError:
            f.close()
            raise

        # A killed writer may have grown some datasets further than others.
        n = min(len(ds) for ds in self._series.values())
        if resume_rounds is not None:
            rounds = self._series["rounds/round"][:n]
            n = int(np.searchsorted(rounds, resume_rounds, side="left"))
        for ds in self._series.values():
            ds.resize(n, axis=0)

        events = _read_events(f["events"])
        keep = np.ones(len(events["round"]), dtype=bool)
        if resume_rounds is not None:
            keep = events["round"] < resume_rounds
        for name, values in events.items():
            ds = f["events"][name]
            ds.resize(int(keep.sum()), axis=0)
            ds[:] = values[keep]

        old_world_size = int(f.attrs["world_size"])
        old_config = _to_python(f.attrs["config_yaml"])
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
        n = min(len(events[name]) for name in _EVENT_DTYPES)
        for name, value in zip(_EVENT_DTYPES, (int(round), int(rank), int(client), str(message))):
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
        """Set the root attribute ``run_info`` (JSON: what ran, :mod:`fedmpi.provenance`)
        and flush."""
        f = self._writable()
        f.attrs["run_info"] = text
        self._flush()

    @property
    def status(self) -> str:
        return _to_python(self._writable().attrs["status"])

    def close(self) -> None:
        """Flush and close the file; later calls do nothing. After a failed write
        the file is left to the process exit (closing it would write again)."""
        if self.broken is None and self._file is not None and self._file.id.valid:
            try:
                self._flush()
                self._file.close()
            except (OSError, RuntimeError) as exc:
                self._break(exc)
                raise OutputError(self.broken) from None
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


# -- reading ---------------------------------------------------------------------

@dataclass
class RunLog:
    """Contents of a run log, as read by :func:`read`.

    Attributes
    ----------
    path
        The file read.
    attrs
        Root attributes (schema_version, fedmpi_version, config_yaml,
        world_size, status, and resumed_world_sizes after a resume).
    config
        ``yaml.safe_load(attrs["config_yaml"])``.
    rounds
        ``/rounds/*``, each [R].
    clients
        ``/clients/num_samples`` [K] and the per-round [R, K] arrays.
    arrays
        Every other dataset by ``"group/name"``, e.g. ``"fedvg/grad_norm"``
        [R, K, L], ``"partition/class_counts"`` [K, C], ``"fedvg/layer_names"``
        (strings as an object array of ``str``).
    events
        ``{"round", "rank", "client", "message"}`` -> arrays of equal length.
    """

    path: str
    attrs: dict[str, Any]
    config: dict[str, Any]
    rounds: dict[str, np.ndarray]
    clients: dict[str, np.ndarray]
    arrays: dict[str, np.ndarray]
    events: dict[str, np.ndarray]

    @property
    def num_rounds(self) -> int:
        """R, the number of complete rounds in the log."""
        return len(self.rounds["round"]) if "round" in self.rounds else 0

    @property
    def num_clients(self) -> int:
        """K, the number of clients."""
        return len(self.clients["num_samples"])

    @property
    def status(self) -> str:
        return self.attrs["status"]

    def rounds_frame(self) -> "pandas.DataFrame":
        """``/rounds/*`` as a DataFrame with one row per round (needs pandas)."""
        return _frame(self.rounds, "rounds_frame")

    def events_frame(self) -> "pandas.DataFrame":
        """``/events`` as a DataFrame with columns round, rank, client, message."""
        return _frame(self.events, "events_frame")


def _frame(columns: Mapping[str, np.ndarray], caller: str) -> "pandas.DataFrame":
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError(f"RunLog.{caller}() needs pandas: pip install -e '.[analysis]' "
                          "(or pip install pandas)") from exc
    return pd.DataFrame(dict(columns))


def read(path: PathLike) -> RunLog:
    """Read a run log, also one that a live run is still writing.

    Round-axis datasets are trimmed to their shortest common length, so a log
    whose writer was killed mid-round reads as its complete rounds.

    Raises
    ------
    LogFormatError
        Naming ``path``, for a missing file, a file that is not HDF5, an HDF5
        file that is not a fedmpi log, an unsupported schema version, or a
        truncated or corrupt file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LogFormatError(f"{path}: no such log file")
    try:
        try:
            f = h5py.File(path, "r", locking=False)
        except OSError as exc:
            if "locking flag values don't match" not in str(exc):
                raise
            # The file is open in this process (by a LogWriter): HDF5 shares
            # the open file, which needs the writer's locking setting.
            f = h5py.File(path, "r", locking="best-effort")
        with f:
            return _read_file(f, path)
    except LogFormatError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError, yaml.YAMLError) as exc:
        if "file signature not found" in str(exc):
            raise LogFormatError(f"{path}: not an HDF5 file; expected a fedmpi log.h5") from None
        if isinstance(exc, yaml.YAMLError):
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise LogFormatError(f"{path}: attribute config_yaml is not valid YAML ({problem})"
                                 ) from None
        raise LogFormatError(f"{path}: truncated or corrupt fedmpi log ({exc})") from exc


def as_run_log(log: RunLog | PathLike) -> RunLog:
    """``log`` itself, or the log read from that path (:func:`read`): the analysis
    functions (``run_metrics``, ``summary_markdown``, the plots ...) accept either."""
    return log if isinstance(log, RunLog) else read(log)


def _read_file(f: h5py.File, path: str) -> RunLog:
    _check_schema(f, path)
    _check_storage(f, path)
    attrs = {name: _to_python(value) for name, value in f.attrs.items()}
    config = yaml.safe_load(attrs["config_yaml"]) or {}
    if not isinstance(config, dict):
        raise LogFormatError(f"{path}: attribute config_yaml is not a YAML mapping")

    series = _round_series(f)
    num_rounds = min((len(ds) for ds in series.values()), default=0)
    rounds: dict[str, np.ndarray] = {}
    clients: dict[str, np.ndarray] = {}
    arrays: dict[str, np.ndarray] = {}
    for key, ds in _datasets(f).items():
        group, _, name = key.partition("/")
        if group == "events":
            continue
        data = _load(ds, num_rounds if key in series else None)
        if group == "rounds":
            rounds[name] = data
        elif group == "clients":
            clients[name] = data
        else:
            arrays[key] = data
    _check_shapes(path, rounds, clients, num_rounds)
    events = _read_events(f["events"]) if "events" in f else {
        name: np.empty(0, dtype=object if name == "message" else np.int64)
        for name in _EVENT_DTYPES}
    return RunLog(path=path, attrs=attrs, config=config, rounds=rounds, clients=clients,
                  arrays=arrays, events=events)


# -- helpers ---------------------------------------------------------------------

def _check_shapes(path: str, rounds: dict[str, np.ndarray], clients: dict[str, np.ndarray],
                  num_rounds: int) -> None:
    """Every /rounds dataset numeric with one row per round (``round`` integer), every
    /clients dataset numeric [R, K] or static [K, ...] (``num_samples`` [K] integer)."""
    def bad(key: str, expected: str, a: np.ndarray) -> LogFormatError:
        return LogFormatError(f"{path}: dataset /{key} must be {expected}, "
                              f"got {a.dtype} of shape {a.shape}")

    if "round" in rounds and rounds["round"].dtype.kind not in "iu":
        raise bad("rounds/round", "integer", rounds["round"])
    for name, a in rounds.items():
        if a.dtype.kind not in "biuf" or a.shape != (num_rounds,):
            raise bad(f"rounds/{name}", f"numeric with {num_rounds} rows (one per round)", a)
    ns = clients.get("num_samples")
    if ns is None or ns.ndim != 1 or ns.dtype.kind not in "iu":
        raise bad("clients/num_samples", "integer [K]",
                  ns if ns is not None else np.empty(0, dtype=object))
    k = len(ns)
    for name, a in clients.items():
        per_round = a.shape == (num_rounds, k)
        static = a.ndim >= 1 and a.shape[0] == k      # e.g. /clients/level [K]
        if name != "num_samples" and (a.dtype.kind not in "biuf" or not (per_round or static)):
            raise bad(f"clients/{name}", f"numeric [{num_rounds}, {k}] (rounds x clients) or "
                      f"[{k}]", a)


#: A dataset may declare at most this many times the log file's size (plus
#: :data:`_DECLARED_FLOOR`): a fedmpi log stores every row it declares, uncompressed.
_DECLARED_RATIO = 16
_DECLARED_FLOOR = 64 << 20


def _check_storage(f: h5py.File, path: str) -> None:
    """A log is untrusted input (issue 30): refuse, before reading any data, a dataset
    whose bytes live outside the file (HDF5 *external* storage — which reads any file
    the reader may read — or *virtual* datasets mapping other files) and one whose
    declared shape is far larger than the file (a fill-value dataset that would
    allocate gigabytes on reading), naming the dataset."""
    limit = _DECLARED_RATIO * os.path.getsize(path) + _DECLARED_FLOOR
    for key, ds in _datasets(f).items():
        if ds.external or ds.is_virtual:
            kind = "external storage (other files)" if ds.external else "a virtual dataset"
            raise LogFormatError(f"{path}: dataset /{key} uses {kind}; a fedmpi log keeps its "
                                 "data inside the file, so this log is refused")
        declared = int(np.prod(ds.shape, dtype=np.float64)) * ds.dtype.itemsize
        if declared > limit:
            raise LogFormatError(f"{path}: dataset /{key} declares shape {ds.shape} "
                                 f"({declared / 2**20:.0f} MiB), more than the file can hold "
                                 f"({os.path.getsize(path) / 2**20:.1f} MiB); refused as a "
                                 "crafted or damaged log")


def _check_schema(f: h5py.File, path: str) -> None:
    if "schema_version" not in f.attrs:
        raise LogFormatError(f"{path}: HDF5 file is not a fedmpi log (no schema_version attribute)")
    version = _to_python(f.attrs["schema_version"])
    if version != SCHEMA_VERSION:
        raise LogFormatError(f"{path}: unsupported log schema_version {version!r}; "
                             f"this fedmpi reads {SCHEMA_VERSION!r}")
    missing = [name for name in _ROOT_ATTRS if name not in f.attrs]
    if missing:
        raise LogFormatError(f"{path}: fedmpi log lacks root attribute(s) {', '.join(missing)}")
    if "clients/num_samples" not in f:
        raise LogFormatError(f"{path}: fedmpi log lacks /clients/num_samples")


def _datasets(f: h5py.File) -> dict[str, h5py.Dataset]:
    found: dict[str, h5py.Dataset] = {}

    def visit(name: str, obj: h5py.HLObject) -> None:   # returning non-None stops the walk
        if isinstance(obj, h5py.Dataset):
            found[name] = obj

    f.visititems(visit)
    return found


def _round_series(f: h5py.File) -> dict[str, h5py.Dataset]:
    """Datasets with a resizable round axis (everything resizable but /events)."""
    return {key: ds for key, ds in _datasets(f).items()
            if not key.startswith("events/") and ds.maxshape and ds.maxshape[0] is None}


def _read_events(events: h5py.Group) -> dict[str, np.ndarray]:
    n = min(len(events[name]) for name in _EVENT_DTYPES)
    return {name: _load(events[name], n) for name in _EVENT_DTYPES}


def _load(ds: h5py.Dataset, rows: int | None) -> np.ndarray:
    """Dataset contents (the first ``rows`` rows if given); strings as ``str``."""
    if h5py.check_string_dtype(ds.dtype) is not None:
        ds = ds.asstr()
    return ds[:rows] if rows is not None else ds[()]


def _to_python(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.dtype.kind in "OS":
        return [v.decode() if isinstance(v, bytes) else v for v in value.tolist()]
    return value


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


def ended_without_status(log: RunLog, now: float | None = None) -> str | None:
    """Why a log whose status is still ``running`` has no live writer, or None.

    Decided from the root attributes the writer keeps: ``writer_pid`` on this host
    no longer running, or no flush (``flushed_at``) for longer than the run's
    ``runtime.round_timeout`` (a live run flushes every round or aborts).
    """
    if log.status != "running":
        return None
    host, pid = log.attrs.get("writer_host"), log.attrs.get("writer_pid")
    if host == socket.gethostname() and pid is not None and not pid_alive(int(pid)):
        return (f"ended without a final status: its writer (pid {pid} on {host}) is gone "
                "(killed, or out of memory)")
    flushed = log.attrs.get("flushed_at")
    section = log.config.get("runtime")
    runtime: dict = section if isinstance(section, dict) else {}
    try:
        timeout = float(runtime.get("round_timeout", 600.0))
    except (TypeError, ValueError):
        timeout = 600.0
    if flushed is None:
        return None
    age = (time.time() if now is None else now) - float(flushed)
    if age > timeout:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(flushed)))
        return (f"ended without a final status: last written {when}, {age:.0f} s ago "
                f"(> runtime.round_timeout = {timeout:g} s)")
    return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
