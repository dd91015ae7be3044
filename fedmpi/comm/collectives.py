"""The collectives of the federation, streamed.

Messages of any size, memory-bounded: every buffer call moves pieces of at most
:meth:`~fedmpi.comm.endpoint.Endpoint.chunk` elements, and at most :data:`DEPTH` pieces
are in flight per rank; each piece is summed (or written) as it arrives, so a rank holds
its own buffers plus O(chunk) whatever the message size. The reduction is a chain of point-to-point pieces in rank order
(:meth:`Collectives.reduce_sum`), not ``MPI_Reduce``: MPICH's ``Reduce`` allocates a fresh
temporary of the whole message per call (1.5× the message more on every rank) and fills it
page fault by page fault, 26× slower than a ``Bcast`` of the same 515 MB at ``-n 2``
(``bench/large_exchange.py``). Chunks cut along elements that are combined independently
(a broadcast or gather moves bytes; the reduction adds each element over ranks 0, 1, … in
the same order in every chunk), so a chunked transfer gives the same bits as one call.

Every collective is non-blocking and completed by
:meth:`~fedmpi.comm.endpoint.Endpoint._wait` (patient or eager; a timeout names the
missing ranks).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from fedmpi.comm.p2p import PointToPoint

#: pieces in flight per rank in a streamed collective (a pipeline: one arriving, one being
#: summed or forwarded, one leaving)
DEPTH = 3
PART_TAG, TOTAL_TAG = 1, 2   # the reduction chain's messages (on its own duplicate communicator)


class Collectives(PointToPoint):
    """:class:`~fedmpi.comm.p2p.PointToPoint` with the streamed collectives over
    ``comm`` (and the rank table's gather over every process, :meth:`gather_processes`)."""

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

    def broadcast(self, buf: np.ndarray, root: int = 0, what: str = "Bcast",
                  patient: bool = True) -> None:
        """In-place broadcast of ``buf`` from ``root``, streamed (:meth:`_stream`)."""
        if self.size == 1:
            return
        t0 = time.perf_counter()
        flat = buf.reshape(-1)
        self._stream(list(self._chunks(flat.size, flat.dtype)),
                     lambda s: self.comm.Ibcast(flat[s], root=root), what, patient)
        self.traffic.add("bcast", flat.nbytes if self.rank == root else 0, time.perf_counter() - t0)

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
        self.traffic.add("reduce", self.reduce_sent(self.rank, count, dtype, root),
                         time.perf_counter() - t0)

    def _links(self, r: int, root: int) -> tuple[Optional[int], Optional[int], int]:
        """Rank ``r``'s place in the chain of :meth:`reduce_sum`: (the rank it receives
        from, the rank it sends to, the last rank of the chain); None: none."""
        size = self.size
        last = 0 if size == 2 else size - 1          # holds the total after the chain
        source = None if r == 1 else 1 if r == 0 else 0 if r == 2 else r - 1
        dest = 0 if r == 1 else 2 if r == 0 and size > 2 else r + 1 if 1 < r < last else None
        if r == last:
            dest = None if root == last else root
        return source, dest, last

    def reduce_sent(self, rank: int, count: int, dtype: np.dtype | type, root: int = 0) -> int:
        """Bytes rank ``rank`` hands MPI in :meth:`reduce_sum` of ``count`` elements of
        ``dtype``: the whole message once if it sends on in the chain (rank 1, and at
        world size > 2 every rank but the root that is not last), else 0."""
        if self.size == 1:
            return 0
        _, dest, _ = self._links(rank, root)
        return count * np.dtype(dtype).itemsize if dest is not None else 0

    def _chain_reduce(self, send: Optional[np.ndarray], recv: Optional[np.ndarray], n: int,
                      dtype: np.dtype, root: int, what: str, patient: bool) -> None:
        """The chain of :meth:`reduce_sum` on this rank (its docstring)."""
        r = self.rank
        if self._chain is None:   # collective: every rank reaches its first reduce together
            self._chain = self.comm.Dup()
        chain = self._chain
        source, dest, last = self._links(r, root)
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
        ``[sum(rows), P]`` in rank order. Each rank's rows are one contiguous block of
        its buffer and of ``recvbuf``, so a call larger than :meth:`chunk` elements is
        streamed (:meth:`_stream`) as ``Igatherv`` calls of element ranges: call ``k`` moves
        elements ``[k·s, (k+1)·s)`` of every rank's block (s = chunk ÷ senders) straight
        from its buffer into its place in ``recvbuf`` — no staging copy, at most
        :data:`DEPTH` calls in flight.
        """
        width = sendbuf.shape[1]
        if self.size == 1:
            np.copyto(recvbuf[: rows[0]], sendbuf)
            return
        t0 = time.perf_counter()
        mpi_type = self.MPI._typedict[sendbuf.dtype.char]
        counts = [r * width for r in rows]
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        limit = self.chunk(sendbuf.dtype)
        senders = max(1, sum(1 for c in counts if c))
        step = max(1, max(counts)) if sum(counts) <= limit else max(1, limit // senders)
        flat = np.ascontiguousarray(sendbuf).reshape(-1)
        out = None
        if self.rank == root:
            assert recvbuf is not None and recvbuf.flags.c_contiguous
            out = recvbuf.reshape(-1)

        def post(piece: slice) -> Any:
            lo = [min(piece.start, c) for c in counts]
            hi = [min(piece.stop, c) for c in counts]
            part = [flat[lo[self.rank]: hi[self.rank]], mpi_type]
            if out is None:
                return self.comm.Igatherv(part, None, root=root)
            return self.comm.Igatherv(part, [out, [h - q for q, h in zip(lo, hi)],
                                             [f + q for f, q in zip(first, lo)], mpi_type],
                                      root=root)

        self._stream([slice(k, k + step) for k in range(0, max(max(counts), 1), step)],
                     post, what, patient)
        self.traffic.add("gatherv", 0 if self.rank == root else sendbuf.nbytes, time.perf_counter() - t0)

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
        else:   # gatherv_rows counts its bytes
            out = recvbuf.reshape(self.size, send.size) if self.rank == root else None
            self.gatherv_rows(send.reshape(1, -1), out, [1] * self.size, root, what, patient)
            return
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
        t0 = time.perf_counter()
        self._allreduce(sendbuf, recvbuf, self.MPI.MAX, what)
        self.traffic.add("allreduce", sendbuf.nbytes, time.perf_counter() - t0)

    def max_int(self, value: int, what: str = "Allreduce") -> int:
        """Max of an integer over all ranks (setup agreement on error codes)."""
        if self.size == 1:
            return int(value)
        send = np.array([value], dtype=np.int64)
        recv = np.zeros(1, dtype=np.int64)
        self._wait([self.comm.Iallreduce(send, recv, op=self.MPI.MAX)], what)
        self.traffic.add("allreduce", send.nbytes, 0.0)
        return int(recv[0])

    def barrier(self, what: str = "Barrier") -> None:
        if self.size > 1:
            self._wait([self.comm.Ibarrier()], what)
