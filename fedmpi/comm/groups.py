"""The ranks of one silo (``runtime.ranks_per_silo``: they train its clients
data-parallel, :attr:`~fedmpi.comm.endpoint.Endpoint.group`) and those of one node (MPI's
shared-memory split)."""
from __future__ import annotations

import time

import numpy as np

from fedmpi.comm.collectives import Collectives


class Groups(Collectives):
    """:class:`~fedmpi.comm.collectives.Collectives` with the silo group's sums, gathers,
    broadcasts and maxima, and the node split."""

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

    def node_local(self) -> tuple[int, int]:
        """(local rank, local size) among the processes sharing this node."""
        if self.world_size == 1:
            return 0, 1
        local = self.world.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.world_rank)
        try:
            return local.Get_rank(), local.Get_size()
        finally:
            local.Free()

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
