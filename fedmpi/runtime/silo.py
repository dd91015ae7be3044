"""Silos of several ranks (``runtime.ranks_per_silo`` R > 1): the groups, their
communicators and the reduction that trains a client data-parallel inside its silo.

The N − 1 workers of a job are cut into G = (N − 1)/R silos of R ranks
(:func:`fedmpi.job.placement.silo_groups`: consecutive node-local ranks, so one node per
silo wherever the layout allows; ``runtime.silo_placement: node`` refuses a silo across
nodes). Each silo is one rank of the federation (:class:`fedmpi.comm.silo.SiloComm`): its
leader takes part in the round's collectives, the other members receive the round's
state from it and train the same clients on their shares of every batch
(:mod:`fedmpi.training.dataparallel`). Client c lives on silo 1 + c mod G, as it would
on worker 1 + c mod G with R = 1.

The sums inside a silo run over MPI (the silo's sub-communicator; on CUDA through host
copies), or, on CUDA when the silo's ranks have distinct GPUs and torch has NCCL, over
one ``torch.distributed`` NCCL process group per silo, created from the MPI ranks (the
leader opens a ``TCPStore``, the members learn its address from an MPI broadcast: no
other launcher). Under ``runtime.reduction: exact`` every sum is a gather and a sum in
silo-rank order, so a run's bits do not depend on the number of silos G.
"""
from __future__ import annotations

import datetime
import socket
import zlib
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from fedmpi.comm.silo import silo_comm

from fedmpi.comm.world import Comm
from fedmpi.errors import ConfigError
from fedmpi.job.placement import silo_groups
from fedmpi.training.dataparallel import DataParallel

if TYPE_CHECKING:
    from fedmpi.config.core import Config

ADDRESS_BYTES = 256   # the NCCL store's "host\tport", broadcast by the leader


def split(comm: Comm, cfg: Config) -> Comm:
    """Collective over every process: ``comm`` with its workers grouped into silos of
    ``runtime.ranks_per_silo`` ranks (``comm`` itself when that is 1, or already done).
    Raises ConfigError, the same on every rank, when the job's ranks do not fit."""
    R = cfg.runtime.ranks_per_silo
    if R == 1 or comm.size != comm.world_size:   # one rank per silo, or split already
        return comm
    if comm.world_size == 1:
        raise ConfigError(f"config key 'runtime.ranks_per_silo' ({R}) needs an MPI job of "
                          f"1 + {R}·G ranks (G silos); this run has one process")
    groups = silo_groups(comm.node_ids(), R, cfg.runtime.silo_placement == "node")
    return silo_comm(comm, groups)


class MPIGroupReduce:
    """A silo's sums over its MPI sub-communicator (CUDA tensors through host copies)."""

    def __init__(self, comm: Comm, ordered: bool) -> None:
        self.comm, self.ordered = comm, ordered
        self.rank, self.size = comm.group_rank, comm.group_size

    def sum_(self, tensors: list[torch.Tensor], what: str) -> None:
        host = [t if t.device.type == "cpu" else t.cpu() for t in tensors]
        self.comm.group_sum([h.detach().numpy() for h in host], what, self.ordered)
        for t, h in zip(tensors, host):
            if h is not t:
                t.copy_(h)

    def gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        rows = self.comm.group_gather(t.detach().cpu().numpy(), what)
        return torch.from_numpy(rows.copy()).to(t.device)


_open_group: Optional["TorchGroupReduce"] = None   # one default process group per process


class TorchGroupReduce:
    """A silo's sums over one ``torch.distributed`` process group (NCCL on CUDA; gloo works
    on CPU tensors, which is how the tests reach this path): the leader opens a
    ``TCPStore`` on a free port, the members learn its address from an MPI broadcast."""

    def __init__(self, comm: Comm, ordered: bool, device: torch.device, timeout: float,
                 backend: str = "nccl") -> None:
        import torch.distributed as dist

        global _open_group
        if _open_group is not None:   # the previous run's group in this process (fedmpi.run twice)
            _open_group.close()
        self.dist, self.ordered = dist, ordered
        self.rank, self.size = comm.group_rank, comm.group_size
        address = np.zeros(ADDRESS_BYTES, dtype=np.uint8)
        wait = datetime.timedelta(seconds=timeout)
        store = None
        if self.rank == 0:
            store = dist.TCPStore(socket.gethostname(), 0, self.size, is_master=True,
                                  timeout=wait, wait_for_workers=False)
            text = f"{socket.gethostname()}\t{store.port}".encode()
            address[: len(text)] = np.frombuffer(text, dtype=np.uint8)
        comm.group_broadcast(address, "silo process group address Bcast")
        host, port = bytes(address).rstrip(b"\0").decode().split("\t")
        if store is None:
            store = dist.TCPStore(host, int(port), self.size, is_master=False, timeout=wait)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.size,
                                timeout=wait,
                                device_id=device if device.type == "cuda" else None)
        _open_group = self

    def sum_(self, tensors: list[torch.Tensor], what: str) -> None:
        for t in tensors:
            if self.ordered:
                t.copy_(self.gather(t, what).sum(0))
            else:
                self.dist.all_reduce(t)

    def gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        out = torch.empty(self.size * t.numel(), dtype=t.dtype, device=t.device)
        self.dist.all_gather_into_tensor(out, t.contiguous().reshape(-1))
        return out.view(self.size, *t.shape)

    def close(self) -> None:
        global _open_group
        if _open_group is self:
            self.dist.destroy_process_group()
            _open_group = None


def distinct_gpus(comm: Comm, device: torch.device) -> bool:
    """Collective over the silo: whether its ranks run on distinct CUDA devices of one
    node (what NCCL needs)."""
    if device.type != "cuda":
        return False
    mine = np.array([zlib.crc32(socket.gethostname().encode()),   # (host, device index)
                     torch.cuda.current_device() if device.index is None else device.index],
                    dtype=np.int64)
    rows = comm.group_gather(mine, "silo device Allgather").copy()
    return len({tuple(r) for r in rows}) == comm.group_size


def data_parallel(cfg: Config, comm: Comm, model: torch.nn.Module,
                  device: torch.device) -> Optional[DataParallel]:
    """Collective over the silo: the data-parallel training of this rank's silo; None
    for a rank that trains alone."""
    if comm.group_size == 1:
        return None
    ordered = cfg.runtime.reduction == "exact"
    import torch.distributed as dist

    nccl = (device.type == "cuda" and dist.is_available() and dist.is_nccl_available()
            and distinct_gpus(comm, device))   # the same answer on every rank of the silo
    reduce: MPIGroupReduce | TorchGroupReduce = MPIGroupReduce(comm, ordered)
    if nccl:
        reduce = TorchGroupReduce(comm, ordered, device, cfg.runtime.round_timeout)
    return DataParallel(reduce, model)
