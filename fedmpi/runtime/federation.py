"""One rank of a run and its round loop.

Rank 0 is the aggregator; with W = world_size − 1 ≥ 1 workers, client c lives on
rank 1 + c mod W; with world size 1 rank 0 hosts every client itself. Every rank runs
:meth:`Federation.round`, the loop over two seams:

* the **round policy** (:mod:`~fedmpi.runtime.policy`): who takes part, when the round
  closes, what a late update counts for;
* the **exchange** (:mod:`~fedmpi.runtime.exchange`): the verbs that move the round's
  messages — the control header, θ, the clients' updates as they arrive, the reduction of
  the summed statistics; the default :mod:`~fedmpi.runtime.collective` exchange is one
  fixed sequence of collectives, the only synchronisation.

The other parts: :mod:`~fedmpi.runtime.build` (what a rank is made of),
:mod:`~fedmpi.runtime.worker` (local work), :mod:`~fedmpi.runtime.server` (the pure server
step: exclusion, weights, server rule), :mod:`~fedmpi.runtime.evaluation` (policy) and
:mod:`~fedmpi.runtime.record` (log rows and timing).

Everything else uses a :class:`Federation` through the attributes in :data:`PUBLIC` and the
narrow views of :mod:`~fedmpi.runtime.view`; the rest is private to the loop.

One module, just over 400 lines: the loop, its stop/checkpoint handshake and the timing of
each of its calls (the overhead's parts, :mod:`~fedmpi.runtime.record`) are one sequence
that every rank must take in the same order; the parts that are not are the modules above.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from fedmpi.comm.world import Comm
from fedmpi.errors import ConfigError
from fedmpi.job import checkpoint, signals
from fedmpi.job.checkpoint_file import checkpoint_path
from fedmpi.data import preprocessing
from fedmpi.runtime import guard, silo
from fedmpi.runtime.asynchronous import AsyncRounds, LoopCalls
from fedmpi.runtime.build import build
from fedmpi.runtime.collective import CollectiveExchange, plan_uplink
from fedmpi.runtime.evaluation import Evaluation
from fedmpi.runtime.exchange import Exchange, Header
from fedmpi.runtime.policy import RoundPolicy, round_policy
from fedmpi.runtime.record import RoundRecorder, RoundSpans
from fedmpi.runtime.server import (EXCLUDED_BECAUSE, META_FIELDS, STATUS_FAILED, STATUS_RANGE,
                                   STATUS_WITHHELD, ArrivalSum, Uplink, is_summed, server_step)
from fedmpi.runtime.view import RankView, RunStatus
from fedmpi.runtime.worker import Worker
from fedmpi.training.loop import LocalTrainer
from fedmpi.usercode import UserCode

if TYPE_CHECKING:
    from fedmpi.config.core import Config

CMD_ROUND, CMD_STOP, CMD_ABORT = 0, 1, 2
# header flags: checkpoint before acting on the command; the stop is an interruption
FLAG_CHECKPOINT, FLAG_INTERRUPTED = 1, 2

#: What code outside the round loop may use of a :class:`Federation`: the rank's built
#: parts, the round policy (tests replace it), θ, one round, the checkpoint's view, the
#: log, the run's status, and the plug-ins' view. Every other attribute is private.
PUBLIC = ("built", "policy", "global_state", "round", "run_state", "log", "status", "view")


class Federation:
    """Sets up one rank of a run and executes rounds (see module docstring).

    Attributes:
        built: what this rank is made of (:class:`~fedmpi.runtime.build.Built`).
        policy: the round policy (:class:`~fedmpi.runtime.policy.RoundPolicy`).
        log: rank 0's log rows and history (:class:`~fedmpi.runtime.record.RoundRecorder`).
        status: how the run stands (:class:`~fedmpi.runtime.view.RunStatus`).
        view: the rank as plug-ins see it (:class:`~fedmpi.runtime.view.RankView`).
    """

    def __init__(self, cfg: Config, comm: Comm, out_dir: Optional[Path] = None,
                 code: Optional[UserCode] = None) -> None:
        self._cfg, self._comm, self._out = cfg, comm, out_dir
        self._server = comm.rank == 0
        self.policy: RoundPolicy = round_policy(cfg)
        b = build(cfg, comm, plan=lambda t: self.policy.participants(t), code=code)
        self.built = b
        self._D = b.flat.size   # the exchanged state: trainable parameters + float buffers
        asynchronous = cfg.round.mode != "sync"
        if asynchronous and not b.algo.spec_for(cfg).asynchronous:
            from fedmpi.methods import ALGORITHMS

            raise ConfigError(f"config key 'algorithm.name' ({cfg.algorithm.name}) does not "
                              f"compose with round.mode {cfg.round.mode!r}: its rule needs "
                              "every participant's update from one model version; set "
                              "round.mode: sync or choose one of " + ", ".join(
                                  n for n, c in ALGORITHMS.items() if c.spec.asynchronous))
        # the point-to-point rounds sum each step's rows on rank 0 in client-id order
        exact = (cfg.runtime.reduction == "exact" and comm.size > 1) or asynchronous
        rows_needed = b.server.rows_needed
        K, m = b.num_clients, self.policy.max_participants
        self._codec = b.transforms.codec(b.hosted, K)
        payload = b.transforms.payload_code()   # summed on rank 0 in client-id order
        plan = plan_uplink(list(b.stats), rows_needed, exact, exact_sums=payload is not None or (
            self._codec is not None and self._codec.sums_exactly))
        assert self.policy.waits_for_all, "the collective exchange closes when all reported"
        self._exchange: Exchange = CollectiveExchange(
            comm, plan, self._D, b.algo.exchange().downlink, K,
            max_local=min(m, len(b.hosted)), max_rows=m, host=b.host, device=b.device,
            codec=self._codec, meta_fields=len(META_FIELDS) + len(b.reports.client_columns),
            wire=cfg.runtime.wire, payload=payload)
        if self._server:
            self._exchange.downlink[: self._D].copy_(b.flat.vector)
        client_idx = {k: torch.as_tensor(b.partition.client_indices[k], device=b.device)
                      for k in b.hosted}
        trainer = LocalTrainer(b.flat, b.data, b.accel, b.forward) if b.hosted else None
        scratch = ({s.name: torch.zeros(s.size, device=b.device) for s in b.stats}
                   if b.hosted else {})   # one client's uplink, where clients train
        parallel = silo.data_parallel(cfg, comm, b.flat.model, b.device) if b.hosted else None
        self._worker = Worker(cfg, comm.rank, b.algo, b.weighting, b.transforms, trainer,
                              client_idx, scratch, b.reports, parallel)
        tests = b.partition.client_test_indices
        self._evals = Evaluation(cfg, comm.rank, comm.size, b.algo.spec_for(cfg).owns_evaluation,
                                 {k: torch.as_tensor(tests[k], device=b.device)
                                  for k in b.hosted} if tests else None)
        self.log = RoundRecorder(b.host, comm.size, b.reports, evaluate=self._evaluate)
        reduced = {s.name for s, _ in plan.reduced}
        summed = [s for s in b.stats if is_summed(s, rows_needed) and s.name not in reduced]
        self._sum_bufs = ({s.name: torch.zeros(s.size, dtype=torch.float64, device=b.device)
                           for s in summed} if self._server and exact else {})
        # runtime.reduction: exact — rank 0 adds the rows in client-id order as they arrive
        self._arrival_sum = (ArrivalSum(list(b.stats), b.weighting.raw, self._sum_bufs)
                             if self._sum_bufs and self._exchange.stream_rows else None)
        self.status = RunStatus()
        self._rounds_without_update = 0            # runtime.max_rounds_without_update
        self._timed_end = 0.0   # rank 0: when the last round's timed part ended (0: none)
        self.view = RankView(b, comm, self._exchange, self._worker, self._evals, self.log)
        #: round.mode deadline | buffered: the policy's point-to-point rounds
        self._rounds = AsyncRounds(cfg, comm, b, self._exchange, self._worker, plan, LoopCalls(
            command=self._command, stop_flags=self._stop_flags, after_stop=self._after_stop,
            fail_client=self._fail_client, worker_signal=self._worker_signal,
            server_step=self._async_server_round,
            failed=lambda: self.status.failure is not None)) if asynchronous else None

    # ----------------------------------------------------------- accessors
    @property
    def global_state(self) -> torch.Tensor:
        """θ on rank 0 (parameters and float buffers)."""
        return self._exchange.downlink[: self._D]

    def run_state(self) -> checkpoint.RunState:
        """What a checkpoint saves and restores (:class:`fedmpi.job.checkpoint.RunState`):
        θ, the named components (method, weighting, transforms with their own state, server
        rule, RNG streams) and the per-client states of the hosted clients."""
        b = self.built
        parts: dict[str, checkpoint.StateOwner] = dict(b.components)
        parts["rng"] = checkpoint.RngStreams()
        return checkpoint.RunState(
            cfg=self._cfg, comm=self._comm, num_clients=b.num_clients, host=b.host,
            hosted=b.hosted, device=b.device, global_state=self.global_state,
            components=parts, clients=b.algo,
            after_resume=lambda t: b.algo.after_resume(b.ctx, t), out_dir=self._out,
            frozen_digest=b.frozen_digest,
            preprocessing=preprocessing.of(b.flat.model) or {})

    # ----------------------------------------------------------------- round
    def round(self, t: int) -> int:
        """Run round ``t`` on this rank; returns the command that was broadcast. After a
        stop the uplink's model-sized buffers are released (θ and the model stay)."""
        if self._rounds is not None:
            return self._rounds.round(t)
        clock = time.perf_counter
        t_start = clock()
        # the previous round's recording (after its timed part) belongs to this round
        spans = RoundSpans(record=t_start - self._timed_end if self._timed_end else 0.0)
        self._timed_end = 0.0
        b, ex = self.built, self._exchange
        header = self._plan(t) if self._server else None
        t_plan = clock()
        head = ex.control(t, header)
        t_header = clock()
        cmd, flags, mask = head.command, head.flags, head.mask
        if flags & FLAG_INTERRUPTED and self.status.stop_reason is None:
            self.status.stop_reason = "interrupted"
        if flags & FLAG_CHECKPOINT:
            self._save_checkpoint(t)
            # checkpoint time is not part of round t, nor is anything before it
            t_start = t_plan = t_header = clock()
            spans.record = 0.0
        if cmd != CMD_ROUND:
            if cmd == CMD_STOP:
                self._release()
            return cmd
        ex.send_state(t, mask)
        t_state = clock()
        state, extras = ex.downlink[: self._D], ex.downlink[self._D:]
        b.algo.begin_round(t, mask, state, extras)
        if self._server:   # evaluate round t − 1 while the workers train round t
            self.log.finish_pending()
            if self._comm.size > 1:   # and the server rule's work on θ^t alone (FLTrust's g_0)
                b.rule.begin_round(state, t)
        t_train = clock()
        if self._arrival_sum is not None:
            self._arrival_sum.start(mask)
        self._worker.run(t, mask, b.hosted, state, extras, ex)
        t_local = clock()
        signal = self._comm.group_max(signals.requested_signum())
        ex.receive_updates(t, mask, lambda k, row: self._arrived(state, k, row),
                           self.policy.closes)
        t_close = clock()
        up = ex.reduce_updates(t, mask, signal)
        if up is not None:
            split = ex.take_split()
            reduced = clock() - t_close
            spans.plan, spans.header = t_plan - t_start, t_header - t_plan
            spans.codec_header, spans.state = split["codec_control"], t_state - t_header
            spans.pre, spans.local = t_train - t_state, t_local - t_train
            spans.close = t_close - t_local + split["close"]
            spans.after, spans.codec = reduced - split["close"], split["codec"]
            if self._arrival_sum is not None:
                up = self._arrival_sum.into(up)
            self._server_round(t, up, t_start - spans.record, t_train, spans=spans)
        elif self._evals.collective(t):
            self._evals.join(t, state, b.ctx, b.algo, ex)
        return CMD_ROUND

    def _arrived(self, state: torch.Tensor, client: int, row: dict[str, torch.Tensor]) -> None:
        """Rank 0: a client's row arrived while others may still train."""
        if self._arrival_sum is not None:
            self._arrival_sum.arrived(client, row)
        self.built.weighting.on_arrival(state, client, row)

    def _plan(self, t: int) -> Header:
        """Rank 0: the round's command, flags and participants."""
        b = self.built
        cmd = self._command(t)
        flags = self._flags(cmd, t)
        mask = (self.policy.participants(t) if cmd == CMD_ROUND
                else np.zeros(b.num_clients, dtype=bool))
        downlink = self._exchange.downlink
        if cmd == CMD_ROUND and downlink.numel() > self._D:
            b.algo.fill_downlink(downlink[self._D:], t)
        if cmd != CMD_ROUND or flags & FLAG_CHECKPOINT:
            self.log.finish_pending()   # the log holds every round a checkpoint covers
        return Header(cmd, t, flags, mask)

    def _command(self, t: int) -> int:
        """Rank 0: round ``t``'s command (a stop requested, a failure, the end, a stage's
        budget)."""
        st, b = self.status, self.built
        if st.stop_reason is None and signals.requested():
            st.stop_reason = f"{signals.requested()} on rank 0"
            # before any round there is nothing to checkpoint: the driver's line says so
            self.log.event(t, 0, -1, f"stop requested ({st.stop_reason}); checkpoint and exit",
                           echo=bool(self.log.history))
        cmd = CMD_ROUND
        if st.failure is not None:
            cmd = CMD_ABORT
        elif (st.stop_reason is not None or self.log.stop_request is not None
              or st.finished_early or t >= self._cfg.train.rounds):
            cmd = CMD_STOP   # a signal, early stopping or a callback, the end
        else:   # a stage may end the run before this round (a budget it keeps)
            st.finished_early = b.transforms.plan_round(t, self.policy.participants(t))
            if st.finished_early:
                cmd = CMD_STOP
                self.log.event(t, 0, -1, f"run completed before round {t}: {st.finished_early}")
                if self.log.writer is not None:
                    self.log.writer.set_attr("", "stop_reason", st.finished_early)
        return cmd

    # ------------------------------------------------- the point-to-point rounds' calls
    def _stop_flags(self, cmd: int, t: int) -> int:
        """Rank 0: the flags of a stop header (checkpoint, interrupted); the pending row
        first."""
        self.log.finish_pending()
        return self._flags(cmd, t)

    def _after_stop(self, t: int, cmd: int, flags: int) -> None:
        """Every rank, on a stop header of the point-to-point rounds: what it says."""
        if flags & FLAG_INTERRUPTED and self.status.stop_reason is None:
            self.status.stop_reason = "interrupted"
        if flags & FLAG_CHECKPOINT:
            self._save_checkpoint(t)
        if cmd == CMD_STOP:
            self._release()

    def _fail_client(self, client: int, text: str) -> None:
        """Rank 0: client ``client`` raised (its text); the next command aborts the run."""
        if self.status.failure is None:
            self.status.failure = text
            b = self.built
            self.log.event(b.reports.round, int(b.host[client]), client,
                           f"local training failed: {text}", echo=False)

    def _worker_signal(self, rank: int, signum: int) -> None:
        """Rank 0: rank ``rank`` saw stop signal ``signum``."""
        if self.status.stop_reason is None:
            self.status.stop_reason = f"{signals.signal_name(signum)} on {self._comm.voice_name(rank)}"
            self.log.event(self.built.reports.round, rank, -1,
                           f"stop requested ({self.status.stop_reason}); checkpoint and exit")

    def _async_server_round(self, t: int, up: Uplink, t_start: float,
                            moved: tuple[int, int]) -> None:
        """Rank 0: a step of the point-to-point rounds: the server round with the bytes
        moved, its evaluation not overlapped."""
        self._server_round(t, up, t_start, t_start, moved)
        self.log.finish_pending()

    def _flags(self, cmd: int, t: int) -> int:
        """A checkpoint is taken at every stop (completed or interrupted, never after a
        failure) and when ``t % runtime.checkpoint_every == 0``, unless rounds < t are saved."""
        rounds = self._cfg.train.rounds
        interrupted = cmd == CMD_STOP and self.status.stop_reason is not None and t < rounds
        flags = FLAG_INTERRUPTED if interrupted else 0
        every = self._cfg.runtime.checkpoint_every
        due = cmd == CMD_STOP or (cmd == CMD_ROUND and every and t % every == 0)
        if due and self._out is not None and t != self.status.checkpoint_round:
            flags |= FLAG_CHECKPOINT
        return flags

    def _checkpoint_file(self) -> Optional[Path]:
        return checkpoint_path(self._out) if self._out is not None else None

    def _fail(self, t: int, line: str) -> None:
        """Rank 0: the run fails with ``line`` (logged); the next header aborts every rank."""
        self.status.failure = line
        self.log.event(t, 0, -1, line)

    def _save_checkpoint(self, t: int) -> None:
        """Collective: checkpoint "rounds < t are done" (:mod:`fedmpi.job.checkpoint`)."""
        assert self._out is not None, "checkpoints are flagged only with an output directory"
        path = checkpoint.save(self.run_state(), t, checkpoint_path(self._out))
        self.status.checkpoint_round = t
        if path is not None and self.status.stop_reason is not None:
            self.log.event(t, 0, -1, f"checkpoint of rounds < {t} written to {path}")

    # ---------------------------------------------------------------- server
    def _server_round(self, t: int, up: Uplink, t_start: float, t_train: float,
                      moved: Optional[tuple[int, int]] = None,
                      spans: Optional[RoundSpans] = None) -> None:
        b, st = self.built, self.status
        stopping = np.flatnonzero(up.signals)
        if stopping.size and st.stop_reason is None:
            r = int(stopping[0])
            signal = signals.signal_name(int(up.signals[r]))
            st.stop_reason = f"{signal} on {self._comm.voice_name(r)}"
            self.log.event(t, r, -1, f"stop requested ({st.stop_reason}); checkpoint and exit")
        failed = np.flatnonzero(up.mask & (up.status == STATUS_FAILED))
        if failed.size:
            st.failure = "; ".join(up.errors) or f"clients {failed.tolist()} failed"
            for k in failed:
                self.log.event(t, int(b.host[k]), int(k),
                               f"local training failed: {st.failure}", echo=False)
            self._evals.join(t, self.global_state, b.ctx, b.algo, self._exchange)  # workers wait
            return
        t_agg = time.perf_counter()
        b.reports.round = t
        result = server_step(self.global_state, up, b.server, self._sum_bufs)
        b.reports.flush_events()   # what the stages and the rule reported, in order
        for k in result.excluded:
            status = int(up.status[k])
            why = EXCLUDED_BECAUSE.get(status, f"status {status}")
            if self._codec is not None and status in (STATUS_RANGE, STATUS_WITHHELD):
                why = (self._codec.refused_because if status == STATUS_RANGE
                       else self._codec.withheld_because)
            self.log.event(t, int(b.host[k]), int(k), "update excluded: " + why)
        if result.accepted.size == 0:
            self.log.event(t, 0, -1, "no update accepted; global model unchanged")
        self._rounds_without_update = 0 if result.accepted.size else self._rounds_without_update + 1
        stalled = guard.no_progress(self._cfg.runtime.max_rounds_without_update,
                                    self._rounds_without_update, t)
        if stalled is not None:   # too many such rounds in a row: the next header aborts
            self._fail(t, stalled)
        broken = guard.diverged(self.global_state, t, self._checkpoint_file(),
                                st.checkpoint_round) if result.accepted.size else None
        if broken is not None:   # keep the last checkpoint: none is written after a failure
            self._fail(t, broken)
            self._evals.join(t, self.global_state, b.ctx, b.algo, self._exchange)  # workers wait
            return
        overlapped = self._evals.overlaps(t)
        t_eval = time.perf_counter()
        evals = self._evals.none() if overlapped else self._evaluate(t)
        t_end = t_eval if overlapped else time.perf_counter()
        sel = [int(k) for k in np.flatnonzero(up.mask)]
        traffic = [b.transforms.traffic(*b.algo.traffic(k, t)) for k in sel]
        wire = moved if moved is not None else up.moved
        assert wire is not None, "the exchange counts the bytes it hands MPI"
        arrival = self._exchange.take_exposed_seconds()
        if spans is not None:
            spans.arrival = arrival
            self._timed_end = t_end   # what follows until the next round is its recording
        row = self.log.row(up, result, {"start": t_start, "agg": t_agg, "eval": t_eval,
                                        "end": t_end, "arrival": arrival},
                           *wire, encoded=(sum(u for u, _ in traffic), sum(d for _, d in traffic)),
                           spans=spans)
        row.scalars.update(evals)
        row.clients.update(self._evals.take_sites())   # /clients/<metric> of a per-site evaluation
        if overlapped:
            self.log.pending = row
        else:
            self.log.append(row)

    def _evaluate(self, t: int) -> dict[str, float]:
        b = self.built
        return self._evals.run(t, self.global_state, b.ctx, b.algo, self._exchange)

    def _release(self) -> None:
        """After the last round: drop the round's model-sized buffers (the exchange's
        uplink, the exact reduction's sums), keeping θ and the model."""
        self._exchange.release()
        self._sum_bufs.clear()
        self._arrival_sum = None
