"""A rank's end of a communicator: its state, the size of a message's pieces, how it
waits, and what a timeout says.

Every collective is issued non-blocking and completed by :meth:`Endpoint._wait` in
one of two ways:

* *patient* (the default): ``Test()`` back to back for at most ``spin`` seconds
  (yielding the core), then a *sleeping* poll with exponential back-off up to
  ``max_sleep``. For the collectives that wait on other ranks' work (the round
  header, which waits for aggregation; the metadata ``Allreduce``, which waits
  for local training). MPICH and Open MPI spin in blocking calls for as long as
  they wait, which on a node where the aggregator and workers share cores would
  steal CPU from local training; here such a wait costs at most ``spin`` seconds
  of CPU and completes at most ``max_sleep`` late.
* *eager* (``patient=False``): ``Test()`` back to back (yielding) until done. For
  the data transfers that follow a patient collective, when every peer is known
  to be there: MPI progresses a non-blocking collective only inside ``Test``, so
  a sleeping rank would stall the pipelined algorithms of large Reduce/Bcast.
A collective that does not complete within ``timeout`` seconds on rank 0 (two timeouts
and :data:`WORKER_GRACE` on a worker, so that rank 0 reports first, in one line) raises
:class:`CommTimeout` (the runtime then aborts the whole job). A collective cannot say
who is missing, so before raising rank 0 pings every worker (point-to-point, tag
:data:`PING_TAG`) and waits :data:`PING_GRACE` seconds for the answers: a worker
answers during a run (:meth:`Endpoint.answering_pings`: a thread that checks for
a ping every :data:`PING_POLL` seconds, or, where MPI grants no
``MPI_THREAD_MULTIPLE``, the worker's own waits), with the MPI step it is in. The
error names each rank that did not answer, with its host (dead, hung or cut off), and
each live rank that has not reached the collective (still computing, or waiting in
another one).

A message is moved in pieces of at most :meth:`Endpoint.chunk` elements:
:data:`STREAM_BYTES` (16 MiB) by default, or ``max_message_bytes``
(``runtime.max_message_bytes``), never above :data:`CHUNK` = 2^30 elements (MPI counts are
C ints; APPFL hit the 2^31 − 1 limit with large models).

Longer than ~300 lines because the wait policy and the timeout's roll call of ranks are
one piece: a wait that times out on rank 0 asks who is missing.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

from fedmpi.comm.library import load_mpi

CHUNK = 1 << 30  # elements per MPI call; below the 2**31 - 1 count limit
#: bytes per message of the streamed collectives unless ``max_message_bytes`` says otherwise
STREAM_BYTES = 1 << 24
WORKER_GRACE = 5.0  # seconds a worker waits beyond two timeouts (see Endpoint._wait)
ROLL_CALL_TAG = 31_031
PING_TAG = 31_032   # rank 0 → worker after a timeout: "are you there?"
PONG_TAG = 31_033   # worker → rank 0: the answer, the MPI step the worker is in
#: seconds between a worker's checks for a ping (10 cheap ``Iprobe`` a second)
PING_POLL = 0.1
#: seconds rank 0 waits for the answers after a timeout: 30 polls, room for a loaded node
PING_GRACE = 3.0
WHERE_BYTES = 240   # a pong: the worker's step, UTF-8, zero-padded


class CommTimeout(RuntimeError):
    """A collective did not complete within ``runtime.round_timeout``."""


#: operations inside a silo (``runtime.ranks_per_silo``: its ranks' sums and relays), not on
#: the federation's links
SILO_OPS = ("group",)


@dataclass
class Traffic:
    """Bytes this rank handed MPI to send, by operation: a point-to-point message's
    buffer, a ``Bcast``'s buffer at its root (once: MPI forwards it to the other ranks),
    a sum's or a gather's send buffer (the reduction chain's pieces as each rank sends
    them; a gather's root sends nothing). Nothing where the world size is 1 (no message)."""

    sent: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        self.sent[op] = self.sent.get(op, 0) + int(nbytes)
        self.seconds[op] = self.seconds.get(op, 0.0) + seconds

    def wire(self) -> int:
        """Bytes handed to MPI on the federation's communicator (:data:`SILO_OPS` left out)."""
        return sum(n for op, n in self.sent.items() if op not in SILO_OPS)

    def total_seconds(self) -> float:
        return sum(self.seconds.values())


class Endpoint:
    """A rank on a communicator (``MPI.COMM_WORLD`` unless given): its rank and size, the
    world and silo group it belongs to, the bytes it moved (:class:`Traffic`), and the
    waits every transfer of :mod:`fedmpi.comm` completes with.

    Parameters
    ----------
    comm:
        The communicator (``MPI.COMM_WORLD`` when None).
    timeout:
        Seconds after which a pending collective raises :class:`CommTimeout`.
    max_sleep:
        Upper bound of the poll interval in seconds.
    spin:
        Seconds a patient wait tests back to back before it sleeps.
    max_message_bytes:
        Bytes per piece of a message (:meth:`chunk`); :data:`STREAM_BYTES` when None.
    """

    def __init__(self, comm=None, timeout: float = 600.0, max_sleep: float = 2e-3,
                 spin: float = 5e-3, max_message_bytes: Optional[int] = None) -> None:
        MPI = load_mpi()
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.timeout = timeout
        self.max_sleep = max_sleep
        self.spin = spin
        if max_message_bytes is not None and max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
        self.max_message_bytes = max_message_bytes
        self._slots: dict[str, np.ndarray] = {}   # the reduction chain's pieces, by dtype
        self._chain: Any = None   # a duplicate of ``comm`` for the chain (no tag meets another's)
        self.traffic = Traffic()
        #: the config key that set ``timeout`` (named in a CommTimeout message)
        self.timeout_key = "runtime.round_timeout"
        #: on rank 0, every rank's host name (the log's ``ranks/host``), named in a
        #: CommTimeout message; None until the run's rank table is gathered
        self.hosts: Optional[list[str]] = None
        # this rank's MPI step, what a pong reports: ("waiting in" | "past", what)
        self._where: tuple[str, str] = ("past", "start-up")
        self._answer_in_wait = False   # no MPI_THREAD_MULTIPLE: answer pings in _wait
        self._ping_on_timeout = False  # rank 0 inside answering_pings()
        self._pong: Optional[tuple] = None   # the answer in flight (request, buffer)
        self._pings: Optional[tuple] = None  # rank 0's pings in flight, with their buffers
        #: every process of the run: the roll call, the pings of a timeout, the node split
        #: and the abort reach each one. The communicator itself, unless several ranks act
        #: as one federation rank (:class:`~fedmpi.comm.silo.SiloComm`)
        self.world = self.comm
        self.world_rank: int = self.rank
        self.world_size: int = self.size
        #: the ranks of this rank's silo (``runtime.ranks_per_silo``), which train its
        #: clients data-parallel; None: the rank trains alone
        self.group: Any = None
        self.group_rank, self.group_size = 0, 1
        self._group_scratch: dict[tuple, np.ndarray] = {}   # group_gather's rows, by shape

    def chunk(self, dtype: np.dtype | type) -> int:
        """Elements of ``dtype`` per MPI call: :data:`STREAM_BYTES`, or
        ``max_message_bytes`` when set, at most ``CHUNK`` (at least one element)."""
        limit = STREAM_BYTES if self.max_message_bytes is None else self.max_message_bytes
        return max(1, min(CHUNK, limit // np.dtype(dtype).itemsize))

    def _chunks(self, n: int, dtype: np.dtype | type):
        step = self.chunk(dtype)
        for start in range(0, max(n, 1), step):
            yield slice(start, min(start + step, n))

    def _wait(self, requests: list, what: str, patient: bool = True,
              on_done: Optional[Callable[[int], None]] = None, ask: bool = True) -> None:
        """Complete ``requests``: a yielding spin, then (``patient``) a sleeping poll.

        MPI libraries progress a non-blocking collective only inside ``Test``,
        so we first test back to back (yielding the core with ``sched_yield`` to
        any co-located rank that wants it): a transfer whose peers are ready runs
        at full speed. A patient wait longer than ``spin`` (the aggregator waiting
        for local training) then sleeps with exponential back-off up to
        ``max_sleep``, costing no CPU; an eager one keeps spinning.

        ``on_done(i)``, if given, is called as soon as ``requests[i]`` completes
        (``Testsome``), so the caller can work on what arrived while the rest is
        in flight (FedVG scores a client model on arrival). ``ask``: on a timeout
        inside :meth:`answering_pings`, rank 0 asks who is missing (the roll call
        names them itself).
        """
        MPI = self.MPI
        start = time.monotonic()
        # workers wait longer (2 timeouts + WORKER_GRACE): the aggregator, which asks
        # who is missing (PING_GRACE < WORKER_GRACE), reports a timeout first, in one line
        deadline = start + (self.timeout if self.rank == 0 else 2 * self.timeout + WORKER_GRACE)
        spin_until = start + self.spin if patient else deadline
        next_poll = start + PING_POLL if self._answer_in_wait else float("inf")
        delay = 1e-5
        self._where = ("waiting in", what)
        while True:
            if on_done is None:
                if MPI.Request.Testall(requests):
                    break
            else:
                done = MPI.Request.Testsome(requests)
                if done is None:          # every request is complete
                    break
                for i in done:
                    on_done(i)
                if done:
                    delay = 1e-5
                    continue
            now = time.monotonic()
            if now >= next_poll:
                self._answer_ping()
                next_poll = now + PING_POLL
            if now < spin_until:
                os.sched_yield()
                continue
            if now > deadline:
                if self._ping_on_timeout and ask:
                    raise CommTimeout(f"{what} did not complete within {self.timeout_key}="
                                      f"{self.timeout:g}s: {self._who_is_missing(what)}")
                raise CommTimeout(
                    f"rank {self.world_rank}: {what} did not complete within {self.timeout_key}="
                    f"{self.timeout:g}s (a rank died or hangs)")
            time.sleep(delay)
            delay = min(delay * 2.0, self.max_sleep)
        self._where = ("past", what)

    def rank_name(self, rank: int) -> str:
        """``rank r (host h)``, or ``rank r`` where the hosts are not known (yet)."""
        if self.hosts is not None and rank < len(self.hosts):
            return f"rank {rank} (host {self.hosts[rank]})"
        return f"rank {rank}"

    def voice_name(self, rank: int) -> str:
        """Federation rank ``rank`` in a message: ``rank r`` (a silo of several ranks:
        ``silo r (ranks a, b, …)``, :class:`~fedmpi.comm.silo.SiloComm`)."""
        return f"rank {rank}"

    def _who_is_missing(self, what: str) -> str:
        """Rank 0, after ``what`` timed out: ping every worker, wait :data:`PING_GRACE`
        for the answers, and say which ranks did not answer (dead, hung or cut off) and
        which live ones are somewhere other than ``what``."""
        MPI = self.MPI
        ping = np.ones(1, dtype=np.int64)
        answers = {r: np.zeros(WHERE_BYTES, dtype=np.uint8) for r in range(1, self.world_size)}
        pending: dict[int, Any] = {}   # rank -> its pong's receive request
        failed: set[int] = set()   # MPI reported the connection to that rank broken
        sends = []
        for r, buf in answers.items():
            try:
                pending[r] = self.world.Irecv(buf, source=r, tag=PONG_TAG)
                sends.append(self.world.Isend(ping, dest=r, tag=PING_TAG))
            except MPI.Exception:
                failed.add(r)
        end = time.monotonic() + PING_GRACE
        while pending and time.monotonic() < end:
            for r, req in list(pending.items()):
                try:
                    if req.Test():
                        del pending[r]
                except MPI.Exception:
                    del pending[r]
                    failed.add(r)
            time.sleep(0.01)
        for req in pending.values():   # the job ends next; leave no receive posted
            with contextlib.suppress(MPI.Exception):
                req.Cancel()
        # MPI may still use these buffers (pings to a hung rank): keep them alive
        self._pings = (sends, ping, answers, list(pending.values()))
        silent = sorted([*pending, *failed])
        parts = []
        if silent:
            # without threads a worker answers only from its waits (answering_pings)
            busy = self.MPI.Query_thread() < self.MPI.THREAD_MULTIPLE
            names = ", ".join(self.rank_name(r) for r in silent)
            parts.append(f"{names} did not answer within {PING_GRACE:g}s (dead, hung"
                         f"{', unreachable or busy outside MPI' if busy else ' or unreachable'})")
        for r in range(1, self.world_size):
            if r in silent:
                continue
            state, _, step = bytes(answers[r]).rstrip(b"\0").decode(errors="replace").partition("\t")
            if state == "past" and step != what:
                parts.append(f"{self.rank_name(r)} is alive but has not reached {what} "
                             f"(busy outside MPI since {step})")
            elif step != what:
                parts.append(f"{self.rank_name(r)} is alive but {state} {step}")
        return "; ".join(parts) or "every rank answered from inside it (the MPI library did " \
            "not complete it)"

    def _answer_ping(self) -> None:
        """A worker: answer rank 0's ping, if one arrived, with this rank's MPI step."""
        if not self.world.Iprobe(source=0, tag=PING_TAG):
            return
        ping = np.zeros(1, dtype=np.int64)
        self.world.Recv(ping, source=0, tag=PING_TAG)   # arrived: returns at once
        text = "\t".join(self._where).encode()[: WHERE_BYTES]
        pong = np.zeros(WHERE_BYTES, dtype=np.uint8)
        pong[: len(text)] = np.frombuffer(text, dtype=np.uint8)
        self._pong = (self.world.Isend(pong, dest=0, tag=PONG_TAG), pong)

    @contextlib.contextmanager
    def answering_pings(self) -> Iterator[None]:
        """Collective in spirit (every rank enters it for a run): inside, rank 0
        pings the workers when a collective times out (:meth:`_who_is_missing`) and a
        worker answers, also while it computes: a daemon thread checks every
        :data:`PING_POLL` seconds (one ``Iprobe``; needs ``MPI_THREAD_MULTIPLE``, else
        only the worker's waits answer). Outside, a timeout names no rank: workers are
        not answering. A no-op on one rank."""
        if self.world_size == 1:
            yield
            return
        if self.rank == 0 or self.MPI.Query_thread() < self.MPI.THREAD_MULTIPLE:
            flag = "_ping_on_timeout" if self.rank == 0 else "_answer_in_wait"
            setattr(self, flag, True)
            try:
                yield
            finally:
                setattr(self, flag, False)
            return
        stop = threading.Event()

        def respond() -> None:
            while not stop.wait(PING_POLL):
                try:
                    self._answer_ping()
                except self.MPI.Exception:   # rank 0 is gone: the job is ending
                    return

        thread = threading.Thread(target=respond, name="fedmpi-ping", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def roll_call(self, what: str) -> None:
        """Every rank reports to rank 0 that it reached this point (``what``: e.g. its data
        is loaded); rank 0 waits at most ``timeout`` and otherwise raises
        :class:`CommTimeout` naming the ranks that did not arrive.

        Point-to-point, not a collective: a collective that times out cannot say who is
        missing. A worker's one-integer ``Isend`` completes at once (eager protocol), so
        workers go on to the next collective."""
        if self.world_size == 1:
            return
        tag = ROLL_CALL_TAG
        if self.world_rank != 0:
            mine = np.array([self.world_rank], dtype=np.int64)
            self._wait([self.world.Isend(mine, dest=0, tag=tag)], what, patient=False)
            return
        bufs = [np.zeros(1, dtype=np.int64) for _ in range(1, self.world_size)]
        reqs = [self.world.Irecv(b, source=r + 1, tag=tag) for r, b in enumerate(bufs)]
        arrived: set[int] = set()
        try:
            self._wait(reqs, what, on_done=lambda i: arrived.add(i + 1), ask=False)
        except CommTimeout:
            missing = [r for r in range(1, self.world_size) if r not in arrived]
            raise CommTimeout(f"start-up: {', '.join(map(self.rank_name, missing))} "
                              f"did not finish {what} within "
                              f"{self.timeout_key}={self.timeout:g}s (raise it for slow data "
                              "sources, or check that rank's data)") from None

    def abort(self, code: int = 1) -> None:
        """Terminate every rank of the job (used after an unrecoverable error)."""
        sys.stdout.flush()
        sys.stderr.flush()
        if self.world_size > 1:
            self.world.Abort(code)
        os._exit(code)
