"""Placement of ranks on GPUs and CPU threads (fedmpi.placement) and `fedmpi info`."""
from __future__ import annotations

from fedmpi import placement
from fedmpi.cli import main as fedmpi_main


def test_placement_rule():
    assert [placement.gpu_for_local_rank(i, 4) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert placement.gpu_for_local_rank(3, 0) is None
    slots = placement.plan(5, 2)
    assert [(s.role, s.gpu) for s in slots] == [("aggregator", 0), ("worker", 1), ("worker", 0),
                                               ("worker", 1), ("worker", 0)]
    assert placement.describe(slots)[0] == "local rank 0 (aggregator) -> cuda:0"
    assert placement.threads_per_rank(16, 5) == 3 and placement.threads_per_rank(2, 5) == 1


def test_info_shows_placement(capsys):
    assert fedmpi_main(["info", "--ranks", "3"]) == 0
    out = capsys.readouterr().out
    assert "CUDA-aware MPI:" in out and "placement of 3 ranks on this node" in out
    assert "local rank 0 (aggregator) ->" in out and "local rank 2 (worker) ->" in out
    assert fedmpi_main(["info", "--ranks", "0"]) == 2
