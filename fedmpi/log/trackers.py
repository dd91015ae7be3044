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
"""
from __future__ import annotations

import abc

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

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


class Tracker(abc.ABC):
    """A view of the log rows in some tool: :meth:`log` per round, :meth:`close` at the end."""

    @abc.abstractmethod
    def log(self, row: RoundRow) -> None:
        """Write one round row (:mod:`fedmpi.log.row`)."""

    def close(self, status: str = "completed") -> None:
        pass


class TensorBoardTracker(Tracker):
    """Scalars into TensorBoard event files in ``directory`` (step = round)."""

    def __init__(self, directory: str | Path, key: str = "logging.tensorboard") -> None:
        _need("tensorboard", "tensorboard", key)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def log(self, row: RoundRow) -> None:
        for name, v in _points(row).items():
            self.writer.add_scalar(name, v, global_step=row.round)
        self.writer.flush()

    def close(self, status: str = "completed") -> None:
        self.writer.close()


_MLFLOW_STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


class MLflowTracker(Tracker):
    """One MLflow run (through ``MlflowClient``: no process-global active run)."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str,
                 params: Mapping[str, Any] = {}, key: str = "logging.mlflow") -> None:
        _need("mlflow", "mlflow", key)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        try:
            self.client = MlflowClient(tracking_uri=tracking_uri)
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp is not None else \
                self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        except Exception as exc:  # noqa: BLE001 - a bad URI or store: one line naming the key
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"{key}: MLflow cannot open tracking URI {tracking_uri!r}: "
                              f"{first}") from None
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):     # MLflow's batch limit
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, row: RoundRow) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, row.round) for k, v in _points(row).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, status: str = "completed") -> None:
        if status == "running":   # `fedmpi export` of a live log: the run is not over
            return
        self.client.set_terminated(self.run_id, _MLFLOW_STATUS[status])


def check_trackers(cfg: Config) -> None:
    """ConfigError (exit 2) naming the extra when a requested tracker is not installed."""
    if cfg.logging.tensorboard is not None:
        _need("tensorboard", "tensorboard", "logging.tensorboard")
    if cfg.logging.mlflow.tracking_uri is not None:
        _need("mlflow", "mlflow", "logging.mlflow.tracking_uri")


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
    from fedmpi.job.outputs import claim
    from fedmpi.job.safefile import replacing

    if csv is not None:
        claim([csv], overwrite, "fedmpi export --csv")
    log = read(log_path)
    sites = site_metrics(log)
    name = (log.config or {}).get("name") or Path(log_path).parent.name
    trackers: list[tuple[str, Tracker]] = []
    if tensorboard is not None:
        trackers.append((f"TensorBoard events in {tensorboard}",
                         TensorBoardTracker(tensorboard, key="--tensorboard")))
    if mlflow is not None:
        ml = MLflowTracker(mlflow, experiment, name, flatten_config(log.config or {}),
                           key="--mlflow")
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
        Path(csv).parent.mkdir(parents=True, exist_ok=True)
        with replacing(csv, "w") as f:   # never through a planted link; whole or not at all
            frame.to_csv(f, index=False)
        done.append(f"CSV table {csv}")
    return done
