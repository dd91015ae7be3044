"""Log rows of a round and its timing (rank 0).

One :class:`~fedmpi.log.row.RoundRow` per round: the framework's scalars (test metrics,
train loss, timing split, bytes), its per-client arrays (selected, weight, excluded,
loss, steps, time, and the components' declared per-client values from the metadata
rows) and everything the components reported through their reporters
(:mod:`fedmpi.log.row`). With overlapped evaluation a round's row is *pending* until
its evaluation ran during the next round; :meth:`RoundRecorder.finish_pending` completes
it. A finished row goes to the HDF5 log and to every listener (the best model, the
trackers, early stopping, the user's callbacks: :mod:`fedmpi.runtime.callbacks`).

Timing: ``wall_seconds`` runs from the round's start to the end of its
aggregation (and of its evaluation unless overlapped); ``train_seconds`` is the
slowest rank's local work; ``aggregate_seconds`` includes FedVG scoring after
the last client arrived; ``overhead_seconds`` is the rest.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from fedmpi.log.row import Event, Reports, RoundRow
from fedmpi.runtime.server import (META_FIELDS, M_LOSS, M_SEEN, M_STEPS, M_TIME, ServerResult,
                                   Uplink)

if TYPE_CHECKING:  # annotations only: h5py is imported when rank 0 opens the log
    from fedmpi.log.writer import LogWriter


class RoundRecorder:
    """Builds, defers and appends the log rows; keeps the run's history."""

    def __init__(self, host: np.ndarray, world_size: int, reports: Reports,
                 evaluate: Optional[Callable[[int], dict[str, float]]] = None) -> None:
        self.host, self.size, self.reports = host, world_size, reports
        self.evaluate = evaluate   # round t's scalars of the current θ (a pending row's)
        self.history: list[dict] = []
        self.pending: Optional[RoundRow] = None
        #: rank 0's listener (fedmpi.runtime.callbacks.AfterRound): row -> a stop request or None
        self.after: Optional[Callable[[RoundRow], Optional[str]]] = None
        self.stop_request: Optional[str] = None

    @property
    def writer(self) -> Optional[LogWriter]:
        return self.reports.writer

    @writer.setter
    def writer(self, writer: Optional[LogWriter]) -> None:
        self.reports.attach(writer)

    def event(self, t: int, rank: int, client: int, message: str, echo: bool = True) -> None:
        """Log an event now (and print it, unless ``echo`` is False: a failure whose one
        error line the driver prints)."""
        self.reports.emit(Event(t, rank, client, message, echo))

    def row(self, up: Uplink, result: ServerResult, times: dict[str, float],
            bytes_up: int, bytes_down: int, encoded: tuple[int, int] = (0, 0)) -> RoundRow:
        """Round ``up.round``'s row with the components' reports of the round; ``times``
        has start, agg, eval, end and exposed arrival. ``bytes_up``/``bytes_down``: what
        every rank together handed MPI in the round's exchange; ``encoded``: Σ over the
        participants of each one's update and model at their encoded sizes (what a
        deployment with one site per client would send)."""
        meta, mask, accepted = up.meta, up.mask, result.accepted
        seen = meta[accepted, M_SEEN].sum()
        per_worker = np.bincount(self.host, weights=meta[:, M_TIME], minlength=self.size)
        train_seconds = float(per_worker.max())
        wall = times["end"] - times["start"]
        agg_seconds = times["eval"] - times["agg"] + times["arrival"]
        eval_seconds = times["end"] - times["eval"]
        scalars = {
            "test_accuracy": float("nan"), "test_loss": float("nan"),
            "train_loss": meta[accepted, M_LOSS].sum() / seen if seen else float("nan"),
            "wall_seconds": wall, "bytes_up": bytes_up, "bytes_down": bytes_down,
            "bytes_up_encoded": encoded[0], "bytes_down_encoded": encoded[1],
            "train_seconds": train_seconds, "aggregate_seconds": agg_seconds,
            "eval_seconds": eval_seconds,
            "overhead_seconds": max(0.0, wall - train_seconds - agg_seconds - eval_seconds),
            "num_accepted": float(accepted.size),
        }
        excluded = np.zeros(mask.shape[0], dtype=bool)
        excluded[result.excluded] = True
        per_client = {
            "selected": mask.copy(), "weight": result.weights, "excluded": excluded,
            "train_loss": np.where(mask, meta[:, M_LOSS] / np.maximum(meta[:, M_SEEN], 1), np.nan),
            "local_steps": np.where(mask, meta[:, M_STEPS], np.nan),
            "train_seconds": np.where(mask, meta[:, M_TIME], np.nan),
        }
        for j, name in enumerate(self.reports.client_columns, start=len(META_FIELDS)):
            per_client[name] = np.where(mask, meta[:, j], np.nan)
        row = RoundRow(up.round, scalars, per_client, dict(result.client_arrays))
        reported, events = self.reports.drain(up.round)
        row.merge(reported)
        for e in events:
            self.reports.emit(e)
        return row

    def append(self, row: RoundRow) -> None:
        self.history.append({"round": row.round, **row.scalars})
        if self.writer is not None:
            self.writer.append_row(row)
        if self.after is not None:
            reason = self.after(row)
            if reason and self.stop_request is None:
                self.stop_request = reason
                self.event(row.round, 0, -1, f"stop requested ({reason}); checkpoint and finish")

    def finish_pending(self) -> None:
        """Evaluate the pending round's model and append its row. The state still holds
        that round's θ: it changes only at the next aggregation, and this runs before it.
        ``wall_seconds`` of that round excludes this evaluation; ``eval_seconds`` is it."""
        if self.pending is None:
            return
        assert self.evaluate is not None, "a row is pending only where rounds are evaluated"
        row, self.pending = self.pending, None
        t0 = time.perf_counter()
        row.scalars.update(self.evaluate(row.round), eval_seconds=time.perf_counter() - t0)
        self.append(row)
