"""What a round decides, as event-driven state machines: who trains from which model
version, when the server applies a step, and what a late update counts for.

A *job* is one client's local training from model version ``version`` (the number of
server steps applied before it started). A policy is fed two kinds of events by a
driver — a job's update arrived (:meth:`Mode.arrive`), or the time passed the policy's
own timer (:meth:`Mode.wake`) — and answers with :class:`Actions`: the server steps to
apply now (each the list of updates it aggregates, with their staleness weights) and the
jobs to start now. The same policies run under the wall clock (the driver feeds real
arrivals, :mod:`fedmpi.round.clock` names them) and under the virtual clock (the driver
simulates arrivals from each job's virtual duration), so which updates make a step is
decided by one implementation whatever the clock.

* :class:`Synchronous` — round t: the participants S_t (m of K, RNG (seed, t)) train
  from θ^t; the step is applied when all have reported (FedAvg's round).
* :class:`Deadline` — round t closes at ``deadline`` seconds after θ^t was sent, or as
  soon as every participant has reported, and never with fewer than ``min_updates``
  updates (it waits for them, up to ``timeout``). A participant still training when its
  round closes is *late*: its update is dropped (``late: drop``) or aggregated by the
  next step that closes after it arrives, with staleness weight s(τ) (``late: carry``).
  A late client is busy until it reports, so the next rounds sample among the idle
  clients (S_t with the busy clients replaced by idle ones, RNG (seed, t)): with no late
  client, the rounds are exactly :class:`Synchronous`'s. With ``time_budget`` each job
  carries the round's deadline as its budget: the client trains as many local steps as
  fit in it (FedNova's normalisation, ``algorithm.name: fednova``, removes the bias of
  unequal step counts: Wang et al. 2020, Eq. 6).
* :class:`Buffered` — FedBuff (Nguyen et al., AISTATS 2022, Alg. 1): ``concurrency``
  clients train at all times; each arriving update of staleness τ ≤ ``max_staleness`` is
  buffered with weight s(τ); after ``buffer`` updates the server applies a step. Clients
  (RNG (seed, job number)) among the idle ones start from the newest version whenever
  fewer than ``concurrency`` train; a client whose update waits in the buffer is not idle
  until the step applies it (one update per client and step); ``buffer: 1`` applies every
  update as it arrives (FedAsync's schedule, Xie et al. 2019).
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from fedmpi.round.staleness import Staleness

INF = math.inf


@dataclass(frozen=True)
class Job:
    """One local training: ``client`` from model version ``version``, started at ``start``
    (seconds on the driver's clock); ``round`` is the round it was started for (the
    version for :class:`Buffered`). The driver turns ``budget`` into local steps
    (:mod:`fedmpi.runtime.asynchronous`)."""

    client: int
    version: int
    start: float
    round: int
    #: seconds it may train before its round's deadline (``round.time_budget``); inf: none
    budget: float = INF
    #: local steps it must take (a replay of a time-budget run); 0: as configured
    steps: int = 0


@dataclass(frozen=True)
class Update:
    """An arrived update as a step aggregates it: τ = step − version, weight s(τ)."""

    job: Job
    arrived: float
    staleness: int
    weight: float


@dataclass(frozen=True)
class Step:
    """A server step: version ``version`` → ``version + 1`` from ``updates`` (client order
    of arrival), applied at ``time``; ``participants`` are the clients of the round it
    closes (all of its updates' clients for :class:`Buffered`)."""

    version: int
    time: float
    updates: tuple[Update, ...]
    dropped: tuple[Update, ...] = ()
    missing: tuple[int, ...] = ()   # participants of the round still training at the close


@dataclass
class Actions:
    steps: list[Step] = field(default_factory=list)
    start: list[Job] = field(default_factory=list)


def sample(seed: int, num_clients: int, m: int, t: int) -> np.ndarray:
    """Boolean mask of S_t: m of K clients without replacement, RNG (seed, t)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E1EC7, t]))
    mask = np.zeros(num_clients, dtype=bool)
    mask[rng.choice(num_clients, size=m, replace=False)] = True
    return mask


def sample_idle(seed: int, num_clients: int, m: int, t: int, busy: set[int]) -> list[int]:
    """S_t with its busy clients replaced by idle ones drawn with RNG (seed, t, 1): equal
    to :func:`sample` when no client is busy."""
    chosen = [int(k) for k in np.flatnonzero(sample(seed, num_clients, m, t)) if k not in busy]
    short = min(m, num_clients - len(busy)) - len(chosen)
    if short > 0:
        idle = [k for k in range(num_clients) if k not in busy and k not in chosen]
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E1EC7, t, 1]))
        chosen += [int(k) for k in rng.choice(idle, size=short, replace=False)]
    return sorted(chosen)


class Mode(abc.ABC):
    """A round policy: fed arrivals and timers, answers with :class:`Actions`."""

    #: the server steps this run applies (``train.rounds``)
    steps: int
    #: the model version the next step produces from (steps applied so far)
    version: int = 0
    #: a round waited ``runtime.round_timeout`` for ``min_updates`` in vain
    timed_out: bool = False

    @abc.abstractmethod
    def begin(self, now: float) -> Actions:
        """The jobs (and steps) at the start of the run, at clock time ``now``."""

    @abc.abstractmethod
    def arrive(self, job: Job, now: float) -> Actions:
        """``job``'s update arrived at clock time ``now``."""

    def timer(self) -> float:
        """The clock time at which :meth:`wake` must be called (inf: none)."""
        return INF

    def wake(self, now: float) -> Actions:
        return Actions()

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the policy has produced its last step."""


class Deadline(Mode):
    """Deadline rounds (module docstring); ``deadline = inf`` and ``min_updates = m`` is the
    synchronous round."""

    def __init__(self, seed: int, num_clients: int, per_round: int, steps: int,
                 deadline: float = INF, min_updates: int = 1, late: str = "drop",
                 staleness: Staleness = Staleness(), timeout: float = INF,
                 time_budget: bool = False) -> None:
        if late not in ("drop", "carry"):
            raise ValueError(f"late must be drop or carry, got {late!r}")
        self.seed, self.K, self.m, self.steps = seed, num_clients, per_round, steps
        self.deadline, self.min_updates, self.late = deadline, min_updates, late
        self.staleness, self.timeout = staleness, timeout
        self.budget = deadline if time_budget else INF
        self.version = 0
        self.opened = 0.0
        self.waiting: set[int] = set()     # this round's participants still training
        self.busy: dict[int, Job] = {}     # every running job, by client
        self.updates: list[Update] = []
        self.dropped: list[Update] = []
        self.timed_out = False

    @property
    def done(self) -> bool:
        return self.version >= self.steps

    def begin(self, now: float) -> Actions:
        return Actions(start=self._open(now))

    def _open(self, now: float) -> list[Job]:
        if self.done:
            return []
        self.opened = now
        clients = sample_idle(self.seed, self.K, self.m, self.version, set(self.busy))
        jobs = [Job(k, self.version, now, self.version, self.budget) for k in clients]
        self.waiting = set(clients)
        self.busy.update((j.client, j) for j in jobs)
        return jobs

    def timer(self) -> float:
        if self.done:
            return INF
        if len(self.updates) >= self.min_updates:
            return self.opened + self.deadline
        return self.opened + max(self.deadline, self.timeout)

    def arrive(self, job: Job, now: float) -> Actions:
        del self.busy[job.client]
        tau = self.version - job.version
        update = Update(job, now, tau, self.staleness.weight(tau))
        if job.round == self.version:
            self.waiting.discard(job.client)
            self.updates.append(update)
        elif self.late == "carry" and self.staleness.keeps(tau):
            self.updates.append(update)
        else:
            self.dropped.append(update)
        # min_updates reached after the deadline; an update arriving exactly at it makes it,
        # and so do the others due at that instant (the timer, woken after them, closes)
        past = now > self.opened + self.deadline
        if (past or not self.waiting) and len(self.updates) >= self.min_updates:
            return self._close(now)
        return Actions()

    def wake(self, now: float) -> Actions:
        if len(self.updates) >= self.min_updates:
            return self._close(now)
        if now >= self.opened + self.timeout:
            self.timed_out = True
        return Actions()

    def _close(self, now: float) -> Actions:
        step = Step(self.version, now, tuple(self.updates), tuple(self.dropped),
                    tuple(sorted(self.waiting)))
        self.version += 1
        self.updates, self.dropped = [], []
        return Actions(steps=[step], start=self._open(now))


class Buffered(Mode):
    """Buffered asynchronous aggregation (module docstring). A client contributes at most
    one update to a step: one whose update waits in the buffer starts again from the step
    that applies it."""

    def __init__(self, seed: int, num_clients: int, concurrency: int, steps: int,
                 buffer: int = 1, staleness: Staleness = Staleness()) -> None:
        if not 1 <= concurrency <= num_clients:
            raise ValueError(f"concurrency must be in [1, {num_clients}], got {concurrency}")
        if not 1 <= buffer <= concurrency:
            raise ValueError(f"buffer must be in [1, concurrency = {concurrency}], got {buffer}")
        self.seed, self.K, self.C, self.steps = seed, num_clients, concurrency, steps
        self.B, self.staleness = buffer, staleness
        self.version = 0
        self.started = 0
        self.busy: set[int] = set()      # training
        self.parked: set[int] = set()    # their update waits in the buffer
        self.updates: list[Update] = []
        self.dropped: list[Update] = []

    @property
    def done(self) -> bool:
        return self.version >= self.steps

    def begin(self, now: float) -> Actions:
        # from the step the run (re)starts at: 0, or a checkpoint's
        v = self.version
        clients = [int(k) for k in np.flatnonzero(sample(self.seed, self.K, self.C, v))]
        self.busy.update(clients)
        self.started = len(clients)
        return Actions(start=[Job(k, v, now, v) for k in clients])

    def arrive(self, job: Job, now: float) -> Actions:
        self.busy.discard(job.client)
        tau = self.version - job.version
        update = Update(job, now, tau, self.staleness.weight(tau))
        if self.staleness.keeps(tau):
            self.updates.append(update)
            self.parked.add(job.client)
        else:
            self.dropped.append(update)
        out = Actions()
        if len(self.updates) >= self.B:
            out.steps.append(Step(self.version, now, tuple(self.updates), tuple(self.dropped)))
            self.version += 1
            self.updates, self.dropped = [], []
            self.parked.clear()
        while not self.done and len(self.busy) < self.C:
            idle = [k for k in range(self.K) if k not in self.busy and k not in self.parked]
            if not idle:
                break
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0xB0FF, self.started]))
            k = int(rng.choice(idle))
            self.busy.add(k)
            self.started += 1
            out.start.append(Job(k, self.version, now, self.version))
        return out


def synchronous(seed: int, num_clients: int, per_round: int, steps: int) -> Deadline:
    """FedAvg's round as a policy: no deadline, the step when every participant reported."""
    return Deadline(seed, num_clients, per_round, steps, deadline=INF, min_updates=1)


class Replay(Mode):
    """A recorded deadline or buffered run again (``runtime.replay``): step t aggregates
    exactly the updates (client k, version v, weight s) the record lists for it.

    An update is a function of (k, v) alone (the client trains from θ_v with the RNG
    stream (seed, k, v)), so the replay's model is the original's whatever the arrival
    order. Job (k, v) starts when θ_v is the newest model and k has no job in flight (each
    client's jobs in version order, as the original ran them); step t is applied once its
    updates are in *and* every job of version t has started (else a client still busy
    could not start from θ_t any more). Jobs whose updates the original dropped are not
    run: they changed nothing. A job of a ``time_budget`` run takes the local steps the
    original took (``local_steps``), which on the wall clock depended on the machine.
    """

    def __init__(self, record: list[list[tuple[int, int, float]]], start: int = 0,
                 local_steps: Optional[dict[tuple[int, int], int]] = None) -> None:
        self.record, self.steps, self.version = record, len(record), start
        #: (client, version) → the local steps the original job took (a time-budget run)
        self.local_steps = local_steps or {}
        todo: dict[int, list[int]] = {}
        for t in range(start, self.steps):
            for k, v, _ in record[t]:
                if v < start:
                    raise ValueError(f"step {t} of the record aggregates an update from "
                                     f"version {v}, before the resumed step {start}")
                todo.setdefault(k, []).append(v)
        self.todo = {k: sorted(vs) for k, vs in todo.items()}   # per client, to start
        self.busy: set[int] = set()
        self.arrived: dict[tuple[int, int], tuple[Job, float]] = {}

    @property
    def done(self) -> bool:
        return self.version >= self.steps

    def begin(self, now: float) -> Actions:
        return Actions(start=self._start(now))

    def _start(self, now: float) -> list[Job]:
        jobs = []
        for k in sorted(self.todo):
            vs = self.todo[k]
            if vs and vs[0] == self.version and k not in self.busy:
                v = vs.pop(0)
                jobs.append(Job(k, v, now, self.version, steps=self.local_steps.get((k, v), 0)))
                self.busy.add(k)
        return jobs

    def arrive(self, job: Job, now: float) -> Actions:
        self.busy.discard(job.client)
        self.arrived[(job.client, job.version)] = (job, now)
        steps: list[Step] = []
        start = self._start(now)   # a client that was busy at its version's turn
        while not self.done and self._ready():
            t = self.version
            updates = []
            for k, v, w in self.record[t]:
                j, at = self.arrived.pop((k, v))
                updates.append(Update(j, at, t - v, w))
            steps.append(Step(t, now, tuple(updates)))
            self.version += 1
            start += self._start(now)
        return Actions(steps=steps, start=start)

    def _ready(self) -> bool:
        t = self.version
        started = all(not vs or vs[0] != t for vs in self.todo.values())
        return started and all((k, v) in self.arrived for k, v, _ in self.record[t])
