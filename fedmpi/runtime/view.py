"""The narrow views of one rank that code outside the round loop gets.

The round loop (:class:`~fedmpi.runtime.federation.Federation`) keeps its own state private
and shows a declared few attributes (:data:`~fedmpi.runtime.federation.PUBLIC`). What the
others need:

* the **driver**: :meth:`Federation.round`, the log (:class:`~fedmpi.runtime.record.RoundRecorder`),
  the run's :class:`RunStatus`, the checkpoint's :class:`~fedmpi.job.checkpoint.RunState`;
* **plug-ins that run on every rank** — the final evaluations
  (:class:`~fedmpi.runtime.evaluation.FinalEvaluation`, e.g. cross-site validation) — and
  tests of a running federation: a :class:`RankView`, i.e. the rank's built parts, θ and
  the downlink, the client template (:class:`~fedmpi.runtime.worker.Worker`), the evaluation
  and the exchange's state message;
* **rank 0's listeners** (best model, trackers, early stopping, callbacks): only the
  round's row (:mod:`fedmpi.runtime.callbacks`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

if TYPE_CHECKING:
    from fedmpi.comm.world import Comm
    from fedmpi.log.writer import LogWriter
    from fedmpi.runtime.build import Built
    from fedmpi.runtime.evaluation import Evaluation, Scalars
    from fedmpi.runtime.exchange import Exchange
    from fedmpi.runtime.record import RoundRecorder
    from fedmpi.runtime.worker import Worker


@dataclass
class RunStatus:
    """How the run stands: rank 0 decides, the headers tell every rank what follows.

    Attributes:
        stop_reason: why the run stops before ``train.rounds`` (a signal: ``SIGTERM on
            rank 2``), None while it goes on.
        finished_early: a completed stop before ``train.rounds`` (a stage's budget).
        failure: the line the run fails with (rank 0), None unless it failed.
        checkpoint_round: rounds < this are in the newest checkpoint.
    """

    stop_reason: Optional[str] = None
    finished_early: Optional[str] = None
    failure: Optional[str] = None
    checkpoint_round: int = 0


class RankView:
    """One rank of a run as a plug-in sees it (module docstring)."""

    def __init__(self, built: Built, comm: Comm, exchange: Exchange, worker: Worker,
                 evaluation: Evaluation, log: RoundRecorder) -> None:
        self.built, self.comm, self.worker, self.evaluation = built, comm, worker, evaluation
        self._exchange, self._log = exchange, log
        self._D = built.flat.size
        #: per-client values of the last :meth:`evaluate` (rank 0)
        self.site_metrics: dict[str, np.ndarray] = {}

    @property
    def is_server(self) -> bool:
        return self.built.rank == 0

    @property
    def state(self) -> torch.Tensor:
        """θ on this rank's device (on workers: as of the last state message)."""
        return self._exchange.downlink[: self._D]

    @property
    def extras(self) -> torch.Tensor:
        """The method's downlink extras sent with θ."""
        return self._exchange.downlink[self._D:]

    @property
    def writer(self) -> Optional[LogWriter]:
        """Rank 0's log (None elsewhere, or before it opens)."""
        return self._log.writer

    def send_state(self, t: int) -> None:
        """Collective: θ ‖ extras from rank 0 to every rank, as round ``t``'s state message."""
        self._exchange.send_state(t)

    def evaluate(self) -> Scalars:
        """``test_loss``, ``test_accuracy`` and the other ``eval.metrics`` of the global
        model now, where ``eval.where`` says (the names of the log's ``/rounds``).

        * ``server`` — rank 0's test set (the method's own evaluation where it has one),
          on the calling rank alone: no messages, any rank may call it.
        * ``clients`` / ``both`` — the per-site evaluation of the run (rank 0 holds no
          test data under ``clients``): every client evaluates θ on its held-out samples
          on the rank hosting it and rank 0 combines them (docs/evaluation.md). This is a
          **collective**: call it on every rank, as :meth:`Federation.round` is (a call on
          rank 0 alone waits for the workers). Rank 0 returns the combined values
          (``both``: the test set's, plus ``clients_<metric>``) and keeps each client's
          values in :attr:`site_metrics` (``{metric: [K] array}``, ``test_samples``
          included, as ``/clients/<metric>``); workers return ``{}``.

        Nothing is written to the log: a round's row holds only that round's evaluation.
        """
        b = self.built
        scalars = self.evaluation.now(self.state, b.ctx, b.algo, self._exchange)
        self.site_metrics = self.evaluation.take_sites()
        return scalars
