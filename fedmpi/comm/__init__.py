"""The only package of fedmpi that touches MPI, one module per job.

Buffer (uppercase) mpi4py calls only, on contiguous host numpy arrays (or device arrays
when the MPI library is CUDA-aware); nothing is pickled. mpi4py is imported lazily
(:func:`fedmpi.comm.library.load_mpi`): ``fedmpi check`` works without MPI.

* :mod:`~fedmpi.comm.library` — the MPI library: mpi4py, its version, the world size,
  CUDA awareness;
* :mod:`~fedmpi.comm.endpoint` — a rank's end of a communicator (:class:`~fedmpi.comm.endpoint.Endpoint`):
  the size of a message's pieces, how it waits (spin, then sleep) and the timeout that
  names the missing ranks (pings, the roll call); :class:`~fedmpi.comm.endpoint.CommTimeout`,
  :class:`~fedmpi.comm.endpoint.Traffic`;
* :mod:`~fedmpi.comm.p2p` — point-to-point transfers, chunked, and waits on them;
* :mod:`~fedmpi.comm.collectives` — the streamed collectives: broadcast, the reduction
  chain, all-reduce, row gathers and scatters;
* :mod:`~fedmpi.comm.groups` — the ranks of one silo (``runtime.ranks_per_silo``) and of
  one node;
* :mod:`~fedmpi.comm.world` — :class:`~fedmpi.comm.world.Comm`, the run's communicator
  (all of the above over ``MPI.COMM_WORLD``), and :func:`~fedmpi.comm.world.self_comm`;
* :mod:`~fedmpi.comm.silo` — :class:`~fedmpi.comm.silo.SiloComm`: the federation when a
  silo is several ranks.
"""
