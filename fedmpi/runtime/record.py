"""Log rows of a round and its timing (rank 0).

One HDF5 row per round (DESIGN.md §5): scalars (test metrics, train loss,
timing split, bytes), per-client arrays (selected, weight, excluded, loss,
steps, time) and the method's, weighting's and transforms' arrays. With
overlapped evaluation a round's row is *pending* until its evaluation ran
during the next round; :meth:`RoundRecorder.finish_pending` completes it.

Timing: ``wall_seconds`` runs from the round's start to the end of its
aggregation (and of its evaluation unless overlapped); ``train_seconds`` is the
slowest rank's local work; ``aggregate_seconds`` includes FedVG scoring after
the last client arrived; ``overhead_seconds`` is the rest.
"""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from fedmpi.runtime.server import M_LOSS, M_SEEN, M_STEPS, M_TIME, ServerResult, Uplink

if TYPE_CHECKING:  # annotations only: h5py is imported when rank 0 opens the log
    from fedmpi.log.writer import LogWriter

Row = tuple[int, dict, dict, dict]


class RoundRecorder:
    """Builds, defers and appends the log rows; keeps the run's history."""

    def __init__(self, host: np.ndarray, world_size: int) -> None:
        self.host, self.size = host, world_size
        self.writer: Optional[LogWriter] = None    # opened by the driver (rank 0)
        self.history: list[dict] = []
        self.pending: Optional[Row] = None
        #: rank 0's listeners (fedmpi.runtime.callbacks.AfterRound): (round, scalars, per-client)
        #: -> a stop request or None
        self.after: Optional[Callable[[int, dict, dict], Optional[str]]] = None
        self.stop_request: Optional[str] = None

    def event(self, t: int, rank: int, client: int, message: str, echo: bool = True) -> None:
        """Log an event (and print it, unless ``echo`` is False: a failure whose one
        error line the driver prints)."""
        if self.writer is not None:
            self.writer.event(t, rank, client, message)
        if echo:
            who = f"client {client}: " if client >= 0 else ""   # -1: a run-level message
            print(f"fedmpi: round {t}: {who}{message}", file=sys.stderr, flush=True)

    def row(self, up: Uplink, result: ServerResult, times: dict[str, float],
            bytes_up: int, bytes_down: int, arrays: dict) -> Row:
        """Round ``up.round``'s row; ``times`` has start, agg, eval, end and exposed arrival."""
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
        return up.round, scalars, per_client, {**arrays, **result.client_arrays}

    def append(self, row: Row) -> None:
        t, scalars, per_client, arrays = row
        self.history.append({"round": t, **scalars})
        if self.writer is not None:
            self.writer.append_round(t, scalars, per_client, arrays)
        if self.after is not None:
            reason = self.after(t, scalars, per_client)
            if reason and self.stop_request is None:
                self.stop_request = reason
                self.event(t, 0, -1, f"stop requested ({reason}); checkpoint and finish")

    def finish_pending(self, evaluate: Callable[[int], dict[str, float]]) -> None:
        """Evaluate the pending round's model and append its row. The state still holds
        that round's θ: it changes only at the next aggregation, and this runs before it.
        ``wall_seconds`` of that round excludes this evaluation; ``eval_seconds`` is it."""
        if self.pending is None:
            return
        t, scalars, per_client, arrays = self.pending
        self.pending = None
        t0 = time.perf_counter()
        scalars.update(evaluate(t), eval_seconds=time.perf_counter() - t0)
        self.append((t, scalars, per_client, arrays))
