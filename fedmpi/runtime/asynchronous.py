"""Rounds that do not wait for the slowest silo: the deadline and buffered round policies
(:mod:`fedmpi.round.modes`) over point-to-point messages.

Rank 0 runs the policy; one *job* is one client's local training from one model version.

* **Down.** A job (client k, version v) travels to the rank hosting k as an int64 header
  [JOB, k, v, flags, τ, budget µs] and θ_v (a copy of θ kept on rank 0 until every send of that version
  completed). The rank trains k from θ_v with the RNG stream (seed, k, v) — a client
  never trains twice from one version — so an update is a function of (k, v) alone,
  whatever rank computes it and whenever. Under ``round.time_budget`` τ > 0 is the
  number of local steps the job takes (the virtual clock: ⌊budget / (slowdown_k · B ·
  round.sample_seconds)⌋, B the batch size, at least 1; a replay: the original's), or
  the budget in µs has the rank train until its next step would end past the deadline
  (the wall clock, counted from the job's arrival on the rank; the steps taken are
  logged, ``/clients/local_steps``, and a replay takes them again).
* **Up.** The update comes back as one metadata message (float64: status, raw weight,
  loss, samples, steps, training seconds, the components' per-client values, the rank's
  stop signal, then an error text) and one float32 row of every uplink statistic. A rank
  trains its jobs in the order they were sent and keeps one update in flight; rank 0
  keeps a receive posted for every job in flight, so no send waits on rank 0's order.
* **Steps.** Under ``round.clock: wall`` rank 0 takes the updates as they complete (and
  wakes at the policy's deadline); under ``virtual`` it takes them in the order of the
  simulated clock (:mod:`fedmpi.round.clock`), waiting for the one due next. Each step
  is an :class:`~fedmpi.runtime.server.Uplink` of the updates the policy put in it —
  every statistic as a row, weighted ones scaled by s(τ), summed in client-id order
  (:func:`~fedmpi.runtime.server.ordered_sum`) — through the same server step, log row
  and evaluation as a synchronous round: Σ_k w̃_k s(τ_k) x_k / Σ_k w̃_k, FedBuff's
  staleness-weighted mean (Nguyen et al. 2022, Alg. 1) under the run's weighting.
* **Stop.** Rank 0 waits for the jobs in flight (their updates are discarded), then sends
  every rank a STOP (or ABORT) header with the checkpoint flag; from there all ranks are
  in step again (checkpoint, final evaluations). A resumed run restarts the policy at
  the checkpointed step with no job in flight.
* **Checkpoints** (``runtime.checkpoint_every``). Before step t with t a multiple of it,
  rank 0 drains the jobs in flight as at the stop, sends every rank a HOLD header with
  the checkpoint flag, all ranks write the checkpoint of steps < t together, and the
  policy restarts at step t with no job in flight — what a run resumed from that
  checkpoint does, so a run killed after it and resumed (at any world size) is the run
  that was not killed (on the virtual clock, bit for bit).

One module: rank 0's event loop, its job bookkeeping and the worker's serve loop are
one protocol (the tags, the message layouts and the stop handshake must agree), so they
stay together.

Every step's row records each update's model version, staleness weight and arrival time
(``/clients/version``, ``/clients/staleness_weight``, ``/clients/arrival_seconds``) and
the clock's time of the step (``/rounds/virtual_seconds`` on the virtual clock,
``/rounds/elapsed_seconds`` on the wall clock).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

from fedmpi.comm.endpoint import CommTimeout
from fedmpi.job import signals
from fedmpi.errors import ConfigError, LogFormatError
from fedmpi.log.reader import read
from fedmpi.round.modes import INF, Actions, Buffered, Deadline, Job, Mode, Replay, Step
from fedmpi.round.staleness import Staleness
from fedmpi.runtime.server import (M_RAW, M_STATUS, M_TIME, STATUS_FAILED, STATUS_NONFINITE,
                                   STATUS_OK, Uplink)
from fedmpi.training.vecops import all_finite

if TYPE_CHECKING:
    from fedmpi.comm.world import Comm
    from fedmpi.config.core import Config
    from fedmpi.runtime.build import Built
    from fedmpi.runtime.collective import CollectiveExchange, UplinkPlan
    from fedmpi.runtime.worker import Worker

# the round loop's commands (fedmpi.runtime.federation: CMD_ROUND, CMD_STOP, CMD_ABORT);
# CMD_HOLD: every rank checkpoints, then the rounds go on
CMD_ROUND, CMD_JOB, CMD_HOLD = 0, 3, 4
HEAD_TAG, STATE_TAG, META_TAG, ROW_TAG = 41_001, 41_002, 41_003, 41_004
HEAD_LEN = 6   # [command, client, version, flags, local steps, budget µs]
ERR_BYTES = 1024


def read_record(cfg: Config) -> list[list[tuple[int, int, float]]]:
    """The steps of the run ``runtime.replay`` names (its log, or its run directory): for
    each, the (client, version, staleness weight) of the updates it aggregated, from
    ``/clients/version`` and ``/clients/staleness_weight``. ConfigError naming the key and
    the file when it cannot be replayed by this run."""
    path = Path(cfg.runtime.replay or "")
    if path.is_dir():
        path = path / "log.h5"
    try:
        log = read(path)
    except LogFormatError as exc:
        raise ConfigError(f"config key 'runtime.replay': {exc}") from None
    version, weight = log.clients.get("version"), log.clients.get("staleness_weight")
    if version is None or weight is None:
        raise ConfigError(f"config key 'runtime.replay': {path} is not the log of a deadline "
                          "or buffered run (no /clients/version)")
    K, rounds = cfg.data.num_clients, cfg.train.rounds
    if version.shape[1] != K or version.shape[0] < rounds:
        raise ConfigError(f"config key 'runtime.replay': {path} records {version.shape[0]} "
                          f"steps of {version.shape[1]} clients; this run needs {rounds} "
                          f"steps of data.num_clients = {K}")
    return [[(int(k), int(version[t, k]), float(weight[t, k]))
             for k in np.flatnonzero(~np.isnan(version[t]))] for t in range(rounds)]


def make_mode(cfg: Config, start: int,
              record: Optional[list[list[tuple[int, int, float]]]] = None) -> Mode:
    """The run's round policy, at step ``start`` (a resumed run); the recorded steps
    again under ``runtime.replay``."""
    if record is not None:
        return Replay(record, start, read_steps(cfg) if cfg.round.time_budget else None)
    r = cfg.round
    st = Staleness(r.staleness, r.staleness_a, r.staleness_b, r.max_staleness)
    K = cfg.data.num_clients
    m = cfg.train.clients_per_round or K
    steps = cfg.train.rounds
    mode: Mode
    if r.mode == "deadline":
        assert r.deadline is not None, "round_checks requires it"
        mode = Deadline(cfg.seed, K, m, steps, r.deadline, r.min_updates, r.late, st,
                        timeout=cfg.runtime.round_timeout, time_budget=r.time_budget)
    else:
        mode = Buffered(cfg.seed, K, r.concurrency or m, steps, r.buffer, st)
    mode.version = start
    return mode


def read_steps(cfg: Config) -> dict[tuple[int, int], int]:
    """(client, version) → the local steps each update of the run ``runtime.replay`` names
    took (``/clients/local_steps``): what a replay of a ``round.time_budget`` run takes again."""
    path = Path(cfg.runtime.replay or "")
    log = read(path / "log.h5" if path.is_dir() else path)
    version, steps = log.clients["version"], log.clients.get("local_steps")
    if steps is None:
        raise ConfigError(f"config key 'runtime.replay': {path} records no /clients/local_steps, "
                          "which a round.time_budget run replays")
    return {(int(k), int(version[t, k])): int(steps[t, k])
            for t in range(version.shape[0]) for k in np.flatnonzero(~np.isnan(version[t]))}


def budget_steps(budget: float, slowdown: float, batch_size: int, unit: float) -> int:
    """Local steps of a job with ``budget`` virtual seconds (``round.time_budget``): the
    most that fit, ⌊budget / (slowdown · B · unit)⌋, at least 1."""
    return max(1, math.floor(budget / (slowdown * batch_size * unit) + 1e-9))


def work(cfg: Config, num_samples: np.ndarray, client: int, steps: int = 0) -> float:
    """Samples client ``client``'s local training processes (the virtual clock's work);
    ``steps`` > 0: that many batches instead of the configured τ_k."""
    t = cfg.train
    if steps:
        return float(steps * t.batch_size)
    if t.local_steps:
        return float(t.local_steps * t.batch_size)
    return float(t.local_epochs * num_samples[client])


@dataclass(frozen=True)
class LoopCalls:
    """What the point-to-point rounds ask of the round loop
    (:class:`~fedmpi.runtime.federation.Federation`), whose status and log they share."""

    #: rank 0: step t's command (a stop requested, a failure, the end, a stage's budget)
    command: Callable[[int], int]
    #: rank 0: the flags of the stop header of (command, t)
    stop_flags: Callable[[int, int], int]
    #: every rank: a stop header (t, command, flags) arrived — checkpoint, release
    after_stop: Callable[[int, int, int], None]
    #: rank 0: client k raised (its one line); the next command aborts
    fail_client: Callable[[int, str], None]
    #: rank 0: rank r saw stop signal s
    worker_signal: Callable[[int, int], None]
    #: rank 0: a step's Uplink through the server step, log row and evaluation
    server_step: Callable[[int, Uplink, float, tuple[int, int]], None]
    #: rank 0: whether the run has failed
    failed: Callable[[], bool]


@dataclass
class _Flight:
    """A job in flight on rank 0: its receive requests and buffers, its virtual end."""

    job: Job
    reqs: list
    meta: np.ndarray
    row: torch.Tensor
    end: float


class AsyncRounds:
    """The deadline and buffered rounds of one rank (module docstring)."""

    def __init__(self, cfg: Config, comm: Comm, built: Built, exchange: CollectiveExchange,
                 worker: Worker, plan: UplinkPlan, calls: LoopCalls) -> None:
        self.cfg, self.comm, self.b, self.worker, self.calls = cfg, comm, built, worker, calls
        self.state = exchange.state   # θ ‖ extras on the device, mirrored on the host
        self.K, self.D = built.num_clients, built.flat.size
        self.virtual = cfg.round.clock == "virtual"
        slow = cfg.system.slowdown
        self.slowdown = np.asarray(slow if slow is not None else [1.0] * self.K, dtype=np.float64)
        self.unit = cfg.round.sample_seconds
        self.plan = plan
        self.F = exchange.meta_fields
        self.round_reports = built.reports.reporter("round")
        self.meta_len = self.F + 1 + ERR_BYTES // 8
        self.mode: Optional[Mode] = None
        self.flights: dict[int, _Flight] = {}
        self.versions: dict[int, tuple[torch.Tensor, list]] = {}   # θ_v copies being sent
        self.heads: list[tuple[np.ndarray, list]] = []
        #: steps the policy produced, not yet applied, each with the jobs it started after it
        self.queue: list[tuple[Step, list[Job]]] = []
        self.arrived: dict[Job, _Flight] = {}   # updates in, waiting for their step
        #: the float buffers (BatchNorm statistics) of each version a job in flight or an
        #: update waiting for its step started from
        self.buffers: dict[int, torch.Tensor] = {}
        self.P = built.flat.num_params
        self.t0 = 0.0
        self.applied = 0   # rank 0: θ is θ_applied
        #: runtime.replay: the recorded steps' (client, version, weight)
        self.record = read_record(cfg) if cfg.runtime.replay else None
        self.now = 0.0
        #: bytes handed to MPI since the last step: jobs sent, updates received (every
        #: update that arrived, also one the policy then drops)
        self.sent_down = self.received_up = 0
        # a worker: one update in flight
        self.up_meta = np.zeros(self.meta_len, dtype=np.float64)
        self.up_row = torch.zeros(self.plan.row_size, dtype=torch.float32)
        self.up_reqs: list = []

    # ------------------------------------------------------------------ clocks
    def clock(self) -> float:
        return self.now if self.virtual else time.monotonic() - self.t0

    def duration(self, job: Job, steps: int = 0) -> float:
        return float(self.slowdown[job.client] * work(self.cfg, self.b.num_samples, job.client,
                                                      steps) * self.unit)

    def budget(self, job: Job) -> tuple[int, float]:
        """(τ, seconds) of ``job`` as its header carries them (module docstring): its local
        steps (0: as configured) and, on the wall clock, the seconds it may still train
        (inf: no limit)."""
        if job.steps or job.budget == INF:
            return job.steps, INF
        if self.virtual:
            return budget_steps(job.budget, float(self.slowdown[job.client]),
                                self.cfg.train.batch_size, self.unit), INF
        return 0, max(job.start + job.budget - self.clock(), 0.0)

    # ------------------------------------------------------------------ rank 0
    def round(self, t: int) -> int:
        """Round (server step) ``t`` on this rank; the command, as :meth:`Federation.round`."""
        if self.comm.rank != 0:
            return self._serve(t)
        t_start = time.perf_counter()
        cmd = self.calls.command(t)
        if cmd != CMD_ROUND:
            self._finish(t, cmd)
            return cmd
        if self.mode is None:
            self.t0 = time.monotonic()
            self._restart(t)
        elif self._checkpoint_due(t):
            self._hold(t)
        while not self.queue and not self.calls.failed():
            self._next_event()
        if self.calls.failed():
            return CMD_ROUND   # the next round's command is ABORT
        step, starts = self.queue.pop(0)
        self._step(t, step, t_start)
        self.applied = t + 1
        for job in starts:
            self._send_job(job)
        return CMD_ROUND

    def _restart(self, t: int) -> None:
        """Rank 0: (re)start the policy at step ``t`` with no job in flight."""
        self.mode = make_mode(self.cfg, t, self.record)
        self.applied = t
        self._apply(self.mode.begin(self.clock()))

    def _checkpoint_due(self, t: int) -> bool:
        every = self.cfg.runtime.checkpoint_every
        if not every or t % every:
            return False
        # a replay restarts at t only where the record does (no update of a step ≥ t
        # trained before t): elsewhere its steps would not be the recorded ones
        return self.record is None or all(v >= t for step in self.record[t:] for _, v, _ in step)

    def _hold(self, t: int) -> None:
        """Rank 0 before step ``t``: drain, every rank checkpoints steps < t (a HOLD
        header), then the policy restarts at t (module docstring)."""
        flags = self.calls.stop_flags(CMD_ROUND, t)
        if not flags:   # no output directory, or steps < t are saved already
            return
        self._drain()
        self._headers(CMD_HOLD, t, flags)
        self.calls.after_stop(t, CMD_HOLD, flags)
        self._restart(t)

    def _next_event(self) -> None:
        mode = self.mode
        assert mode is not None
        wake = mode.timer()
        if self.virtual:
            due = min(((f.end, k) for k, f in self.flights.items()), default=(INF, -1))
            if due[0] == INF and wake == INF:
                raise RuntimeError("the round policy waits for nothing (no job in flight)")
            if wake < due[0]:
                self.now = wake
                self._apply(mode.wake(wake))
                self._check_timeout()
                return
            flight = self.flights[due[1]]
            self.comm.wait([flight.reqs], f"update of client {due[1]} (virtual clock)")
            self.now = due[0]
            self._arrive(due[1])
            return
        clients = sorted(self.flights)
        until = self.t0 + wake if wake != INF else INF
        done = self.comm.wait_any([self.flights[k].reqs for k in clients],
                                  "client updates", until=until)
        if not done:
            self._apply(mode.wake(self.clock()))
            self._check_timeout()
            return
        for i in done:
            self._arrive(clients[i])

    def _check_timeout(self) -> None:
        if self.mode is not None and self.mode.timed_out:
            raise CommTimeout(f"round {self.mode.version} did not reach round.min_updates="
                              f"{self.cfg.round.min_updates} accepted updates within "
                              f"runtime.round_timeout={self.cfg.runtime.round_timeout:g}s")

    def _arrive(self, client: int) -> None:
        flight = self.flights.pop(client)
        if flight.reqs:   # a message (not a job rank 0 trained itself at world size 1)
            self.received_up += flight.meta.nbytes + flight.row.numpy().nbytes
        self.arrived[flight.job] = flight
        assert self.mode is not None
        if int(flight.meta[M_STATUS]) == STATUS_FAILED:
            text = flight.meta[self.F + 1:].view(np.uint8).tobytes().rstrip(b"\0")
            self.calls.fail_client(client, text.decode(errors="replace"))
        signal = int(flight.meta[self.F])
        if signal:
            self.calls.worker_signal(int(self.b.host[client]), signal)
        self._apply(self.mode.arrive(flight.job, self.clock()))

    def _apply(self, acts: Actions) -> None:
        """Queue the policy's steps; start each of its jobs now if it trains from the
        model rank 0 holds, else right after the queued step that makes its version."""
        for step in acts.steps:
            self.queue.append((step, []))
        for job in acts.start:
            after = job.version - self.applied - 1   # the queued step producing θ_v
            assert -1 <= after < len(self.queue), (job, self.applied, len(self.queue))
            if after < 0:
                self._send_job(job)
            else:
                self.queue[after][1].append(job)

    def _send_job(self, job: Job) -> None:
        dest = int(self.b.host[job.client])
        state = self.state.dev
        D = self.D
        if job.version not in self.buffers and self.P < D:
            self.buffers[job.version] = state[self.P: D].clone()
        steps, seconds = self.budget(job)
        end = self.clock() + self.duration(job, steps) if self.virtual else INF
        if dest == 0:   # world size 1: rank 0 trains the job itself, now
            meta = np.zeros(self.meta_len, dtype=np.float64)
            row = torch.zeros(self.plan.row_size, dtype=torch.float32, device=self.b.device)
            self._train(job.client, job.version, state[:D], state[D:], meta, row, steps,
                        time.monotonic() + seconds if seconds != INF else None)
            self.flights[job.client] = _Flight(job, [], meta, row, end)
            return
        if job.version not in self.versions:
            self._reap()
            self.versions[job.version] = (state.detach().to("cpu", copy=True), [])
        theta, sends = self.versions[job.version]
        micro = -1 if seconds == INF else round(seconds * 1e6)
        head = np.array([CMD_JOB, job.client, job.version, 0, steps, micro], dtype=np.int64)
        self.sent_down += head.nbytes + theta.numpy().nbytes   # what this job hands MPI
        reqs = self.comm.start_send(head, dest, HEAD_TAG)
        self.heads.append((head, reqs))
        sends.append(self.comm.start_send(theta.numpy(), dest, STATE_TAG))
        meta = np.zeros(self.meta_len, dtype=np.float64)
        row = torch.zeros(self.plan.row_size, dtype=torch.float32)
        recv = self.comm.start_recv(meta, dest, META_TAG) + \
            self.comm.start_recv(row.numpy(), dest, ROW_TAG)
        self.flights[job.client] = _Flight(job, recv, meta, row, end)

    def _reap(self) -> None:
        """Drop the θ copies and headers whose sends completed."""
        for v in [v for v, (_, sends) in self.versions.items()
                  if all(self.comm.done(s) for s in sends)]:
            del self.versions[v]
        self.heads = [(h, r) for h, r in self.heads if not self.comm.done(r)]

    def _step(self, t: int, step: Step, t_start: float) -> None:
        """Apply ``step`` as round ``t`` (server step, log row, evaluation), then start the
        jobs the policy started after it."""
        b, D = self.b, self.D
        assert step.version == t, (step.version, t)
        b.reports.round = t
        updates = sorted(step.updates, key=lambda u: u.job.client)
        K = self.K
        meta = np.zeros((K, self.F), dtype=np.float64)
        mask = np.zeros(K, dtype=bool)
        clients = np.asarray([u.job.client for u in updates], dtype=np.int64)
        rows = torch.zeros((len(updates), self.plan.row_size), dtype=torch.float32,
                           device=b.device)
        version = np.full(K, np.nan)
        weight = np.full(K, np.nan)
        arrival = np.full(K, np.nan)
        for i, u in enumerate(updates):
            f = self.arrived.pop(u.job)
            k = u.job.client
            meta[k] = f.meta[: self.F]
            mask[k] = True
            rows[i].copy_(f.row)
            for stat, off in self.plan.gathered:
                if stat.name == "delta" and u.staleness and self.P < D:
                    # float buffers are statistics, not trained: a stale update's
                    # b_k − b_v is rebased on the current b (b_k − b_now), so the step
                    # averages the clients' statistics (a stale Δ of running variances
                    # added to newer ones can turn them negative)
                    rows[i, off + self.P:off + D].add_(self.buffers[u.job.version])
                    rows[i, off + self.P:off + D].sub_(self.state.dev[self.P:D])
                if stat.combine == "weighted" and u.weight != 1.0:
                    rows[i, off:off + stat.size].mul_(u.weight)
            version[k], weight[k], arrival[k] = u.job.version, u.weight, u.arrived
        for u in step.dropped:
            self.arrived.pop(u.job, None)
            self.round_reports.event(f"update of client {u.job.client} (from step {u.job.version}, "
                                    f"staleness {u.staleness}) dropped", client=u.job.client)
        gathered = {s.name: rows[:, off:off + s.size] for s, off in self.plan.gathered}
        up = Uplink(round=t, mask=mask, meta=meta, rows=gathered, row_clients=clients,
                    signals=np.zeros(self.comm.size, dtype=np.int64))
        rep = self.round_reports
        rep.clients("version", version)
        rep.clients("staleness_weight", weight)
        rep.clients("arrival_seconds", arrival)
        rep.scalar("virtual_seconds" if self.virtual else "elapsed_seconds", step.time)
        if step.missing:
            rep.event(f"round {t} closed without clients {list(step.missing)} (still training)")
        self.calls.server_step(t, up, t_start, (self.received_up, self.sent_down))
        self.sent_down = self.received_up = 0
        live = {f.job.version for f in self.flights.values()} | \
            {j.version for j in self.arrived} | {j.version for _, js in self.queue for j in js}
        for v in [v for v in self.buffers if v not in live and v < t + 1]:
            del self.buffers[v]

    def _finish(self, t: int, cmd: int) -> None:
        """Rank 0 at the stop: wait for the jobs in flight (discarded), then STOP/ABORT."""
        self._drain()
        flags = self.calls.stop_flags(cmd, t)
        self._headers(cmd, t, flags)
        self.calls.after_stop(t, cmd, flags)

    def _drain(self) -> None:
        """Rank 0: complete every job in flight (their updates discarded) and every send."""
        if self.flights:
            self.comm.wait([f.reqs for f in self.flights.values()], "jobs in flight at the stop")
            self.flights.clear()
        self.arrived.clear()
        self.queue.clear()
        for v, (_, sends) in list(self.versions.items()):
            self.comm.wait(sends, f"θ of step {v}", patient=False)
        self.versions.clear()
        if self.heads:
            self.comm.wait([r for _, r in self.heads], "job headers", patient=False)
            self.heads.clear()

    def _headers(self, cmd: int, t: int, flags: int) -> None:
        """Rank 0: header (cmd, t, flags) to every worker, sent."""
        heads = []
        for r in range(1, self.comm.size):
            head = np.array([cmd, -1, t, flags, 0, -1], dtype=np.int64)
            heads.append((head, self.comm.start_send(head, r, HEAD_TAG)))
        self.comm.wait([r for _, r in heads], "stop headers", patient=False)

    # ------------------------------------------------------------------ workers
    def _serve(self, t: int) -> int:
        """A worker: train the jobs rank 0 sends until it sends STOP or ABORT."""
        head = np.zeros(HEAD_LEN, dtype=np.int64)
        while True:
            self.comm.wait([self.comm.start_recv(head, 0, HEAD_TAG)], "next job header")
            cmd, client, version, flags, steps, micro = (int(x) for x in head)
            until = time.monotonic() + micro / 1e6 if micro >= 0 else None
            if cmd != CMD_JOB:
                if self.up_reqs:
                    self.comm.wait([self.up_reqs], "last update send", patient=False)
                    self.up_reqs = []
                self.calls.after_stop(version, cmd, flags)
                if cmd == CMD_HOLD:
                    continue
                return cmd
            self.comm.wait([self.comm.start_recv(self.state.host, 0, STATE_TAG)], "θ of a job",
                           patient=False)
            self.state.push()
            if self.up_reqs:   # the previous update must be out before its buffers are reused
                self.comm.wait([self.up_reqs], "previous update send", patient=False)
                self.up_reqs = []
            self._train(client, version, self.state.dev[: self.D], self.state.dev[self.D:],
                        self.up_meta, self.up_row, steps, until)
            self.up_reqs = self.comm.start_send(self.up_meta, 0, META_TAG) + \
                self.comm.start_send(self.up_row.numpy(), 0, ROW_TAG)

    def _train(self, k: int, version: int, state: torch.Tensor, extras: torch.Tensor,
               meta: np.ndarray, row: torch.Tensor, steps: int = 0,
               until: Optional[float] = None) -> None:
        """Client ``k``'s update from θ_version = ``state`` into ``meta`` and ``row``;
        ``steps``/``until`` as the job's header says (module docstring)."""
        b, worker = self.b, self.worker
        mask = np.zeros(self.K, dtype=bool)
        mask[k] = True
        b.algo.begin_round(version, mask, state, extras)
        meta.fill(0.0)
        t0 = time.perf_counter()
        task = worker.task(k, version)
        task.local_steps, task.until = steps or None, until
        try:
            result = worker.train(task, b.transforms.received(state), extras, worker.scratch)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, then the job stops
            meta[M_STATUS] = STATUS_FAILED
            text = worker.error_line(exc, k, version)
            raw = text.encode()[: ERR_BYTES - 1]
            meta[self.F + 1:].view(np.uint8)[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        else:
            finite = all(all_finite(v) for v in worker.scratch.values())
            raw_w = b.weighting.raw(k)
            meta[: self.F] = (STATUS_OK if finite else STATUS_NONFINITE, raw_w, result.loss_sum,
                              result.samples, result.steps, 0.0,
                              *b.reports.take_client_values(k))
            for stat, off in self.plan.gathered:
                row[off:off + stat.size].copy_(worker.scratch[stat.name])
        if b.device.type == "cuda":
            torch.cuda.synchronize(b.device)
        meta[M_TIME] = time.perf_counter() - t0
        meta[self.F] = signals.requested_signum()
