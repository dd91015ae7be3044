"""Point-to-point transfers: buffer ``Isend``/``Irecv`` of contiguous arrays, one call
per :meth:`~fedmpi.comm.endpoint.Endpoint.chunk` elements (MPI keeps the messages between
two ranks with one tag in order), and the wait that completes them."""
from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from fedmpi.comm.endpoint import PING_POLL, CommTimeout, Endpoint


class PointToPoint(Endpoint):
    """:class:`~fedmpi.comm.endpoint.Endpoint` with chunked point-to-point transfers."""

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

    def done(self, requests: list) -> bool:
        """Whether every request of ``requests`` (a list from :meth:`start_send` /
        :meth:`start_recv`) is complete (``Testall``: progresses MPI, never blocks)."""
        return bool(self.MPI.Request.Testall(requests))

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
