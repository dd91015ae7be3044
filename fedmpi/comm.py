"""The only module of fedmpi that touches MPI.

Buffer (uppercase) mpi4py calls only, on contiguous host numpy arrays (or
device arrays when the MPI library is CUDA-aware); nothing is pickled.

Every collective is issued non-blocking and completed by :meth:`Comm._wait` in
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
answers during a run (:meth:`Comm.answering_pings`: a thread that checks for
a ping every :data:`PING_POLL` seconds, or, where MPI grants no
``MPI_THREAD_MULTIPLE``, the worker's own waits), with the MPI step it is in. The
error names each rank that did not answer, with its host (dead, hung or cut off), and
each live rank that has not reached the collective (still computing, or waiting in
another one).

Messages of any size, memory-bounded: every buffer call is split into pieces of at most
:meth:`Comm.chunk` elements -- :data:`STREAM_BYTES` (16 MiB) by default, or
``max_message_bytes`` (``runtime.max_message_bytes``), never above ``CHUNK`` = 2^30
elements (MPI counts are C ints; APPFL hit the 2^31 − 1 limit with large models). The
collectives stream: at most :data:`DEPTH` pieces are in flight per rank, and each piece is
summed (or written) as it arrives, so a rank holds its own buffers plus O(chunk) whatever
the message size. The reduction is a chain of point-to-point pieces in rank order
(:meth:`Comm.reduce_sum`), not ``MPI_Reduce``: MPICH's ``Reduce`` allocates a fresh
temporary of the whole message per call (1.5× the message more on every rank) and fills it
page fault by page fault, 26× slower than a ``Bcast`` of the same 515 MB at ``-n 2``
(``bench/large_exchange.py``). Chunks cut along elements that are combined independently
(a broadcast or gather moves bytes; the reduction adds each element over ranks 0, 1, … in
the same order in every chunk), so a chunked transfer gives the same bits as one call.

Longer than ~350 lines on purpose: it is the only module that touches MPI, so every
collective, wait policy, chunking rule and the timeout's roll call of ranks lives here.
"""
from __future__ import annotations

import contextlib
import os
from collections import deque
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

CHUNK = 1 << 30  # elements per MPI call; below the 2**31 - 1 count limit
#: bytes per message of the streamed collectives unless ``max_message_bytes`` says otherwise
STREAM_BYTES = 1 << 24
#: pieces in flight per rank in a streamed collective (a pipeline: one arriving, one being
#: summed or forwarded, one leaving)
DEPTH = 3
PART_TAG, TOTAL_TAG = 1, 2   # the reduction chain's messages (on its own duplicate communicator)
WORKER_GRACE = 5.0  # seconds a worker waits beyond two timeouts (see Comm._wait)
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


@dataclass
class Traffic:
    """Bytes this rank moved through MPI, by operation."""

    sent: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        self.sent[op] = self.sent.get(op, 0) + int(nbytes)
        self.seconds[op] = self.seconds.get(op, 0.0) + seconds

    def total_seconds(self) -> float:
        return sum(self.seconds.values())


def _mpi():
    from mpi4py import MPI  # imported lazily: `fedmpi check` works without MPI

    return MPI


class Comm:
    """Collectives over ``MPI.COMM_WORLD`` (or a given communicator).

    Parameters
    ----------
    timeout:
        Seconds after which a pending collective raises :class:`CommTimeout`.
    max_sleep:
        Upper bound of the poll interval in seconds.
    """

    def __init__(self, comm=None, timeout: float = 600.0, max_sleep: float = 2e-3,
                 spin: float = 5e-3, max_message_bytes: Optional[int] = None) -> None:
        MPI = _mpi()
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
        #: as one federation rank (:class:`SiloComm`)
        self.world = self.comm
        self.world_rank: int = self.rank
        self.world_size: int = self.size
        #: the ranks of this rank's silo (``runtime.ranks_per_silo``), which train its
        #: clients data-parallel; None: the rank trains alone
        self.group: Any = None
        self.group_rank, self.group_size = 0, 1
        self._group_scratch: dict[tuple, np.ndarray] = {}   # group_gather's rows, by shape

    # ------------------------------------------------------------------ waits
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

    # ------------------------------------------------------- who is missing
    def rank_name(self, rank: int) -> str:
        """``rank r (host h)``, or ``rank r`` where the hosts are not known (yet)."""
        if self.hosts is not None and rank < len(self.hosts):
            return f"rank {rank} (host {self.hosts[rank]})"
        return f"rank {rank}"

    def voice_name(self, rank: int) -> str:
        """Federation rank ``rank`` in a message: ``rank r`` (a silo of several ranks:
        ``silo r (ranks a, b, …)``, :class:`SiloComm`)."""
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

    def chunk(self, dtype: np.dtype | type) -> int:
        """Elements of ``dtype`` per MPI call: :data:`STREAM_BYTES`, or
        ``max_message_bytes`` when set, at most ``CHUNK`` (at least one element)."""
        limit = STREAM_BYTES if self.max_message_bytes is None else self.max_message_bytes
        return max(1, min(CHUNK, limit // np.dtype(dtype).itemsize))

    def _chunks(self, n: int, dtype: np.dtype | type):
        step = self.chunk(dtype)
        for start in range(0, max(n, 1), step):
            yield slice(start, min(start + step, n))

    def _stream(self, pieces: list[slice], post: Callable[[slice], Any], what: str,
                patient: bool, done: Optional[Callable[[slice], None]] = None) -> None:
        """Post one non-blocking call per piece (``post``), at most :data:`DEPTH` in
        flight; ``done(piece)`` once a piece completed, in order. Only the first wait is
        patient: once a piece has moved, every peer is there."""
        flight: deque = deque()

        def finish() -> None:
            piece, req = flight.popleft()
            self._wait([req], what, patient and piece.start == 0)
            if done is not None:
                done(piece)

        for piece in pieces:
            if len(flight) == DEPTH:
                finish()
            flight.append((piece, post(piece)))
        while flight:
            finish()

    # ------------------------------------------------------------ collectives
    def broadcast(self, buf: np.ndarray, root: int = 0, what: str = "Bcast",
                  patient: bool = True) -> None:
        """In-place broadcast of ``buf`` from ``root``, streamed (:meth:`_stream`)."""
        if self.size == 1:
            return
        t0 = time.perf_counter()
        flat = buf.reshape(-1)
        self._stream(list(self._chunks(flat.size, flat.dtype)),
                     lambda s: self.comm.Ibcast(flat[s], root=root), what, patient)
        sent = flat.nbytes * (self.size - 1) if self.rank == root else 0
        self.traffic.add("bcast", sent, time.perf_counter() - t0)

    def reduce_sum(self, sendbuf: Optional[np.ndarray], recvbuf: np.ndarray | None,
                   root: int = 0, what: str = "Reduce", patient: bool = True,
                   count: Optional[int] = None, dtype: Optional[np.dtype | type] = None) -> None:
        r"""``recvbuf = Σ_ranks sendbuf`` on ``root`` (``recvbuf`` ignored elsewhere), each
        element summed in rank order from +0.0: (((+0.0 + x_0) + x_1) + x_2) + … (the bits
        of ``numpy.sum`` over a [ranks, n] array). ``sendbuf`` None: this rank contributes
        zeros (a rank that hosts no client) without holding them; a non-root rank then
        names ``count`` and ``dtype``.

        A chain of point-to-point pieces (:meth:`chunk` elements each): rank 1 sends x_1
        to rank 0, which forms s_1 = x_0 + x_1; rank j ≥ 2 receives s_{j−1}, adds x_j and
        sends s_j on; the last partial sum is the total and goes to ``root``. Every piece
        is added the moment it arrives, with at most :data:`DEPTH` pieces in flight, so a
        rank holds its buffers plus ``DEPTH`` pieces, and each link carries the message
        once. Time ≈ (pieces + ranks − 1) piece transfers. The order of the additions
        is the order of ranks whatever the piece size, so the result does not depend on
        the chunking (IEEE addition is commutative: x_1 + x_0 has the bits of x_0 + x_1).
        """
        if self.size == 1:
            if sendbuf is None:
                recvbuf.fill(0)
            else:
                np.copyto(recvbuf, sendbuf)
            return
        t0 = time.perf_counter()
        send = sendbuf.reshape(-1) if sendbuf is not None else None
        recv = recvbuf.reshape(-1) if self.rank == root else None
        if count is None:
            ref = send if send is not None else recv
            assert ref is not None, "a rank without a buffer names the count and dtype"
            count, dtype = ref.size, ref.dtype
        assert dtype is not None
        self._chain_reduce(send, recv, count, np.dtype(dtype), root, what, patient)
        self.traffic.add("reduce", 0 if self.rank == root else count * np.dtype(dtype).itemsize,
                         time.perf_counter() - t0)

    def _chain_reduce(self, send: Optional[np.ndarray], recv: Optional[np.ndarray], n: int,
                      dtype: np.dtype, root: int, what: str, patient: bool) -> None:
        """The chain of :meth:`reduce_sum` on this rank (its docstring)."""
        r, size = self.rank, self.size
        if self._chain is None:   # collective: every rank reaches its first reduce together
            self._chain = self.comm.Dup()
        chain = self._chain
        last = 0 if size == 2 else size - 1          # holds the total after the chain
        source = None if r == 1 else 1 if r == 0 else 0 if r == 2 else r - 1
        dest = 0 if r == 1 else 2 if r == 0 and size > 2 else r + 1 if 1 < r < last else None
        if r == last:
            dest = None if root == last else root
        total_from = last if r == root and root != last else None
        tag = TOTAL_TAG if r == last else PART_TAG
        pieces = list(self._chunks(n, dtype))
        totals: deque = deque()

        def collect(s: slice) -> None:
            # a root that is not the last rank takes the total's pieces while its own part
            # of the chain runs: taken only after it, the last rank could not free a slot
            # (its piece of the total still leaving) and the chain would stall once a
            # message has more pieces than slots and outgrows MPI's eager sends
            if total_from is None:
                return
            assert recv is not None
            if len(totals) == DEPTH:
                self._wait([totals.popleft()], what, False)
            totals.append(chain.Irecv(recv[s], source=total_from, tag=TOTAL_TAG))

        if source is None:   # rank 1: its own pieces, straight from its buffer
            if send is None:   # it hosts nothing: zeros
                zero = self._slot_buffers(dtype, pieces[0].stop - pieces[0].start)[0]
                zero.fill(0)
                self._stream(pieces, lambda s: chain.Isend(zero[: s.stop - s.start], dest=dest,
                                                           tag=PART_TAG), what, patient, collect)
            else:
                self._stream(pieces, lambda s: chain.Isend(send[s], dest=dest, tag=PART_TAG),
                             what, patient, collect)
        else:
            in_place = r == root and dest is None   # the sum lands in recv itself
            slots = [] if in_place else self._slot_buffers(dtype, pieces[0].stop - pieces[0].start)
            outgoing: list[Any] = [None] * DEPTH    # a slot's send in flight

            def land(i: int, s: slice) -> np.ndarray:
                return recv[s] if in_place else slots[i % DEPTH][: s.stop - s.start]

            def post(i: int, s: slice) -> Any:
                if outgoing[i % DEPTH] is not None:   # the slot's last piece is still leaving
                    self._wait([outgoing[i % DEPTH]], what, False)
                    outgoing[i % DEPTH] = None
                return chain.Irecv(land(i, s), source=source, tag=PART_TAG)

            def add(i: int, s: slice, req: Any) -> None:
                self._wait([req], what, patient and i == 0)
                piece = land(i, s)
                if send is not None:
                    np.add(piece, send[s], out=piece)
                if r == 0 or send is None:   # the sum starts from +0.0, as numpy's does
                    np.add(piece, 0, out=piece)   # (-0.0 + -0.0 → +0.0); or adds zeros
                if dest is not None:
                    outgoing[i % DEPTH] = chain.Isend(piece, dest=dest, tag=tag)
                collect(s)

            pending: deque = deque()
            for i, s in enumerate(pieces):
                pending.append((i, s, post(i, s)))
                if len(pending) == DEPTH - 1:   # one piece arriving while one is added
                    add(*pending.popleft())
            while pending:
                add(*pending.popleft())
            waiting = [q for q in outgoing if q is not None]
            if waiting:
                self._wait(waiting, what, False)
        if totals:
            self._wait(list(totals), what, False)

    def _slot_buffers(self, dtype: np.dtype, size: int) -> list[np.ndarray]:
        """:data:`DEPTH` persistent pieces of ``dtype`` (kept between calls: fresh pages
        filled by the MPI library page fault by page fault)."""
        key = np.dtype(dtype).str
        buf = self._slots.get(key)
        if buf is None or buf.shape[1] < size:
            buf = self._slots[key] = np.empty((DEPTH, size), dtype=dtype)
        return [buf[i] for i in range(DEPTH)]

    def gatherv_rows(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, rows: list[int],
                     root: int = 0, what: str = "Gatherv", patient: bool = True) -> None:
        """Gather row blocks: rank ``r`` sends ``rows[r]`` rows of width ``P``.

        ``sendbuf`` is ``[rows[rank], P]``; on ``root`` ``recvbuf`` is
        ``[sum(rows), P]`` in rank order. A call larger than :meth:`chunk` elements
        goes in groups of whole rows, each rank's group straight from its buffer into
        its place in ``recvbuf`` (displacements); only rows wider than a chunk's share
        go in column blocks, staged through a copy.
        """
        width = sendbuf.shape[1]
        if self.size == 1:
            np.copyto(recvbuf[: rows[0]], sendbuf)
            return
        t0 = time.perf_counter()
        mpi_type = self.MPI._typedict[sendbuf.dtype.char]
        limit = self.chunk(sendbuf.dtype)
        senders = max(1, sum(1 for k in rows if k))
        if sum(rows) * width > limit and width * senders <= limit:
            self._gatherv_row_groups(sendbuf, recvbuf, rows, root, what, patient,
                                     limit // (width * senders))
            self.traffic.add("gatherv", 0 if self.rank == root else sendbuf.nbytes,
                             time.perf_counter() - t0)
            return
        step = width if sum(rows) * width <= limit else max(1, limit // max(1, sum(rows)))
        for c0 in range(0, width, step):
            c1 = min(width, c0 + step)
            direct = c0 == 0 and c1 == width
            part = sendbuf if direct else np.ascontiguousarray(sendbuf[:, c0:c1])
            counts = [r * (c1 - c0) for r in rows]
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
            out = None
            if self.rank == root:
                out = recvbuf if direct else np.empty((sum(rows), c1 - c0), dtype=sendbuf.dtype)
                req = self.comm.Igatherv([part, mpi_type], [out, counts, displs, mpi_type], root=root)
            else:
                req = self.comm.Igatherv([part, mpi_type], None, root=root)
            self._wait([req], what, patient)
            if out is not None and not direct:
                recvbuf[:, c0:c1] = out
        self.traffic.add("gatherv", 0 if self.rank == root else sendbuf.nbytes, time.perf_counter() - t0)

    def _gatherv_row_groups(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None,
                            rows: list[int], root: int, what: str, patient: bool,
                            group: int) -> None:
        """:meth:`gatherv_rows` in calls of at most ``group`` rows per rank: call ``k``
        moves rows ``[k·group, (k+1)·group)`` of every rank that has them."""
        width = sendbuf.shape[1]
        mpi_type = self.MPI._typedict[sendbuf.dtype.char]
        first = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(int).tolist()
        for k0 in range(0, max(rows), group):
            lo = [min(k0, k) for k in rows]
            hi = [min(k0 + group, k) for k in rows]
            part = sendbuf[lo[self.rank]: hi[self.rank]]
            if self.rank == root:
                assert recvbuf is not None
                counts = [(h - q) * width for q, h in zip(lo, hi)]
                displs = [(f + q) * width for f, q in zip(first, lo)]
                req = self.comm.Igatherv([part, mpi_type],
                                         [recvbuf, counts, displs, mpi_type], root=root)
            else:
                req = self.comm.Igatherv([part, mpi_type], None, root=root)
            self._wait([req], what, patient and k0 == 0)

    def scatterv_rows(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, rows: list[int],
                      root: int = 0, what: str = "Scatterv") -> None:
        """Inverse of :meth:`gatherv_rows`: rank ``r`` receives ``rows[r]`` rows.

        On ``root`` ``sendbuf`` is ``[sum(rows), P]`` in rank order; ``recvbuf``
        is ``[rows[rank], P]``. One MPI call: the caller keeps
        ``sum(rows)·P ≤ chunk(dtype)`` (checkpoint restore sends in blocks).
        """
        width = recvbuf.shape[1]
        if sum(rows) * width > self.chunk(recvbuf.dtype):
            raise ValueError(f"{what}: {sum(rows) * width} elements exceed one call "
                             f"({self.chunk(recvbuf.dtype)})")
        if self.size == 1:
            np.copyto(recvbuf, sendbuf[: rows[0]])
            return
        t0 = time.perf_counter()
        mpi_type = self.MPI._typedict[recvbuf.dtype.char]
        counts = [r * width for r in rows]
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        send = [sendbuf, counts, displs, mpi_type] if self.rank == root else None
        self._wait([self.comm.Iscatterv(send, [recvbuf, mpi_type], root=root)], what)
        self.traffic.add("scatterv", sendbuf.nbytes if self.rank == root else 0,
                         time.perf_counter() - t0)

    def gather_fixed(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int = 0,
                     what: str = "Gather", patient: bool = True) -> None:
        """Fixed-size gather: ``recvbuf[r] = sendbuf of rank r`` on ``root``."""
        if self.size == 1:
            np.copyto(recvbuf.reshape(1, -1), sendbuf.reshape(1, -1))
            return
        t0 = time.perf_counter()
        send = sendbuf.reshape(-1)
        if send.size * self.size <= self.chunk(send.dtype):
            req = self.comm.Igather(send, recvbuf if self.rank == root else None, root=root)
            self._wait([req], what, patient)
        else:
            out = recvbuf.reshape(self.size, send.size) if self.rank == root else None
            self.gatherv_rows(send.reshape(1, -1), out, [1] * self.size, root, what, patient)
        self.traffic.add("gather", 0 if self.rank == root else sendbuf.nbytes, time.perf_counter() - t0)

    def gather_processes(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None,
                         what: str = "Gather") -> None:
        """``recvbuf[r] = sendbuf`` of world rank r, on rank 0: one small row from every
        process (the rank table), members of a silo included."""
        if self.world_size == 1:
            np.copyto(recvbuf.reshape(1, -1), sendbuf.reshape(1, -1))
            return
        self._wait([self.world.Igather(sendbuf.reshape(-1),
                                       recvbuf if self.world_rank == 0 else None, root=0)], what)

    def start_send(self, buf: np.ndarray, dest: int, tag: int) -> list:
        """Buffer ``Isend`` of a contiguous array, one per :meth:`chunk` (same tag:
        MPI keeps messages between two ranks with one tag in order); returns the
        requests."""
        self.traffic.add("send", buf.nbytes, 0.0)
        flat = buf.reshape(-1)
        return [self.comm.Isend(flat[s], dest=dest, tag=tag)
                for s in self._chunks(flat.size, flat.dtype)]

    def start_recv(self, buf: np.ndarray, source: int, tag: int) -> list:
        """Buffer ``Irecv`` into a contiguous array, chunked as :meth:`start_send`;
        returns the requests."""
        flat = buf.reshape(-1)
        return [self.comm.Irecv(flat[s], source=source, tag=tag)
                for s in self._chunks(flat.size, flat.dtype)]

    def wait(self, requests: list, what: str, patient: bool = True,
             on_done: Optional[Callable[[int], None]] = None) -> None:
        """Complete requests from :meth:`start_send`/:meth:`start_recv` (see
        :meth:`_wait`): ``requests`` is a list of those calls' lists, and
        ``on_done(i)`` is called once every request of ``requests[i]`` is done."""
        if not requests:
            return
        flat = [r for group in requests for r in group]
        owner = [i for i, group in enumerate(requests) for _ in group]
        left = [len(group) for group in requests]

        def piece_done(j: int) -> None:
            i = owner[j]
            left[i] -= 1
            if left[i] == 0 and on_done is not None:
                on_done(i)

        self._wait(flat, what, patient, piece_done if on_done is not None else None)

    def wait_any(self, requests: list, what: str, until: float = float("inf")) -> list[int]:
        """Sleep-poll until at least one of ``requests`` (lists from :meth:`start_send` /
        :meth:`start_recv`) is complete, or ``time.monotonic()`` reaches ``until``; returns
        the indices of the complete ones (ascending; [] at ``until``). With no ``until``
        it raises :class:`CommTimeout` after the timeout, as :meth:`_wait` does."""
        MPI = self.MPI
        start = time.monotonic()
        limit = min(until, start + self.timeout)
        next_poll = start + PING_POLL if self._answer_in_wait else float("inf")
        delay = 1e-5
        self._where = ("waiting in", what)
        while True:
            done = [i for i, group in enumerate(requests) if MPI.Request.Testall(group)]
            if done:
                self._where = ("past", what)
                return done
            now = time.monotonic()
            if now >= next_poll:
                self._answer_ping()
                next_poll = now + PING_POLL
            if now >= limit:
                self._where = ("past", what)
                if limit >= until:
                    return []
                raise CommTimeout(f"rank {self.world_rank}: {what} did not complete within "
                                  f"{self.timeout_key}={self.timeout:g}s")
            time.sleep(min(delay, max(limit - now, 0.0)))
            delay = min(delay * 2.0, self.max_sleep)

    def allreduce_sum(self, sendbuf: np.ndarray, recvbuf: np.ndarray, what: str = "Allreduce",
                      patient: bool = True) -> None:
        """``recvbuf = Σ_ranks sendbuf`` on every rank."""
        if self.size == 1:
            np.copyto(recvbuf, sendbuf)
            return
        t0 = time.perf_counter()
        self._allreduce(sendbuf, recvbuf, self.MPI.SUM, what, patient)
        self.traffic.add("allreduce", sendbuf.nbytes, time.perf_counter() - t0)

    def _allreduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op, what: str,
                   patient: bool = True) -> None:
        send, recv = sendbuf.reshape(-1), recvbuf.reshape(-1)
        self._stream(list(self._chunks(send.size, send.dtype)),
                     lambda s: self.comm.Iallreduce(send[s], recv[s], op=op), what, patient)

    def allreduce_max(self, sendbuf: np.ndarray, recvbuf: np.ndarray,
                      what: str = "Allreduce") -> None:
        """``recvbuf = max_ranks sendbuf`` elementwise on every rank (small setup buffers)."""
        if self.size == 1:
            np.copyto(recvbuf, sendbuf)
            return
        self._allreduce(sendbuf, recvbuf, self.MPI.MAX, what)

    def max_int(self, value: int, what: str = "Allreduce") -> int:
        """Max of an integer over all ranks (setup agreement on error codes)."""
        if self.size == 1:
            return int(value)
        send = np.array([value], dtype=np.int64)
        recv = np.zeros(1, dtype=np.int64)
        self._wait([self.comm.Iallreduce(send, recv, op=self.MPI.MAX)], what)
        return int(recv[0])

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

    def node_local(self) -> tuple[int, int]:
        """(local rank, local size) among the processes sharing this node."""
        if self.world_size == 1:
            return 0, 1
        local = self.world.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.world_rank)
        try:
            return local.Get_rank(), local.Get_size()
        finally:
            local.Free()

    def barrier(self, what: str = "Barrier") -> None:
        if self.size > 1:
            self._wait([self.comm.Ibarrier()], what)

    def node_ids(self) -> list[int]:
        """Collective over every process: for each world rank, the lowest world rank on
        its node (MPI's shared-memory split), so equal numbers mean one node."""
        mine = np.array([self.world_rank], dtype=np.int64)
        if self.world_size > 1:
            local = self.world.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.world_rank)
            try:
                first = np.zeros(1, dtype=np.int64)
                self._wait([local.Iallreduce(mine, first, op=self.MPI.MIN)], "node split")
                mine = first
            finally:
                local.Free()
        ids = np.zeros(self.world_size, dtype=np.int64)
        if self.world_size == 1:
            ids[:] = mine
        else:
            self._wait([self.world.Iallgather(mine, ids)], "node table Allgather")
        return [int(i) for i in ids]

    # ------------------------------------------- the ranks of one silo (group)
    def group_sum(self, bufs: list[np.ndarray], what: str, ordered: bool = False,
                  patient: bool = False) -> None:
        """In place: each buffer summed over the ranks of this rank's silo, the same bits
        on every one of them. ``ordered``: an ``Allgather`` and the sum in group-rank
        order (0, 1, …), whatever the MPI library's algorithm (``runtime.reduction:
        exact``); else ``MPI_Allreduce``. Eager by default: the peers compute the same
        work (their share of one batch). A no-op for a rank that trains alone."""
        if self.group_size == 1:
            return
        t0 = time.perf_counter()
        reqs = []
        for buf in bufs:
            flat = buf.reshape(-1)
            if not ordered:
                reqs += [self.group.Iallreduce(self.MPI.IN_PLACE, flat[s], op=self.MPI.SUM)
                         for s in self._chunks(flat.size, flat.dtype)]
                continue
            step = max(1, self.chunk(flat.dtype) // self.group_size)
            for start in range(0, flat.size, step):
                piece = flat[start:start + step]
                np.sum(self.group_gather(piece, what, patient), axis=0, out=piece)
        self._wait(reqs, what, patient)
        self.traffic.add("group", sum(b.nbytes for b in bufs), time.perf_counter() - t0)

    def group_gather(self, buf: np.ndarray, what: str, patient: bool = False) -> np.ndarray:
        """``[group_size, buf.size]``, row r rank r's ``buf``, on every rank of the silo:
        one ``Allgather`` (``group_size × buf.size`` within :meth:`chunk`) into a
        persistent scratch of that shape (read it before the next such call)."""
        flat = np.ascontiguousarray(buf.reshape(-1))
        if self.group_size * flat.size > self.chunk(flat.dtype):
            raise ValueError(f"{what}: {self.group_size} x {flat.size} elements exceed one call")
        key = ("group", flat.size, flat.dtype.str)
        rows = self._group_scratch.get(key)
        if rows is None:
            rows = self._group_scratch[key] = np.empty((self.group_size, flat.size), flat.dtype)
        if self.group_size == 1:
            rows[0] = flat
        else:
            self._wait([self.group.Iallgather(flat, rows)], what, patient)
        return rows

    def group_broadcast(self, buf: np.ndarray, what: str, patient: bool = True) -> None:
        """In place: the silo leader's (group rank 0) ``buf`` on every rank of the silo."""
        if self.group_size == 1:
            return
        flat = buf.reshape(-1)
        self._wait([self.group.Ibcast(flat[s], root=0)
                    for s in self._chunks(flat.size, flat.dtype)], what, patient)

    def group_max(self, value: int, what: str = "silo Allreduce") -> int:
        """The largest ``value`` over the ranks of this rank's silo (a stop signal, an
        error code that one member alone may hold)."""
        if self.group_size == 1:
            return int(value)
        buf = np.array([value], dtype=np.int64)
        self._wait([self.group.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.MAX)], what)
        return int(buf[0])

    def abort(self, code: int = 1) -> None:
        """Terminate every rank of the job (used after an unrecoverable error)."""
        sys.stdout.flush()
        sys.stderr.flush()
        if self.world_size > 1:
            self.world.Abort(code)
        os._exit(code)


class SiloComm(Comm):
    """The federation as the runtime sees it when each silo is a group of ranks
    (``runtime.ranks_per_silo`` R > 1).

    Rank 0 and each group's *leader* form the federation communicator: ``rank`` and
    ``size`` are the federation's (rank 0 and silos 1..G), and its collectives run
    there unchanged. Every other rank of a group (a *member*) acts as its leader's
    shadow: it has the leader's federation rank, hosts the same clients and runs the
    same code; what a federation collective hands its leader (a broadcast, a sum, a
    scattered block) reaches it from the leader over the group (``relay``), and what it
    would contribute (a sum, a gathered row, a sent row) is dropped: the leader
    contributes the same. A maximum (an error code) is taken over the group first, so a
    member's failure counts. The roll call, the pings of a timeout, the node split and
    the abort reach every process (:attr:`world`), so a missing member is named by
    its own world rank.
    """

    def __init__(self, fed, group, world, fed_rank: int, fed_size: int,
                 silos: list[list[int]], **settings: Any) -> None:
        super().__init__(world, **settings)
        self.silos = silos                    # world ranks of silo 1, 2, …, the leader first
        self.comm = fed                       # MPI.COMM_NULL on a member
        self.leads = fed != self.MPI.COMM_NULL
        self.rank, self.size = fed_rank, fed_size
        if group != self.MPI.COMM_NULL:
            self.group = group
            self.group_rank, self.group_size = group.Get_rank(), group.Get_size()

    def voice_name(self, rank: int) -> str:
        if rank == 0:
            return "rank 0"
        return f"silo {rank} (ranks {', '.join(map(str, self.silos[rank - 1]))})"

    def _relay(self, buf: Optional[np.ndarray], what: str) -> None:
        """The leader's ``buf`` to the members, after the federation collective ``what``
        (a member's wait has that collective's name: a pong says it is in it)."""
        if buf is not None and self.group_size > 1:
            self.group_broadcast(buf, what)

    def broadcast(self, buf: np.ndarray, root: int = 0, what: str = "Bcast",
                  patient: bool = True) -> None:
        if self.leads:
            super().broadcast(buf, root, what, patient)
        self._relay(buf, what)

    def reduce_sum(self, sendbuf: Optional[np.ndarray], recvbuf: np.ndarray | None,
                   root: int = 0, what: str = "Reduce", patient: bool = True,
                   count: Optional[int] = None, dtype: Optional[np.dtype | type] = None) -> None:
        if self.leads:
            super().reduce_sum(sendbuf, recvbuf, root, what, patient, count, dtype)
        if self.rank == root:
            self._relay(recvbuf, what)

    def gatherv_rows(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, rows: list[int],
                     root: int = 0, what: str = "Gatherv", patient: bool = True) -> None:
        if self.leads:
            super().gatherv_rows(sendbuf, recvbuf, rows, root, what, patient)
        if self.rank == root:
            self._relay(recvbuf, what)

    def scatterv_rows(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, rows: list[int],
                      root: int = 0, what: str = "Scatterv") -> None:
        if self.leads:
            super().scatterv_rows(sendbuf, recvbuf, rows, root, what)
        self._relay(recvbuf, what)

    def gather_fixed(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int = 0,
                     what: str = "Gather", patient: bool = True) -> None:
        if self.leads:
            super().gather_fixed(sendbuf, recvbuf, root, what, patient)
        if self.rank == root:
            self._relay(recvbuf, what)

    def start_send(self, buf: np.ndarray, dest: int, tag: int) -> list:
        return super().start_send(buf, dest, tag) if self.leads else []

    def start_recv(self, buf: np.ndarray, source: int, tag: int) -> list:
        if not self.leads:
            raise RuntimeError("a silo member receives through collectives only")
        return super().start_recv(buf, source, tag)

    def allreduce_sum(self, sendbuf: np.ndarray, recvbuf: np.ndarray, what: str = "Allreduce",
                      patient: bool = True) -> None:
        if self.leads:
            super().allreduce_sum(sendbuf, recvbuf, what, patient)
        self._relay(recvbuf, what)

    def allreduce_max(self, sendbuf: np.ndarray, recvbuf: np.ndarray,
                      what: str = "Allreduce") -> None:
        mine = sendbuf.copy()
        if self.group_size > 1:
            self._wait([self.group.Iallreduce(self.MPI.IN_PLACE, mine.reshape(-1),
                                              op=self.MPI.MAX)], f"{what} (silo)")
        if self.leads:
            super().allreduce_max(mine, recvbuf, what)
        self._relay(recvbuf, what)

    def max_int(self, value: int, what: str = "Allreduce") -> int:
        out = np.array([self.group_max(value, f"{what} (silo)")], dtype=np.int64)
        if self.leads:
            out[0] = super().max_int(int(out[0]), what)
        self._relay(out, what)
        return int(out[0])

    def barrier(self, what: str = "Barrier") -> None:
        if self.leads:
            super().barrier(what)
        if self.group_size > 1:
            self._wait([self.group.Ibarrier()], f"{what} (silo)")


def silo_comm(base: Comm, groups: list[list[int]]) -> Comm:
    """Collective over every process of ``base``: the :class:`SiloComm` in which each of
    ``groups`` (world ranks of workers, the leader first) acts as one federation rank,
    numbered 1, 2, … in the order given; ``base`` itself when every group is one rank."""
    if all(len(g) == 1 for g in groups):
        return base
    MPI, world, me = base.MPI, base.comm, base.rank
    mine = next((i for i, g in enumerate(groups) if me in g), None)
    leads = me == 0 or (mine is not None and groups[mine][0] == me)
    fed = world.Split(0 if leads else MPI.UNDEFINED, key=me)
    group = world.Split(mine if mine is not None else MPI.UNDEFINED,
                        key=groups[mine].index(me) if mine is not None else 0)
    out = SiloComm(fed, group, world, 0 if mine is None else mine + 1, len(groups) + 1, groups,
                   timeout=base.timeout, max_sleep=base.max_sleep, spin=base.spin,
                   max_message_bytes=base.max_message_bytes)
    out.timeout_key, out.hosts = base.timeout_key, base.hosts
    return out


def self_comm() -> Comm:
    """A one-rank :class:`Comm` over ``MPI_COMM_SELF`` (a single process doing a run's
    collective set-up alone, e.g. ``fedmpi partition`` reading every silo)."""
    return Comm(_mpi().COMM_SELF)


def world_size() -> int:
    """Number of ranks in ``MPI_COMM_WORLD`` (initialises MPI)."""
    return int(_mpi().COMM_WORLD.Get_size())


def mpi_library_version(initialize: bool = True) -> str:
    """The MPI library's version string (first line).

    ``initialize=False`` asks without initialising MPI (``MPI_Get_library_version``
    may be called before ``MPI_Init``), e.g. in a batch script outside any job step;
    only effective when mpi4py's ``MPI`` module is not imported yet.
    """
    try:
        if not initialize and "mpi4py.MPI" not in sys.modules:
            import mpi4py

            mpi4py.rc.initialize = False
            mpi4py.rc.finalize = False
        return _mpi().Get_library_version().strip().splitlines()[0]
    except Exception as exc:  # noqa: BLE001 - informational only
        return f"unavailable ({exc.__class__.__name__}: {exc})"


def cuda_aware_mpi() -> bool | None:
    """Whether the MPI library reports CUDA support (``None`` if unknown).

    Open MPI exposes ``MPIX_Query_cuda_support``; MPICH reports GPU support
    through the environment (``MPIR_CVAR_ENABLE_GPU``). This is a best effort:
    a library built without such query functions gives ``None``.
    """
    try:
        MPI = _mpi()
        query = getattr(MPI, "Query_cuda_support", None)
        if query is not None:
            return bool(query())
    except Exception:  # noqa: BLE001
        return None
    version = mpi_library_version().lower()
    if "mpich" in version:
        flag = os.environ.get("MPIR_CVAR_ENABLE_GPU")
        return None if flag is None else flag not in ("0", "false", "no")
    return None
