"""One rank of a run and its round loop.

Rank 0 is the aggregator; with W = world_size − 1 ≥ 1 workers, client c lives on
rank 1 + c mod W; with world size 1 rank 0 hosts every client itself. Every
rank runs :meth:`Federation.round` in lock-step; the collectives of
:mod:`~fedmpi.runtime.channel` are the only synchronisation. The parts:
:mod:`~fedmpi.runtime.build` (what a rank is made of),
:mod:`~fedmpi.runtime.channel` (messages), :mod:`~fedmpi.runtime.worker`
(local work), :mod:`~fedmpi.runtime.server` (the pure server step: exclusion,
weights, server rule), :mod:`~fedmpi.runtime.evaluation` (policy) and
:mod:`~fedmpi.runtime.record` (log rows and timing).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from fedmpi.comm import Comm
from fedmpi.job import checkpoint, signals
from fedmpi.job.checkpoint_file import checkpoint_path
from fedmpi.data import preprocessing
from fedmpi.job.outputs import write_model
from fedmpi.runtime import guard, silo
from fedmpi.runtime.build import build, participants
from fedmpi.runtime.channel import Channel, plan_uplink
from fedmpi.runtime.evaluation import Evaluation
from fedmpi.runtime.record import RoundRecorder
from fedmpi.runtime.server import (EXCLUDED_BECAUSE, META_FIELDS, STATUS_FAILED, STATUS_RANGE,
                                   STATUS_WITHHELD, ArrivalSum, is_summed, server_step)
from fedmpi.runtime.worker import Worker
from fedmpi.training.loop import LocalTrainer
from fedmpi.usercode import UserCode

if TYPE_CHECKING:
    from fedmpi.config.core import Config

CMD_ROUND, CMD_STOP, CMD_ABORT = 0, 1, 2
# header[2] flags: checkpoint before acting on the command; the stop is an interruption
FLAG_CHECKPOINT, FLAG_INTERRUPTED = 1, 2


class Federation:
    """Sets up one rank of a run and executes rounds (see module docstring)."""

    def __init__(self, cfg: Config, comm: Comm, out_dir: Optional[Path] = None,
                 code: Optional[UserCode] = None) -> None:
        self.cfg, self.comm, self.out_dir = cfg, comm, out_dir
        self.rank, self.size = comm.rank, comm.size
        self.is_server = self.rank == 0
        self.K = cfg.data.num_clients
        self.m = cfg.train.clients_per_round or self.K
        b = build(cfg, comm, plan=lambda t: self.participants(t), code=code)
        self.built = b
        self.ctx, self.device, self.data, self.partition = b.ctx, b.device, b.data, b.partition
        self.flat, self.accel, self.forward = b.flat, b.accel, b.forward
        self.algo, self.weighting, self.transforms, self.stats = b.algo, b.weighting, b.transforms, b.stats
        self.rule, self.server, self.reports = b.rule, b.server, b.reports
        self.num_samples, self.host, self.my_clients = b.num_samples, b.host, b.hosted
        self.D = self.flat.size   # the exchanged state: trainable parameters + float buffers
        self.frozen_digest = b.frozen_digest
        exact = cfg.runtime.reduction == "exact" and self.size > 1
        rows_needed = self.server.rows_needed
        self.uplink_plan = plan_uplink(list(self.stats), rows_needed, exact)
        self.codec = self.transforms.codec(self.my_clients, self.K)
        self.channel = Channel(comm, self.uplink_plan, self.D, self.algo.exchange().downlink,
                               self.K, max_local=min(self.m, len(self.my_clients)), max_rows=self.m,
                               host=self.host, device=self.device, codec=self.codec,
                               meta_fields=len(META_FIELDS) + len(self.reports.client_columns))
        self.state = self.channel.state
        if self.is_server:
            self.state.dev[: self.D].copy_(self.flat.vector)
        self.client_idx = {k: torch.as_tensor(self.partition.client_indices[k], device=self.device)
                           for k in self.my_clients}
        self.trainer = (LocalTrainer(self.flat, self.data, self.accel, self.forward)
                        if self.my_clients else None)
        self.scratch = ({s.name: torch.zeros(s.size, device=self.device) for s in self.stats}
                        if self.my_clients else {})   # one client's uplink, where clients train
        parallel = silo.data_parallel(cfg, comm, self.flat.model, self.device) \
            if self.my_clients else None
        self.worker = Worker(cfg, self.rank, self.algo, self.weighting, self.transforms,
                             self.trainer, self.client_idx, self.scratch, self.reports, parallel)
        tests = self.partition.client_test_indices
        self.evals = Evaluation(cfg, self.rank, self.size, self.algo.spec_for(cfg).owns_evaluation,
                                {k: torch.as_tensor(tests[k], device=self.device)
                                 for k in self.my_clients} if tests else None)
        self.recorder = RoundRecorder(self.host, self.size, self.reports)
        summed = [s for s in self.stats if is_summed(s, rows_needed)]
        self.sum_bufs = ({s.name: torch.zeros(s.size, dtype=torch.float64, device=self.device)
                          for s in summed} if self.is_server and exact else {})
        # runtime.reduction: exact — rank 0 adds the rows in client-id order as they arrive
        self.arrival_sum = (ArrivalSum(list(self.stats), self.weighting.raw, self.sum_bufs)
                            if self.sum_bufs and self.channel.stream_rows else None)
        self.stop_reason: Optional[str] = None   # set by a signal (fedmpi.job.signals)
        self.finished_early: Optional[str] = None   # a completed stop before train.rounds (budget)
        self.checkpoint_round = 0                 # rounds < this are in the newest checkpoint
        self.failure: Optional[str] = None
        self.rounds_without_update = 0            # runtime.max_rounds_without_update
        self.site_metrics: dict[str, np.ndarray] = {}   # per-client values of evaluate()

    # ----------------------------------------------------------- accessors
    @property
    def global_state(self) -> torch.Tensor:
        """θ on rank 0 (parameters and float buffers)."""
        return self.state.dev[: self.D]

    @property
    def history(self) -> list[dict]:
        return self.recorder.history

    @property
    def writer(self):
        return self.recorder.writer

    def log_header(self) -> guard.LogHeader:
        """What the log records about this run besides :meth:`run_state`
        (:func:`~fedmpi.runtime.guard.open_run`)."""
        b = self.built
        return guard.LogHeader(num_samples=self.num_samples,
                               class_counts=self.partition.class_counts, run_info=b.run_info,
                               reports=b.reports)

    def use_log(self, opened: guard.OpenedRun) -> None:
        """Rank 0: record rounds into the log :func:`~fedmpi.runtime.guard.open_run`
        opened, after the rounds it has logged already (resume)."""
        self.recorder.history = opened.history

    @property
    def stream_rows(self) -> bool:
        return self.channel.stream_rows

    def run_state(self) -> checkpoint.RunState:
        """What a checkpoint saves and restores (:class:`fedmpi.job.checkpoint.RunState`):
        θ, the named components (method, weighting, transforms with their own state, server
        rule, RNG streams) and the per-client states of the hosted clients."""
        parts: dict[str, checkpoint.StateOwner] = dict(self.built.components)
        parts["rng"] = checkpoint.RngStreams()
        return checkpoint.RunState(
            cfg=self.cfg, comm=self.comm, num_clients=self.K, host=self.host,
            hosted=self.my_clients, device=self.device, global_state=self.global_state,
            components=parts, clients=self.algo,
            after_resume=lambda t: self.algo.after_resume(self.ctx, t), out_dir=self.out_dir,
            frozen_digest=self.frozen_digest,
            preprocessing=preprocessing.of(self.flat.model) or {})

    def participants(self, t: int) -> np.ndarray:
        """Boolean mask of S_t: m of K clients without replacement, RNG (seed, t)."""
        return participants(self.cfg.seed, self.K, self.m, t)

    # ----------------------------------------------------------------- round
    def round(self, t: int) -> int:
        """Run round ``t`` on this rank; returns the command that was broadcast."""
        t_start = time.perf_counter()
        if self.is_server:
            self._plan(t)
        cmd, flags, mask = self.channel.exchange_header(t)
        if flags & FLAG_INTERRUPTED and self.stop_reason is None:
            self.stop_reason = "interrupted"
        if flags & FLAG_CHECKPOINT:
            self.save_checkpoint(t)
            t_start = time.perf_counter()   # checkpoint time is not part of round t
        if cmd != CMD_ROUND:
            return cmd
        self.channel.broadcast_state(t)
        state, extras = self.state.dev[: self.D], self.state.dev[self.D:]
        self.algo.begin_round(t, mask, state, extras)
        if self.is_server:   # evaluate round t − 1 while the workers train round t
            self.recorder.finish_pending(self._evaluate)
            if self.size > 1:   # and the server rule's work on θ^t alone (FLTrust's g_0)
                self.rule.begin_round(state, t)
        t_train = time.perf_counter()
        if self.arrival_sum is not None:
            self.arrival_sum.start(mask)
        self.worker.run(t, mask, self.my_clients, state, extras, self.channel)
        up = self.channel.collect(t, mask, self.comm.group_max(signals.requested_signum()),
                                  lambda k, row: self._arrived(state, k, row))
        if up is not None:
            if self.arrival_sum is not None:
                up = self.arrival_sum.into(up)
            self._server_round(t, up, t_start, t_train)
        elif self.evals.collective(t):
            self.evals.join(t, state, self.ctx, self.algo, self.channel)
        return CMD_ROUND

    def _arrived(self, state: torch.Tensor, client: int, row: dict[str, torch.Tensor]) -> None:
        """Rank 0: a client's row arrived while others may still train."""
        if self.arrival_sum is not None:
            self.arrival_sum.arrived(client, row)
        self.weighting.on_arrival(state, client, row)

    def _plan(self, t: int) -> None:
        """Rank 0: the round's command, flags and participants into the header."""
        if self.stop_reason is None and signals.requested():
            self.stop_reason = f"{signals.requested()} on rank 0"
            # before any round there is nothing to checkpoint: the driver's line says so
            self.recorder.event(t, 0, -1, f"stop requested ({self.stop_reason}); checkpoint and exit",
                                echo=bool(self.history))
        cmd = CMD_ROUND
        if self.failure is not None:
            cmd = CMD_ABORT
        elif (self.stop_reason is not None or self.recorder.stop_request is not None
              or self.finished_early or t >= self.cfg.train.rounds):   # a signal, early stopping/a callback, the end
            cmd = CMD_STOP
        else:   # a stage may end the run before this round (a budget it keeps)
            self.finished_early = self.transforms.plan_round(t, self.participants(t))
            if self.finished_early:
                cmd = CMD_STOP
                self.recorder.event(t, 0, -1, f"run completed before round {t}: {self.finished_early}")
                if self.writer is not None:
                    self.writer.set_attr("", "stop_reason", self.finished_early)
        flags = self._flags(cmd, t)
        self.channel.set_header(cmd, t, flags, self.participants(t) if cmd == CMD_ROUND else None)
        if cmd == CMD_ROUND and self.channel.state.dev.numel() > self.D:
            self.algo.fill_downlink(self.state.dev[self.D:], t)
        if cmd != CMD_ROUND or flags & FLAG_CHECKPOINT:
            self.recorder.finish_pending(self._evaluate)   # the log holds every round a checkpoint covers

    def _flags(self, cmd: int, t: int) -> int:
        """A checkpoint is taken at every stop (completed or interrupted, never after a
        failure) and when ``t % runtime.checkpoint_every == 0``, unless rounds < t are saved."""
        interrupted = cmd == CMD_STOP and self.stop_reason is not None and t < self.cfg.train.rounds
        flags = FLAG_INTERRUPTED if interrupted else 0
        every = self.cfg.runtime.checkpoint_every
        due = cmd == CMD_STOP or (cmd == CMD_ROUND and every and t % every == 0)
        if due and self.out_dir is not None and t != self.checkpoint_round:
            flags |= FLAG_CHECKPOINT
        return flags

    def _checkpoint_file(self) -> Optional[Path]:
        return checkpoint_path(self.out_dir) if self.out_dir is not None else None

    def _fail(self, t: int, line: str) -> None:
        """Rank 0: the run fails with ``line`` (logged); the next header aborts every rank."""
        self.failure = line
        self.recorder.event(t, 0, -1, line)

    def save_checkpoint(self, t: int) -> None:
        """Collective: checkpoint "rounds < t are done" (:mod:`fedmpi.job.checkpoint`)."""
        assert self.out_dir is not None, "checkpoints are flagged only with an output directory"
        path = checkpoint.save(self.run_state(), t, checkpoint_path(self.out_dir))
        self.checkpoint_round = t
        if path is not None and self.stop_reason is not None:
            self.recorder.event(t, 0, -1, f"checkpoint of rounds < {t} written to {path}")

    # ---------------------------------------------------------------- server
    def _server_round(self, t: int, up, t_start: float, t_train: float) -> None:
        stopping = np.flatnonzero(up.signals)
        if stopping.size and self.stop_reason is None:
            r = int(stopping[0])
            self.stop_reason = f"{signals.signal_name(int(up.signals[r]))} on {self.comm.voice_name(r)}"
            self.recorder.event(t, r, -1, f"stop requested ({self.stop_reason}); checkpoint and exit")
        failed = np.flatnonzero(up.mask & (up.status == STATUS_FAILED))
        if failed.size:
            self.failure = "; ".join(up.errors) or f"clients {failed.tolist()} failed"
            for k in failed:
                self.recorder.event(t, int(self.host[k]), int(k),
                                    f"local training failed: {self.failure}", echo=False)
            self.evals.join(t, self.global_state, self.ctx, self.algo, self.channel)  # workers wait
            return
        t_agg = time.perf_counter()
        self.reports.round = t
        result = server_step(self.global_state, up, self.server, self.sum_bufs)
        self.reports.flush_events()   # what the stages and the rule reported, in order
        for k in result.excluded:
            status = int(up.status[k])
            why = EXCLUDED_BECAUSE.get(status, f"status {status}")
            if self.codec is not None and status in (STATUS_RANGE, STATUS_WITHHELD):
                why = (self.codec.refused_because if status == STATUS_RANGE
                       else self.codec.withheld_because)
            self.recorder.event(t, int(self.host[k]), int(k), "update excluded: " + why)
        if result.accepted.size == 0:
            self.recorder.event(t, 0, -1, "no update accepted; global model unchanged")
        self.rounds_without_update = 0 if result.accepted.size else self.rounds_without_update + 1
        stalled = guard.no_progress(self.cfg.runtime.max_rounds_without_update,
                                    self.rounds_without_update, t)
        if stalled is not None:   # too many such rounds in a row: the next header aborts
            self._fail(t, stalled)
        broken = guard.diverged(self.global_state, t, self._checkpoint_file(),
                                self.checkpoint_round) if result.accepted.size else None
        if broken is not None:   # keep the last checkpoint: none is written after a failure
            self._fail(t, broken)
            self.evals.join(t, self.global_state, self.ctx, self.algo, self.channel)  # workers wait
            return
        overlapped = self.evals.overlaps(t)
        t_eval = time.perf_counter()
        evals = self.evals.none() if overlapped else self._evaluate(t)
        t_end = t_eval if overlapped else time.perf_counter()
        sel = [int(k) for k in np.flatnonzero(up.mask)]
        traffic = [self.transforms.traffic(*self.algo.traffic(k, t)) for k in sel]
        row = self.recorder.row(up, result, {"start": t_start, "agg": t_agg, "eval": t_eval,
                                             "end": t_end, "arrival": self.channel.exposed_arrival_seconds},
                                sum(u for u, _ in traffic), sum(d for _, d in traffic))
        self.channel.exposed_arrival_seconds = 0.0
        row.scalars.update(evals)
        row.clients.update(self.evals.take_sites())   # /clients/<metric> of a per-site evaluation
        if overlapped:
            self.recorder.pending = row
        else:
            self.recorder.append(row)

    def save_best(self, t: int, value: float) -> None:
        """Rank 0: the global model of round ``t`` (best in ``checkpoint.keep_best``) to
        ``best.pt``, its round in the log's root attributes (:mod:`fedmpi.runtime.callbacks`)."""
        assert self.out_dir is not None and self.writer is not None, "rank 0 of a run with a log"
        metric = self.cfg.checkpoint.keep_best.metric
        self.flat.load(self.global_state)
        write_model(self.flat.model, self.out_dir / "best.pt")
        for name, v in (("best_round", t), ("best_metric", metric), ("best_value", value)):
            self.writer.set_attr("/", name, v)

    def _evaluate(self, t: int) -> dict[str, float]:
        return self.evals.run(t, self.global_state, self.ctx, self.algo, self.channel)

    def evaluate(self) -> dict[str, float]:
        """``test_loss``, ``test_accuracy`` and the other ``eval.metrics`` of the global
        model now, where ``eval.where`` says (the names of the log's ``/rounds``).

        * ``server`` — rank 0's test set (the method's own evaluation where it has one),
          on the calling rank alone: no messages, any rank may call it.
        * ``clients`` / ``both`` — the per-site evaluation of the run (rank 0 holds no
          test data under ``clients``): every client evaluates θ on its held-out samples
          on the rank hosting it and rank 0 combines them (docs/evaluation.md). This is a
          **collective**: call it on every rank, as :meth:`round` is (a call on rank 0
          alone waits for the workers). Rank 0 returns the combined values (``both``:
          the test set's, plus ``clients_<metric>``) and keeps each client's values in
          :attr:`site_metrics` (``{metric: [K] array}``, ``test_samples`` included, as
          ``/clients/<metric>``); workers return ``{}``.

        Nothing is written to the log: a round's row holds only that round's evaluation.
        """
        scalars = self.evals.now(self.global_state, self.ctx, self.algo, self.channel)
        self.site_metrics = self.evals.take_sites()
        return scalars

    def finish_pending_row(self) -> None:
        self.recorder.finish_pending(self._evaluate)

    def release(self) -> None:
        """After the last round: drop the round's model-sized buffers (the channel's
        uplink, the exact reduction's sums), keeping θ and the model."""
        self.channel.release()
        self.sum_bufs.clear()
        self.arrival_sum = None
