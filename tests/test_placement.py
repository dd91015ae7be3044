"""Placement of ranks on GPUs and CPU threads (fedmpi.job.placement) and `fedmpi info`."""
from __future__ import annotations

from conftest import ROOT
from fedmpi.job import placement
from fedmpi.cli import main as fedmpi_main


def test_placement_rule():
    assert [placement.gpu_for_local_rank(i, 4) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert placement.gpu_for_local_rank(3, 0) is None
    slots = placement.plan(5, 2)
    assert [(s.role, s.gpu) for s in slots] == [("aggregator", 0), ("worker", 1), ("worker", 0),
                                               ("worker", 1), ("worker", 0)]
    assert placement.describe(slots)[0] == "local rank 0 (aggregator) -> cuda:0"
    assert placement.threads_per_rank(16, 5) == 3 and placement.threads_per_rank(2, 5) == 1


def test_default_threads_respect_omp_and_slurm():
    """The ecosystem's settings win over fedmpi's own split (guide: OMP_NUM_THREADS,
    SLURM_CPUS_PER_TASK when set)."""
    d = placement.default_threads
    assert d(3, {}, cores=16) == (5, "cores / ranks on the node")
    assert d(3, {"OMP_NUM_THREADS": "1"}, cores=16) == (1, "OMP_NUM_THREADS")
    assert d(3, {"OMP_NUM_THREADS": "4,2"}, cores=16) == (4, "OMP_NUM_THREADS")
    assert d(3, {"SLURM_CPUS_PER_TASK": "6"}, cores=16) == (6, "SLURM_CPUS_PER_TASK")
    assert d(3, {"OMP_NUM_THREADS": "2", "SLURM_CPUS_PER_TASK": "6"}, cores=16)[0] == 2
    assert d(3, {"OMP_NUM_THREADS": "", "SLURM_CPUS_PER_TASK": "0"}, cores=16)[0] == 5


def test_a_run_takes_omp_num_threads(tmp_path, monkeypatch):
    """A run without runtime.threads sets torch's threads from OMP_NUM_THREADS."""
    import torch

    import fedmpi

    before = torch.get_num_threads()
    try:
        for omp in ("1", "3"):
            monkeypatch.setenv("OMP_NUM_THREADS", omp)
            fedmpi.run(str(ROOT / "configs" / "quickstart.yaml"),
                       ["train.rounds=1", "data.num_clients=2", "train.clients_per_round=null",
                        "runtime.progress=false", "model.name=mlp"], out=tmp_path / f"omp{omp}")
            assert torch.get_num_threads() == int(omp)
    finally:
        torch.set_num_threads(before)


def test_info_shows_placement(capsys):
    assert fedmpi_main(["info", "--ranks", "3"]) == 0
    out = capsys.readouterr().out
    assert "CUDA-aware MPI:" in out and "placement of 3 ranks on this node" in out
    assert "local rank 0 (aggregator) ->" in out and "local rank 2 (worker) ->" in out
    assert fedmpi_main(["info", "--ranks", "0"]) == 2
