"""The federation when a silo is several ranks (``runtime.ranks_per_silo`` R > 1):
:class:`SiloComm`, built by :func:`silo_comm`."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from fedmpi.comm.world import Comm


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
