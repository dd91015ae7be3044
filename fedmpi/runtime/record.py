"""Log rows of a round and its timing (rank 0).

One :class:`~fedmpi.log.row.RoundRow` per round: the framework's scalars (test metrics,
train loss, timing split, bytes), its per-client arrays (selected, weight, excluded,
loss, steps, time, and the components' declared per-client values from the metadata
rows) and everything the components reported through their reporters
(:mod:`fedmpi.log.row`). With overlapped evaluation a round's row is *pending* until
its evaluation ran during the next round; :meth:`RoundRecorder.finish_pending` completes
it. A finished row goes to the HDF5 log and to every listener (the best model, the
trackers, early stopping, the user's callbacks: :mod:`fedmpi.runtime.callbacks`).

Timing (rank 0's ``time.perf_counter``): ``wall_seconds`` runs from the end of the
previous round's timed part (so it includes recording that round: its row built and
appended, the loop's heartbeat) to the end of this round's aggregation (and of its
evaluation unless overlapped); a checkpoint is not part of any round. ``train_seconds``
is the slowest rank's local work; ``aggregate_seconds`` includes FedVG scoring after the
last client arrived; ``overhead_seconds`` is the rest, split by :func:`overhead_parts`
into the measured :data:`OVERHEAD_PARTS` and a named remainder.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from fedmpi.log.row import Event, Reports, RoundRow
from fedmpi.runtime.server import (META_FIELDS, M_LOSS, M_SEEN, M_STEPS, M_TIME, ServerResult,
                                   Uplink)

if TYPE_CHECKING:  # annotations only: h5py is imported when rank 0 opens the log
    from fedmpi.log.writer import LogWriter


#: The parts of ``overhead_seconds`` (the /rounds columns; docs/hdf5-log.md): waiting for
#: the slowest rank beyond its training, moving bytes, encoding/decoding, recording the
#: previous round, rank 0's own work the workers waited for, and the unattributed rest.
OVERHEAD_PARTS = ("wait_seconds", "comm_seconds", "codec_seconds", "record_seconds",
                  "busy_seconds", "other_seconds")


@dataclass
class RoundSpans:
    """Rank 0's measured seconds of the calls of one round (0 where a call did not run).

    Attributes:
        record: from the end of the previous round's timed part to this round's start
            (the previous row built and appended, the trackers and callbacks, the loop).
        plan: rank 0 deciding the header (the method's downlink extras).
        header: the header ``Bcast`` (rank 0 waits there for the workers to arrive).
        codec_header: an uplink codec's handshake inside the header call (round 0).
        state: the θ ``Bcast``.
        pre: rank 0's work while the workers start training (the overlapped evaluation
            of the previous round and its row, the server rule's start of the round).
        local: rank 0's own clients (world size 1).
        close: the stop-signal max, the streamed rows and the metadata ``Allreduce``
            that closes the uplink: rank 0 waits there for the slowest worker.
        arrival: server work after the last row arrived (inside ``close``; it is
            aggregation).
        after: the rest of the uplink's close (statistics ``Reduce``, ``Gatherv``, the
            uplink record).
        codec: an uplink codec's (or a narrow wire type's) work inside ``after``.
    """

    record: float = 0.0
    plan: float = 0.0
    header: float = 0.0
    codec_header: float = 0.0
    state: float = 0.0
    pre: float = 0.0
    local: float = 0.0
    close: float = 0.0
    arrival: float = 0.0
    after: float = 0.0
    codec: float = 0.0


def overhead_parts(overhead: float, train: float, s: Optional[RoundSpans]) -> dict[str, float]:
    """``overhead_seconds`` split into :data:`OVERHEAD_PARTS` from rank 0's measured spans.

    The workers train inside rank 0's *window* W = state + pre + local + close − arrival
    (from the θ ``Bcast`` to the closed uplink). Of W, the slowest worker's training
    ``train`` is training; the rest, B = max(0, W − train), is attributed in order:
    rank 0's own work that outlasted the training, busy_w = min(B, max(0, pre + local −
    train)); the θ ``Bcast`` (never overlapped: the workers train after it),
    min(B − busy_w, state); waiting for the slowest worker, the rest of B. Then

    * ``wait_seconds`` = header − codec_header + (B − busy_w − θ Bcast part);
    * ``comm_seconds`` = θ Bcast part + after − codec;
    * ``codec_seconds`` = codec_header + codec;
    * ``record_seconds`` = record; ``busy_seconds`` = plan + busy_w;
    * ``other_seconds`` = overhead − the sum of the five (the calls between the timed
      ones: the round's bookkeeping, Python). Should the five exceed ``overhead`` (a
      worker's clock measuring a little more training than rank 0's window held), they
      are scaled down to sum to it and ``other_seconds`` is 0.

    Without spans (the deadline and buffered rounds) the five are NaN and
    ``other_seconds`` = overhead.
    """
    if s is None:
        return {**dict.fromkeys(OVERHEAD_PARTS[:-1], math.nan), "other_seconds": overhead}
    window = s.state + s.pre + s.local + s.close - s.arrival
    beyond = max(0.0, window - train)
    busy = min(beyond, max(0.0, s.pre + s.local - train))
    state = min(beyond - busy, s.state)
    parts = {"wait_seconds": max(0.0, s.header - s.codec_header) + beyond - busy - state,
             "comm_seconds": state + max(0.0, s.after - s.codec),
             "codec_seconds": s.codec_header + s.codec,
             "record_seconds": s.record,
             "busy_seconds": s.plan + busy}
    named = sum(parts.values())
    if named > overhead:
        scale = overhead / named if named > 0 else 0.0
        parts = {k: v * scale for k, v in parts.items()}
    parts["other_seconds"] = max(0.0, overhead - sum(parts.values()))
    return parts


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
            bytes_up: int, bytes_down: int, encoded: tuple[int, int] = (0, 0),
            spans: Optional[RoundSpans] = None) -> RoundRow:
        """Round ``up.round``'s row with the components' reports of the round; ``times``
        has start, agg, eval, end and exposed arrival. ``bytes_up``/``bytes_down``: what
        every rank together handed MPI in the round's exchange; ``encoded``: Σ over the
        participants of each one's update and model at their encoded sizes (what a
        deployment with one site per client would send); ``spans``: rank 0's measured
        calls, which split the overhead (:func:`overhead_parts`)."""
        meta, mask, accepted = up.meta, up.mask, result.accepted
        seen = meta[accepted, M_SEEN].sum()
        per_worker = np.bincount(self.host, weights=meta[:, M_TIME], minlength=self.size)
        train_seconds = float(per_worker.max())
        wall = times["end"] - times["start"]
        agg_seconds = times["eval"] - times["agg"] + times["arrival"]
        eval_seconds = times["end"] - times["eval"]
        overhead = max(0.0, wall - train_seconds - agg_seconds - eval_seconds)
        scalars = {
            "test_accuracy": float("nan"), "test_loss": float("nan"),
            "train_loss": meta[accepted, M_LOSS].sum() / seen if seen else float("nan"),
            "wall_seconds": wall, "bytes_up": bytes_up, "bytes_down": bytes_down,
            "bytes_up_encoded": encoded[0], "bytes_down_encoded": encoded[1],
            "train_seconds": train_seconds, "aggregate_seconds": agg_seconds,
            "eval_seconds": eval_seconds,
            "overhead_seconds": overhead, **overhead_parts(overhead, train_seconds, spans),
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
