"""Experiment trackers: TensorBoard and MLflow as live views of the HDF5 log.

The HDF5 log (:mod:`fedmpi.log`) is the record of a run; a tracker shows the
same numbers in the tool a team already watches. Both are optional extras,
imported only when asked for (a missing one is a one-line error naming the
extra):

* ``logging.tensorboard: DIR`` (``pip install 'fedmpi[tensorboard]'``) —
  ``torch.utils.tensorboard.SummaryWriter`` event files in DIR;
* ``logging.mlflow: {tracking_uri, experiment}`` (``pip install
  'fedmpi[mlflow]'``) — one MLflow run in that experiment (created if missing),
  named after the run, with the resolved config as its parameters and status
  FINISHED / FAILED / KILLED as the log's.

Live, rank 0 logs each round's row after it is written to the HDF5 log
(:mod:`fedmpi.runtime.callbacks`): every finite ``/rounds`` scalar under its own name
(``test_accuracy``, ``auroc``, ``train_loss``, ``wall_seconds``, ...) at step
= round, and, with per-site evaluation (``eval.where``), every client's metric
as ``clients/<metric>/<k>``. Rounds that were not evaluated carry no test
point (NaN is not logged). ``fedmpi export LOG.h5 --tensorboard DIR |
--mlflow URI | --csv FILE`` writes the same views from a finished log
(:func:`export`), so a run without trackers can still be looked at in them.

Bad tracker settings are bad input, found before the run writes anything
(:func:`check_trackers`, exit 2 naming the key): a TensorBoard directory that is a
file or cannot be created or written, an MLflow server that does not accept a
connection (one attempt of :data:`PROBE_SECONDS`, instead of MLflow's own retries,
about 4 minutes). fedmpi's MLflow requests retry at most twice, 20 s each
(:data:`MLFLOW_HTTP_BOUNDS`, unless the ``MLFLOW_HTTP_REQUEST_*`` variables are set).
A tracker that fails during the run (server gone, disk full) is reported in one line
and dropped: the HDF5 log goes on recording every round. ``fedmpi export`` instead
fails (exit 2 naming the flag): it must not report a view it did not write.
"""
from __future__ import annotations

import abc
import contextlib
import math
import os
import socket
import sys
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from fedmpi.errors import ConfigError
from fedmpi.log.row import RoundRow
from fedmpi.config.core import Config

__all__ = ["MLflowTracker", "TensorBoardTracker", "Tracker", "check_trackers", "export",
           "open_trackers",
           "site_metrics"]


def _need(module: str, extra: str, key: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{key} needs the optional extra: pip install 'fedmpi[{extra}]'") \
            from None


def _points(row: RoundRow) -> dict[str, float]:
    """The finite numbers of one round row: its scalars, every non-boolean per-client value
    as ``clients/<name>/<k>`` and every one-dimensional per-round array (a component's
    per-client column such as ``rule/trimmed``) as ``<group>/<name>/<i>``."""
    out = {k: float(v) for k, v in row.scalars.items()
           if k != "round" and v is not None and math.isfinite(float(v))}
    series = [(f"clients/{name}", a) for name, a in row.clients.items()]
    series += [(name, a) for name, a in row.arrays.items()]
    for name, a in series:
        a = np.asarray(a)
        if a.ndim != 1 or a.dtype == bool:
            continue
        for k, v in enumerate(a.astype(np.float64)):
            if math.isfinite(v):
                out[f"{name}/{k}"] = float(v)
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Tracker(abc.ABC):
    """A view of the log rows in some tool: :meth:`log` per round, :meth:`close` at the end.

    ``key`` names the setting in messages; ``live`` (a run's tracker): a failure while
    logging is reported once and the tracker is dropped (``lost`` says why); otherwise
    (``fedmpi export``) it raises :class:`ConfigError` naming ``key``."""

    key: str = ""
    live: bool = True
    lost: Optional[str] = None

    def log(self, row: RoundRow) -> None:
        """Write one round row (:mod:`fedmpi.log.row`)."""
        self._guard(f"at round {row.round}", lambda: self._log(row))

    def close(self, status: str = "completed") -> None:
        self._guard("at the end of the run", lambda: self._close(status))

    @abc.abstractmethod
    def _log(self, row: RoundRow) -> None:
        """The tool's own writes of one round."""

    def _close(self, status: str) -> None:
        pass

    def _guard(self, when: str, call: Callable[[], None]) -> None:
        if self.lost is not None:
            return
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - any failure of the tool: one line
            if not self.live:
                raise ConfigError(f"{self.key}: writing failed {when}: {_first_line(exc)}"
                                  ) from None
            self.lost = f"{type(exc).__name__}: {_first_line(exc)}"
            print(f"fedmpi: warning: {self.key}: stopped working {when} ({self.lost}); "
                  "dropped for the rest of the run; the HDF5 log records every round",
                  file=sys.stderr, flush=True)


def check_directory(directory: str | Path, key: str) -> Path:
    """``directory`` created (with its parents) and writable, else a one-line
    :class:`~fedmpi.errors.UserError` naming ``key`` (a file there, a parent that is a
    file, no permission, a read-only or pseudo file system)."""
    from fedmpi.job.rundir import output_dir

    return output_dir(directory, f"{key} directory")


class TensorBoardTracker(Tracker):
    """Scalars into TensorBoard event files in ``directory`` (step = round)."""

    def __init__(self, directory: str | Path, key: str = "logging.tensorboard",
                 live: bool = True) -> None:
        self.key, self.live = key, live
        _need("tensorboard", "tensorboard", key)
        from torch.utils.tensorboard import SummaryWriter

        check_directory(directory, key)
        try:
            self.writer = SummaryWriter(log_dir=str(directory))
        except OSError as exc:
            raise ConfigError(f"{key}: cannot write TensorBoard events in {directory} "
                              f"({exc.strerror or _first_line(exc)})") from None

    def _log(self, row: RoundRow) -> None:
        for name, v in _points(row).items():
            self.writer.add_scalar(name, v, global_step=row.round)
        self.writer.flush()

    def _close(self, status: str) -> None:
        self.writer.close()


_MLFLOW_STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}

#: Seconds the one connection attempt to an MLflow server may take (:func:`check_reachable`).
PROBE_SECONDS = 10.0
#: MLflow's HTTP client settings for fedmpi's requests, where the user has not set them:
#: at most 2 retries 1 s and 2 s apart, 20 s per request (MLflow's defaults, 7 retries
#: with back-off factor 2 and 120 s, hold an unreachable server for about 4 minutes).
MLFLOW_HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                      "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                      "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


@contextlib.contextmanager
def _bounded_http() -> Iterator[None]:
    """MLflow requests inside run with :data:`MLFLOW_HTTP_BOUNDS` (MLflow reads the
    variables at each request; the user's own settings are left as they are)."""
    added = [k for k in MLFLOW_HTTP_BOUNDS if k not in os.environ]
    os.environ.update({k: MLFLOW_HTTP_BOUNDS[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def check_experiment_name(name: str, key: str) -> None:
    """MLflow's rule for an experiment name (non-empty, at most 500 characters), checked
    before anything is written."""
    if not name.strip() or len(name) > 500:
        raise ConfigError(f"{key}: MLflow needs an experiment name of 1 to 500 characters, "
                          f"got {name[:40]!r}{'...' if len(name) > 40 else ''}")


def check_reachable(tracking_uri: str, key: str) -> None:
    """An ``http(s)`` tracking URI: its server must accept one TCP connection within
    :data:`PROBE_SECONDS` — else :class:`ConfigError` naming ``key`` at once. Other
    URIs (local ``file:``/``sqlite:`` stores, ``databricks``) are left to MLflow."""
    parts = urllib.parse.urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https"):
        return
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:   # a port that is no number
        raise ConfigError(f"{key}: {tracking_uri!r} is not a URL ({exc})") from None
    if not host:
        raise ConfigError(f"{key}: {tracking_uri!r} names no host")
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS):
            pass
    except OSError as exc:
        reason = exc.strerror or (type(exc).__name__ if not str(exc) else _first_line(exc))
        raise ConfigError(f"{key}: MLflow tracking server {tracking_uri!r} cannot be reached "
                          f"({reason}; one attempt, {PROBE_SECONDS:g} s): start it or fix the "
                          "URI") from None


class MLflowTracker(Tracker):
    """One MLflow run (through ``MlflowClient``: no process-global active run)."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str,
                 params: Mapping[str, Any] = {}, key: str = "logging.mlflow",
                 live: bool = True, experiment_key: str = "logging.mlflow.experiment") -> None:
        self.key, self.live = key, live
        _need("mlflow", "mlflow", key)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        check_experiment_name(experiment, experiment_key)
        check_reachable(tracking_uri, key)
        blame = key   # the setting a failure is about: the store, then the experiment
        try:
            with _bounded_http():
                self.client = MlflowClient(tracking_uri=tracking_uri)
                exp = self.client.get_experiment_by_name(experiment)
                blame = experiment_key
                if exp is not None and exp.lifecycle_stage == "deleted":
                    raise ValueError(f"experiment {experiment!r} is deleted in {tracking_uri!r} "
                                     "(restore it, or choose another name)")
                exp_id = exp.experiment_id if exp is not None else \
                    self.client.create_experiment(experiment)
                self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
                items = [Param(k, str(v)[:6000]) for k, v in params.items()]
                for i in range(0, len(items), 100):     # MLflow's batch limit
                    self.client.log_batch(self.run_id, params=items[i:i + 100])
        except Exception as exc:  # noqa: BLE001 - a bad URI, store or experiment: one line
            what = f"tracking URI {tracking_uri!r}" if blame == key else \
                f"experiment {experiment!r}"
            raise ConfigError(f"{blame}: MLflow cannot use {what}: {_first_line(exc)}") from None

    def _log(self, row: RoundRow) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, row.round) for k, v in _points(row).items()]
        with _bounded_http():
            for i in range(0, len(metrics), 1000):
                self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def _close(self, status: str) -> None:
        if status == "running":   # `fedmpi export` of a live log: the run is not over
            return
        with _bounded_http():
            self.client.set_terminated(self.run_id, _MLFLOW_STATUS[status])


def check_trackers(cfg: Config) -> None:
    """Bad tracker settings as one-line bad input (exit 2) naming the key, before the run
    writes anything: a missing extra, a TensorBoard directory that cannot be written, an
    MLflow server that cannot be reached."""
    if cfg.logging.tensorboard is not None:
        _need("tensorboard", "tensorboard", "logging.tensorboard")
        check_directory(cfg.logging.tensorboard, "logging.tensorboard")
    if cfg.logging.mlflow.tracking_uri is not None:
        _need("mlflow", "mlflow", "logging.mlflow.tracking_uri")
        check_experiment_name(cfg.logging.mlflow.experiment, "logging.mlflow.experiment")
        check_reachable(cfg.logging.mlflow.tracking_uri, "logging.mlflow.tracking_uri")


def open_trackers(cfg: Config, run_name: Optional[str] = None) -> list[Tracker]:
    """The trackers ``logging.*`` of ``cfg`` asks for (rank 0; empty list when none)."""
    from fedmpi.compare.runs import flatten_config

    out: list[Tracker] = []
    try:
        if cfg.logging.tensorboard is not None:
            out.append(TensorBoardTracker(cfg.logging.tensorboard))
        ml = cfg.logging.mlflow
        if ml.tracking_uri is not None:
            out.append(MLflowTracker(ml.tracking_uri, ml.experiment, run_name or cfg.name,
                                     flatten_config(cfg.to_dict()),
                                     key="logging.mlflow.tracking_uri"))
    except BaseException:
        for tracker in out:   # the ones already open (an event file) are closed, not leaked
            tracker.close("failed")
        raise
    return out


def site_metrics(log: Any) -> list[str]:
    """The ``/clients/<metric>`` arrays of a per-site evaluation in ``log``."""
    from fedmpi.metrics import extra_names

    cfg = log.config or {}
    extra = extra_names((cfg.get("eval") or {}).get("metrics") or [])
    return [m for m in ("test_loss", "test_accuracy", *extra, "test_samples") if m in log.clients
            and np.ndim(log.clients[m]) == 2]


def log_rows(log: Any) -> list[RoundRow]:
    """The round rows of a read log, as the trackers saw them live."""
    rows = []
    for i, t in enumerate(log.rounds.get("round", [])):
        rows.append(RoundRow(int(t), {k: float(v[i]) for k, v in log.rounds.items() if k != "round"},
                             {k: v[i] for k, v in log.clients.items() if np.ndim(v) == 2},
                             {k: log.arrays[k][i] for k in sorted(log.per_round)}))
    return rows


def export(log_path: str | Path, tensorboard: Optional[str] = None, mlflow: Optional[str] = None,
           csv: Optional[str] = None, experiment: str = "fedmpi",
           overwrite: bool = False) -> list[str]:
    """Write the views of a finished (or running) log; returns what was written.

    An existing ``csv`` is replaced only with ``overwrite`` (checked before anything is
    written; :func:`fedmpi.job.outputs.claim`); TensorBoard adds new event files and MLflow a
    new run, so neither replaces anything.
    """
    from fedmpi.compare.runs import flatten_config
    from fedmpi.log.reader import read
    from fedmpi.job.outputs import claim, write_failed
    from fedmpi.job.safefile import replacing

    if csv is not None:   # every target checked before anything is written
        if Path(csv).is_dir():
            raise ConfigError(f"--csv {csv}: is a directory; name the file to write")
        check_directory(Path(csv).parent, "--csv")
        claim([csv], overwrite, "fedmpi export --csv")
    log = read(log_path)
    sites = site_metrics(log)
    name = (log.config or {}).get("name") or Path(log_path).parent.name
    trackers: list[tuple[str, Tracker]] = []
    if tensorboard is not None:
        trackers.append((f"TensorBoard events in {tensorboard}",
                         TensorBoardTracker(tensorboard, key="--tensorboard", live=False)))
    if mlflow is not None:
        ml = MLflowTracker(mlflow, experiment, name, flatten_config(log.config or {}),
                           key="--mlflow", live=False, experiment_key="--experiment")
        trackers.append((f"MLflow run {ml.run_id} at {mlflow}", ml))
    for row in log_rows(log):
        for _, tr in trackers:
            tr.log(row)
    for _, tr in trackers:
        tr.close(log.status)
    done = [what for what, _ in trackers]
    if csv is not None:
        frame = log.rounds_frame()
        frame = frame[["round", *(c for c in frame.columns if c != "round")]]
        for m in sites:
            for k in range(log.clients[m].shape[1]):
                frame[f"clients/{m}/{k}"] = log.clients[m][:, k]
        try:
            with replacing(csv, "w") as f:   # never through a planted link; whole or not at all
                frame.to_csv(f, index=False)
        except OSError as exc:   # a full disk: exit 1 naming the file (the old one intact)
            raise write_failed(csv, exc) from None
        done.append(f"CSV table {csv}")
    return done
