"""Rounds that do not wait for the slowest silo: the deadline and buffered round policies
(:mod:`fedmpi.round.modes`) over point-to-point messages.

Rank 0 runs the policy; one *job* is one client's local training from one model version.

* **Down.** A job (client k, version v) travels to the rank hosting k as an int64 header
  [JOB, k, v, flags] and θ_v (a copy of θ kept on rank 0 until every send of that version
  completed). The rank trains k from θ_v with the RNG stream (seed, k, v) — a client
  never trains twice from one version — so an update is a function of (k, v) alone,
  whatever rank computes it and whenever.
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

Every step's row records each update's model version, staleness weight and arrival time
(``/clients/version``, ``/clients/staleness_weight``, ``/clients/arrival_seconds``) and
the clock's time of the step (``/rounds/virtual_seconds`` on the virtual clock,
``/rounds/elapsed_seconds`` on the wall clock).
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from fedmpi.component import ClientTask
from fedmpi.round.modes import INF, Actions, Buffered, Deadline, Job, Mode, Step
from fedmpi.round.staleness import Staleness
from fedmpi.runtime.server import (M_RAW, M_STATUS, M_TIME, STATUS_FAILED, STATUS_NONFINITE,
                                   STATUS_OK, Uplink)
from fedmpi.training.loop import stream_seed
from fedmpi.training.vecops import all_finite

if TYPE_CHECKING:
    from fedmpi.runtime.federation import Federation

CMD_JOB = 3
HEAD_TAG, STATE_TAG, META_TAG, ROW_TAG = 41_001, 41_002, 41_003, 41_004
ERR_BYTES = 1024


def make_mode(fed: Federation, start: int) -> Mode:
    """The run's round policy, at step ``start`` (a resumed run)."""
    r, cfg = fed.cfg.round, fed.cfg
    st = Staleness(r.staleness, r.staleness_a, r.staleness_b, r.max_staleness)
    steps = cfg.train.rounds
    mode: Mode
    if r.mode == "deadline":
        assert r.deadline is not None, "round_checks requires it"
        mode = Deadline(cfg.seed, fed.K, fed.m, steps, r.deadline, r.min_updates, r.late, st,
                        timeout=cfg.runtime.round_timeout)
    else:
        mode = Buffered(cfg.seed, fed.K, r.concurrency or fed.m, steps, r.buffer, st)
    mode.version = start
    return mode


def work(fed: Federation, client: int) -> float:
    """Samples client ``client``'s local training processes (the virtual clock's work)."""
    t = fed.cfg.train
    if t.local_steps:
        return float(t.local_steps * t.batch_size)
    return float(t.local_epochs * fed.num_samples[client])


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

    def __init__(self, fed: Federation) -> None:
        self.fed = fed
        self.comm = fed.comm
        cfg = fed.cfg
        self.virtual = cfg.round.clock == "virtual"
        slow = cfg.system.slowdown
        self.slowdown = np.asarray(slow if slow is not None else [1.0] * fed.K, dtype=np.float64)
        self.unit = cfg.round.sample_seconds
        self.plan = fed.uplink_plan
        self.F = fed.channel.meta_fields
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
        self.P = fed.flat.num_params
        self.t0 = 0.0
        self.now = 0.0
        self.sent_down = 0
        # a worker: one update in flight
        self.up_meta = np.zeros(self.meta_len, dtype=np.float64)
        self.up_row = torch.zeros(self.plan.row_size, dtype=torch.float32)
        self.up_reqs: list = []

    # ------------------------------------------------------------------ clocks
    def clock(self) -> float:
        return self.now if self.virtual else time.monotonic() - self.t0

    def duration(self, job: Job) -> float:
        return float(self.slowdown[job.client] * work(self.fed, job.client) * self.unit)

    # ------------------------------------------------------------------ rank 0
    def round(self, t: int) -> int:
        """Round (server step) ``t`` on this rank; the command, as :meth:`Federation.round`."""
        fed = self.fed
        if not fed.is_server:
            return self._serve(t)
        from fedmpi.runtime.federation import CMD_ABORT, CMD_ROUND, CMD_STOP

        t_start = time.perf_counter()
        cmd = fed.plan_command(t)
        if cmd != CMD_ROUND:
            self._finish(t, cmd)
            return cmd
        if self.mode is None:
            self.t0 = time.monotonic()
            self.mode = make_mode(fed, t)
            self._apply(self.mode.begin(self.clock()))
        while not self.queue and fed.failure is None:
            self._next_event()
        if fed.failure is not None:
            return CMD_ROUND   # the next round's command is ABORT
        step, starts = self.queue.pop(0)
        self._step(t, step, t_start)
        for job in starts:
            self._send_job(job)
        return CMD_ROUND

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
        if getattr(self.mode, "timed_out", False):
            from fedmpi.comm.endpoint import CommTimeout

            raise CommTimeout(f"round {self.mode.version} did not reach round.min_updates="  # type: ignore[union-attr]
                              f"{self.fed.cfg.round.min_updates} accepted updates within "
                              f"runtime.round_timeout={self.fed.cfg.runtime.round_timeout:g}s")

    def _arrive(self, client: int) -> None:
        flight = self.flights.pop(client)
        self.arrived[flight.job] = flight
        assert self.mode is not None
        if int(flight.meta[M_STATUS]) == STATUS_FAILED:
            text = flight.meta[self.F + 1:].view(np.uint8).tobytes().rstrip(b"\0")
            self.fed.fail_client(client, text.decode(errors="replace"))
        signal = int(flight.meta[self.F])
        if signal:
            self.fed.worker_signal(int(self.fed.host[client]), signal)
        self._apply(self.mode.arrive(flight.job, self.clock()))

    def _apply(self, acts: Actions) -> None:
        """Queue the policy's steps; start its jobs now, or after the steps not yet
        applied (a job starts from the policy's newest version)."""
        for step in acts.steps:
            self.queue.append((step, []))
        if self.queue:
            self.queue[-1][1].extend(acts.start)
        else:
            for job in acts.start:
                self._send_job(job)

    def _send_job(self, job: Job) -> None:
        fed = self.fed
        dest = int(fed.host[job.client])
        state = fed.state.dev
        if job.version not in self.buffers and self.P < fed.D:
            self.buffers[job.version] = state[self.P: fed.D].clone()
        end = self.clock() + self.duration(job) if self.virtual else INF
        if dest == 0:   # world size 1: rank 0 trains the job itself, now
            meta = np.zeros(self.meta_len, dtype=np.float64)
            row = torch.zeros(self.plan.row_size, dtype=torch.float32, device=fed.device)
            self._train(job.client, job.version, state[: fed.D], state[fed.D:], meta, row)
            self.flights[job.client] = _Flight(job, [], meta, row, end)
            return
        if job.version not in self.versions:
            self._reap()
            self.versions[job.version] = (state.detach().to("cpu", copy=True), [])
        theta, sends = self.versions[job.version]
        head = np.array([CMD_JOB, job.client, job.version, 0], dtype=np.int64)
        reqs = self.comm.start_send(head, dest, HEAD_TAG)
        self.heads.append((head, reqs))
        sends.append(self.comm.start_send(theta.numpy(), dest, STATE_TAG))
        self.sent_down += head.nbytes + theta.numpy().nbytes
        meta = np.zeros(self.meta_len, dtype=np.float64)
        row = torch.zeros(self.plan.row_size, dtype=torch.float32)
        recv = self.comm.start_recv(meta, dest, META_TAG) + \
            self.comm.start_recv(row.numpy(), dest, ROW_TAG)
        self.flights[job.client] = _Flight(job, recv, meta, row, end)

    def _reap(self) -> None:
        """Drop the θ copies and headers whose sends completed."""
        MPI = self.comm.MPI
        for v in [v for v, (_, sends) in self.versions.items()
                  if all(MPI.Request.Testall(s) for s in sends)]:
            del self.versions[v]
        self.heads = [(h, r) for h, r in self.heads if not MPI.Request.Testall(r)]

    def _step(self, t: int, step: Step, t_start: float) -> None:
        """Apply ``step`` as round ``t`` (server step, log row, evaluation), then start the
        jobs the policy started after it."""
        fed = self.fed
        assert step.version == t, (step.version, t)
        fed.reports.round = t
        updates = sorted(step.updates, key=lambda u: u.job.client)
        K = fed.K
        meta = np.zeros((K, self.F), dtype=np.float64)
        mask = np.zeros(K, dtype=bool)
        clients = np.asarray([u.job.client for u in updates], dtype=np.int64)
        rows = torch.zeros((len(updates), self.plan.row_size), dtype=torch.float32,
                           device=fed.device)
        version = np.full(K, np.nan)
        weight = np.full(K, np.nan)
        arrival = np.full(K, np.nan)
        bytes_up = 0
        for i, u in enumerate(updates):
            f = self.arrived.pop(u.job)
            k = u.job.client
            meta[k] = f.meta[: self.F]
            mask[k] = True
            rows[i].copy_(f.row)
            for stat, off in self.plan.gathered:
                if stat.name == "delta" and u.staleness and self.P < fed.D:
                    # float buffers are statistics, not trained: a stale update's
                    # b_k − b_v is rebased on the current b (b_k − b_now), so the step
                    # averages the clients' statistics (a stale Δ of running variances
                    # added to newer ones can turn them negative)
                    rows[i, off + self.P:off + fed.D].add_(self.buffers[u.job.version])
                    rows[i, off + self.P:off + fed.D].sub_(fed.state.dev[self.P: fed.D])
                if stat.combine == "weighted" and u.weight != 1.0:
                    rows[i, off:off + stat.size].mul_(u.weight)
            version[k], weight[k], arrival[k] = u.job.version, u.weight, u.arrived
            bytes_up += f.meta.nbytes + f.row.numpy().nbytes
        for u in step.dropped:
            self.arrived.pop(u.job, None)
            fed.reports_round.event(f"update of client {u.job.client} (from step {u.job.version}, "
                                    f"staleness {u.staleness}) dropped", client=u.job.client)
        gathered = {s.name: rows[:, off:off + s.size] for s, off in self.plan.gathered}
        signals = np.zeros(fed.size, dtype=np.int64)
        up = Uplink(round=t, mask=mask, meta=meta, rows=gathered, row_clients=clients,
                    signals=signals)
        rep = fed.reports_round
        rep.clients("version", version)
        rep.clients("staleness_weight", weight)
        rep.clients("arrival_seconds", arrival)
        rep.scalar("virtual_seconds" if self.virtual else "elapsed_seconds", step.time)
        if step.missing:
            rep.event(f"round {t} closed without clients {list(step.missing)} (still training)")
        fed.async_server_round(t, up, t_start, (bytes_up, self.sent_down))
        self.sent_down = 0
        live = {f.job.version for f in self.flights.values()} | \
            {j.version for j in self.arrived} | {j.version for _, js in self.queue for j in js}
        for v in [v for v in self.buffers if v not in live and v < t + 1]:
            del self.buffers[v]

    def _finish(self, t: int, cmd: int) -> None:
        """Rank 0 at the stop: wait for the jobs in flight (discarded), then STOP/ABORT."""
        fed = self.fed
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
        flags = fed.stop_flags(cmd, t)
        heads = []
        for r in range(1, fed.size):
            head = np.array([cmd, -1, t, flags], dtype=np.int64)
            heads.append((head, self.comm.start_send(head, r, HEAD_TAG)))
        self.comm.wait([r for _, r in heads], "stop headers", patient=False)
        fed.after_stop_header(t, flags)

    # ------------------------------------------------------------------ workers
    def _serve(self, t: int) -> int:
        """A worker: train the jobs rank 0 sends until it sends STOP or ABORT."""
        fed = self.fed
        head = np.zeros(4, dtype=np.int64)
        while True:
            self.comm.wait([self.comm.start_recv(head, 0, HEAD_TAG)], "next job header")
            cmd, client, version, flags = (int(x) for x in head)
            if cmd != CMD_JOB:
                if self.up_reqs:
                    self.comm.wait([self.up_reqs], "last update send", patient=False)
                    self.up_reqs = []
                fed.after_stop_header(version, flags)
                return cmd
            self.comm.wait([self.comm.start_recv(fed.state.host, 0, STATE_TAG)], "θ of a job",
                           patient=False)
            fed.state.push()
            if self.up_reqs:   # the previous update must be out before its buffers are reused
                self.comm.wait([self.up_reqs], "previous update send", patient=False)
                self.up_reqs = []
            self._train(client, version, fed.state.dev[: fed.D], fed.state.dev[fed.D:],
                        self.up_meta, self.up_row)
            self.up_reqs = self.comm.start_send(self.up_meta, 0, META_TAG) + \
                self.comm.start_send(self.up_row.numpy(), 0, ROW_TAG)

    def _train(self, k: int, version: int, state: torch.Tensor, extras: torch.Tensor,
               meta: np.ndarray, row: torch.Tensor) -> None:
        """Client ``k``'s update from θ_version = ``state`` into ``meta`` and ``row``."""
        fed = self.fed
        mask = np.zeros(fed.K, dtype=bool)
        mask[k] = True
        fed.algo.begin_round(version, mask, state, extras)
        meta.fill(0.0)
        t0 = time.perf_counter()
        worker = fed.worker
        task = ClientTask(k, version, fed.client_idx[k], stream_seed(fed.cfg.seed, k, version))
        try:
            result = worker.train(task, fed.transforms.received(state), extras, fed.scratch)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, then the job stops
            meta[M_STATUS] = STATUS_FAILED
            text = fed.client_error_line(exc, k, version)
            raw = text.encode()[: ERR_BYTES - 1]
            meta[self.F + 1:].view(np.uint8)[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        else:
            finite = all(all_finite(v) for v in fed.scratch.values())
            raw_w = fed.weighting.raw(k)
            meta[: self.F] = (STATUS_OK if finite else STATUS_NONFINITE, raw_w, result.loss_sum,
                              result.samples, result.steps, 0.0,
                              *fed.reports.take_client_values(k))
            for stat, off in self.plan.gathered:
                row[off:off + stat.size].copy_(fed.scratch[stat.name])
        if fed.device.type == "cuda":
            torch.cuda.synchronize(fed.device)
        meta[M_TIME] = time.perf_counter() - t0
        meta[self.F] = fed.signal_now()
