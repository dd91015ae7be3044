"""The run's communicator, :class:`Comm`: every job of :mod:`fedmpi.comm` over
``MPI.COMM_WORLD`` (or a given communicator)."""
from __future__ import annotations

from fedmpi.comm.groups import Groups
from fedmpi.comm.library import load_mpi


class Comm(Groups):
    """Collectives over ``MPI.COMM_WORLD`` (or a given communicator): point-to-point
    (:mod:`~fedmpi.comm.p2p`), the streamed collectives (:mod:`~fedmpi.comm.collectives`),
    the silo group and the node (:mod:`~fedmpi.comm.groups`), with the waits and
    timeouts of :class:`~fedmpi.comm.endpoint.Endpoint` (its parameters).
    """


def self_comm() -> Comm:
    """A one-rank :class:`Comm` over ``MPI_COMM_SELF`` (a single process doing a run's
    collective set-up alone, e.g. ``fedmpi partition`` reading every silo)."""
    return Comm(load_mpi().COMM_SELF)
