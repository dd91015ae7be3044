"""Rank → GPU placement and thread defaults (operations, issue 5).

One rule, used by the runtime (:func:`fedmpi.runtime.resolve_device` with
``runtime.device: auto|cuda``), by ``fedmpi info`` and by
``launch/fedmpi-launch``:

    node-local rank i on a node with G visible GPUs  →  GPU  i mod G

The node-local rank comes from ``MPI_Comm_split_type(SHARED)`` keyed by the
global rank, so on the aggregator's node rank 0 has local rank 0 and sits on
GPU 0 together with the worker of local rank G (if any); every GPU gets
⌈(L−1)/G⌉ or ⌊(L−1)/G⌋ workers (L ranks on the node), the aggregator counting
as the lightest load. Set ``CUDA_VISIBLE_DEVICES`` to restrict the GPUs.

Threads (:func:`default_threads`): ``runtime.threads`` if set; else
``OMP_NUM_THREADS``, else ``SLURM_CPUS_PER_TASK`` when set; else ranks sharing a
node split its usable cores, ``max(1, cores // L)`` torch threads each; with more ranks than cores the
MPI launcher must allow oversubscription (Open MPI: ``--oversubscribe``;
MPICH hydra allows it by default), and fedmpi's sleeping poll keeps waiting
ranks from spinning.

This module imports no torch and no MPI so the launcher can use it cheaply.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from fedmpi.errors import ConfigError


def gpu_for_local_rank(local_rank: int, num_gpus: int) -> int | None:
    """GPU index of node-local rank ``local_rank`` (``None`` without GPUs)."""
    if num_gpus <= 0:
        return None
    return int(local_rank) % int(num_gpus)


def threads_per_rank(cores: int, ranks_on_node: int) -> int:
    """The node's cores split evenly between its ranks, at least 1."""
    return max(1, int(cores) // max(1, int(ranks_on_node)))


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity: a cgroup or ``taskset`` limit),
    else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(ranks_on_node: int, env: Mapping[str, str] = os.environ,
                    cores: Optional[int] = None) -> tuple[int, str]:
    """torch threads per rank when ``runtime.threads`` is null, and where the number came
    from. The ecosystem's settings first: ``OMP_NUM_THREADS`` (what the user or a
    launcher asked of every OpenMP program), then Slurm's ``SLURM_CPUS_PER_TASK`` (the
    cores Slurm gave this task); otherwise the usable cores split evenly between the
    ranks on the node. An unset, empty or non-positive value is skipped."""
    for var in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        text = env.get(var, "").strip().split(",")[0]   # OMP allows a per-level list
        if text.isdigit() and int(text) > 0:
            return int(text), var
    n = threads_per_rank(cores if cores is not None else usable_cores(), ranks_on_node)
    return n, "cores / ranks on the node"


def silo_groups(node_of: Sequence[int], ranks_per_silo: int, one_node: bool) -> list[list[int]]:
    """The workers (world ranks 1..N−1) in silos of ``ranks_per_silo`` ranks, each the
    leader (lowest rank) first; ``node_of[r]`` names rank r's node (equal values: one
    node). The workers are ordered by node (nodes in the order of their lowest rank), then
    by rank, and cut into consecutive runs: a silo's ranks are consecutive node-local
    ranks, so the GPU rule above gives them distinct GPUs whenever the node has that many.
    A node whose worker count is not a multiple of the silo size leaves a silo that spans
    two nodes: refused with ``one_node`` (``runtime.silo_placement: node``)."""
    R, workers = int(ranks_per_silo), len(node_of) - 1
    if workers < R or workers % R:
        raise ConfigError(f"config key 'runtime.ranks_per_silo' ({R}) must divide the "
                          f"{workers} worker rank(s) of this job (world size {len(node_of)} = "
                          f"rank 0 + workers); start 1 + {R}·G ranks for G silos")
    order = sorted(range(1, len(node_of)), key=lambda r: (node_of[r], r))
    groups = [order[i:i + R] for i in range(0, workers, R)]
    for g in groups:
        if one_node and len({node_of[r] for r in g}) > 1:
            node = node_of[g[0]]
            here = sum(1 for r in range(1, len(node_of)) if node_of[r] == node)
            raise ConfigError(f"config keys 'runtime.ranks_per_silo' and "
                              f"'runtime.silo_placement': the node of rank {node} runs {here} "
                              f"worker rank(s), not a multiple of {R}, so ranks {g} would form "
                              "a silo across two nodes; start whole silos per node or set "
                              "runtime.silo_placement: any")
    return groups


@dataclass(frozen=True)
class Slot:
    local_rank: int
    role: str              # "aggregator" or "worker"
    gpu: int | None        # None → CPU


def plan(ranks_on_node: int, num_gpus: int, aggregator_here: bool = True) -> list[Slot]:
    """Placement of ``ranks_on_node`` ranks on one node (the first node of a job
    holds the aggregator, global rank 0, as its local rank 0)."""
    return [Slot(i, "aggregator" if aggregator_here and i == 0 else "worker",
                 gpu_for_local_rank(i, num_gpus)) for i in range(ranks_on_node)]


def describe(slots: list[Slot]) -> list[str]:
    """One line per rank: ``local rank 0 (aggregator) -> cuda:0``."""
    return [f"local rank {s.local_rank} ({s.role}) -> "
            f"{'cpu' if s.gpu is None else f'cuda:{s.gpu}'}" for s in slots]


def count_gpus() -> int:
    """Visible NVIDIA GPUs without importing torch: ``CUDA_VISIBLE_DEVICES`` if
    set, else ``nvidia-smi -L``, else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        return len(ids)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def local_rank_from_env() -> int | None:
    """Node-local rank as set by the launcher (MPICH hydra, Open MPI, Slurm srun)."""
    for key in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                return None
    return None
