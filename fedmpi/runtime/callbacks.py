"""What rank 0 does after each logged round: callbacks, early stopping, the best model.

After the log row of round t is written, rank 0 hands the round's row
(:class:`~fedmpi.log.row.RoundRow`: the ``/rounds`` scalars ``test_accuracy``,
``test_loss``, the other ``eval.metrics``, ``train_loss``, timing, bytes and every
component's scalars such as ``epsilon``, NaN where not evaluated; the per-client values
and arrays) to every listener, in this order: the best model (``checkpoint.keep_best``),
the experiment trackers (``logging.*``, :mod:`fedmpi.log.trackers`: the whole row),
early stopping (``train.early_stopping``), then the user's callbacks
(:func:`fedmpi.run` ``callbacks=[...]``, which get the scalars).

A **callback** is any callable ``cb(round: int, metrics: Mapping[str, float])``;
returning ``True`` or a non-empty string (the reason) requests a clean stop:
the next round is not started, a checkpoint is written, ``model.pt`` is the
current global model, the log's status is ``completed`` and an event records
who stopped it and why. The same holds for early stopping. With
``eval.overlap`` a round's row (and so the decision) comes one round later; the
stop then takes effect one round later too.

**Early stopping** (``train.early_stopping``: ``metric``, ``mode``,
``patience``, ``min_delta``; PyTorch Lightning's ``EarlyStopping`` rule): a
value v of an evaluated round improves on the best b when
``v > b + min_delta`` (mode ``max``) or ``v < b − min_delta`` (``min``); the
run stops once ``patience`` evaluated rounds in a row did not improve.

**Best model** (``checkpoint.keep_best``: ``metric``, ``mode``): whenever an
evaluated round's value is better than every earlier one (strictly; ties keep
the earlier round), the global model of that round is written to
``best.pt`` beside ``model.pt`` (same format: a ``state_dict``), and the log's
root attributes ``best_round``, ``best_metric`` and ``best_value`` name it.

Both rebuild their state from the log's rows on ``--resume``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from fedmpi.log.row import RoundRow

if TYPE_CHECKING:
    from fedmpi.config.core import Config

__all__ = ["AfterRound", "BestModel", "Callback", "EarlyStopping", "Improvement", "stop_reason"]

Outcome = Union[bool, str, None]


#: ``cb(round, metrics)`` on rank 0 after each logged round; True or a reason stops.
Callback = Callable[[int, Mapping[str, float]], Any]


def stop_reason(outcome: Outcome, who: str) -> Optional[str]:
    """The stop request of a listener's return value (None: go on)."""
    if outcome is None or outcome is False:
        return None
    if isinstance(outcome, str):
        return f"{who}: {outcome}" if outcome else None
    return f"{who} requested a stop" if outcome else None


class Improvement:
    """Tracks the best value of one metric (``mode`` max or min, beyond ``min_delta``)."""

    def __init__(self, metric: str, mode: str, min_delta: float = 0.0) -> None:
        self.metric, self.mode, self.min_delta = metric, mode, float(min_delta)
        self.best = -math.inf if mode == "max" else math.inf
        self.best_round = -1

    def value(self, metrics: Mapping[str, float]) -> Optional[float]:
        """The metric of a row, None when the round was not evaluated."""
        v = metrics.get(self.metric)
        return None if v is None or not math.isfinite(float(v)) else float(v)

    def improves(self, v: float) -> bool:
        if self.mode == "max":
            return v > self.best + self.min_delta
        return v < self.best - self.min_delta

    def observe(self, t: int, metrics: Mapping[str, float]) -> Optional[bool]:
        """None when not evaluated; else whether round ``t`` improved (and is the new best)."""
        v = self.value(metrics)
        if v is None:
            return None
        if self.improves(v):
            self.best, self.best_round = v, t
            return True
        return False


class EarlyStopping:
    """``train.early_stopping`` (module docstring)."""

    def __init__(self, metric: str, mode: str, patience: int, min_delta: float) -> None:
        self.track = Improvement(metric, mode, min_delta)
        self.patience = int(patience)
        self.wait = 0

    def __call__(self, t: int, metrics: Mapping[str, float]) -> Outcome:
        improved = self.track.observe(t, metrics)
        if improved is None:
            return None
        self.wait = 0 if improved else self.wait + 1
        if self.wait >= self.patience:
            tr = self.track
            return (f"{tr.metric} has not improved on {tr.best:.6g} (round {tr.best_round}) by "
                    f"more than {tr.min_delta:g} for {self.wait} evaluated rounds")
        return None


class BestModel:
    """``checkpoint.keep_best``: ``save(round)`` writes ``best.pt`` of the current
    global model when round ``t`` is the best so far (module docstring)."""

    def __init__(self, metric: str, mode: str, save: Callable[[int, float], None]) -> None:
        self.track = Improvement(metric, mode)
        self.save = save
        self.live = True          # False while replaying the log of a resumed run

    def __call__(self, t: int, metrics: Mapping[str, float]) -> Outcome:
        if self.track.observe(t, metrics) and self.live:
            self.save(t, self.track.best)
        return None


class AfterRound:
    """Rank 0's listeners of one run, called by the round recorder after each row
    (module docstring); returns the first stop request."""

    def __init__(self, cfg: Config, save_best: Optional[Callable[[int, float], None]] = None,
                 trackers: Sequence[Any] = (), callbacks: Sequence[Callback] = ()) -> None:
        kb, es = cfg.checkpoint.keep_best, cfg.train.early_stopping
        self.best = BestModel(kb.metric, kb.mode, save_best) \
            if kb.metric is not None and save_best is not None else None
        self.early = EarlyStopping(es.metric, es.mode, es.patience, es.min_delta) \
            if es.metric is not None else None
        self.trackers = list(trackers)
        self.callbacks = list(callbacks)

    def __call__(self, row: RoundRow) -> Optional[str]:
        t, metrics = row.round, dict(row.scalars)
        if self.best is not None:
            self.best(t, metrics)
        for tracker in self.trackers:
            tracker.log(row)
        reasons = []
        if self.early is not None:
            reasons.append(stop_reason(self.early(t, metrics), "early stopping"))
        for cb in self.callbacks:
            reasons.append(stop_reason(cb(t, dict(metrics)), f"callback {_name(cb)}"))
        return next((r for r in reasons if r), None)

    def replay(self, history: Sequence[Mapping[str, float]]) -> None:
        """Rebuild the best value and the early-stopping count from a resumed log's rows
        (nothing written, no tracker or callback called)."""
        if self.best is not None:
            self.best.live = False
        for row in history:
            t = int(row["round"])
            if self.best is not None:
                self.best(t, row)
            if self.early is not None:
                self.early(t, row)
        if self.best is not None:
            self.best.live = True

    def close(self, status: str) -> None:
        for tracker in self.trackers:
            tracker.close(status)


def _name(cb: Any) -> str:
    return getattr(cb, "__qualname__", None) or type(cb).__name__
