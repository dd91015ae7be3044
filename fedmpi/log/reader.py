"""Reading a run log: :func:`read` → :class:`RunLog`, also of a log a live run is
still writing.

A log is untrusted input: before any data is read the schema is checked, and datasets
stored outside the file or declaring far more than the file holds are refused; shapes
and dtypes are checked after reading (:class:`~fedmpi.errors.LogFormatError` naming the
file and dataset). :func:`ended_without_status` tells a ``running`` log whose writer is
gone. The layout is documented in :mod:`fedmpi.log`.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np
import yaml

from fedmpi.errors import LogFormatError
from fedmpi.job.lock import pid_alive

from fedmpi.log.schema import (EVENT_DTYPES, PathLike, all_datasets, check_schema, load_dataset,
    read_events, round_series, to_python)

if TYPE_CHECKING:
    import pandas

__all__ = ["RunLog", "as_run_log", "ended_without_status", "read"]


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
    #: the keys of :attr:`arrays` that have a round axis (the others are static)
    per_round: frozenset[str] = frozenset()

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
    check_schema(f, path)
    _check_storage(f, path)
    attrs = {name: to_python(value) for name, value in f.attrs.items()}
    config = yaml.safe_load(attrs["config_yaml"]) or {}
    if not isinstance(config, dict):
        raise LogFormatError(f"{path}: attribute config_yaml is not a YAML mapping")

    series = round_series(f)
    num_rounds = min((len(ds) for ds in series.values()), default=0)
    rounds: dict[str, np.ndarray] = {}
    clients: dict[str, np.ndarray] = {}
    arrays: dict[str, np.ndarray] = {}
    for key, ds in all_datasets(f).items():
        group, _, name = key.partition("/")
        if group == "events":
            continue
        data = load_dataset(ds, num_rounds if key in series else None)
        if group == "rounds":
            rounds[name] = data
        elif group == "clients":
            clients[name] = data
        else:
            arrays[key] = data
    _check_shapes(path, rounds, clients, num_rounds)
    events = read_events(f["events"]) if "events" in f else {
        name: np.empty(0, dtype=object if name == "message" else np.int64)
        for name in EVENT_DTYPES}
    return RunLog(path=path, attrs=attrs, config=config, rounds=rounds, clients=clients,
                  arrays=arrays, events=events, per_round=frozenset(k for k in arrays if k in series))


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
    for key, ds in all_datasets(f).items():
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


