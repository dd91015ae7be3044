"""Deadline and buffered rounds end to end (issue 45, items 2-4): the point-to-point
rounds of :mod:`fedmpi.runtime.asynchronous` under ``mpiexec``, on the virtual clock."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import SMALL, assert_same_bits, run_at_world_sizes, run_fedmpi, run_here
from fedmpi.log.reader import read

pytestmark = pytest.mark.mpi

# 6 clients, 4 per round / in flight; client 0 trains 4x slower than the others
SLOW = [*SMALL, "--set", "round.clock=virtual", "--set", "system.slowdown=[4,1,1,1,1,1]",
        "--set", "train.rounds=5", "--set", "runtime.reduction=exact"]


def _run(tmp_path, *over: str, sizes=(1, 3)):
    return run_at_world_sizes(["run", "configs/quickstart.yaml", *SLOW, *over], tmp_path, sizes)


def test_buffered_is_the_same_run_at_any_world_size_with_fedasync_weights(tmp_path):
    """FedBuff with B = 2 and s(τ) = (τ+1)^-0.5: -n 1 and -n 3 give the same bits; every
    logged weight is the polynomial of the logged staleness t − version, and some update
    is stale (the slow client's)."""
    logs, _ = _run(tmp_path, "--set", "round.mode=buffered", "--set", "round.buffer=2",
                   "--set", "round.staleness=polynomial", "--set", "round.staleness_a=0.5")
    assert_same_bits(tmp_path / "n1", tmp_path / "n3")
    for name in ("arrival_seconds",):   # simulated, so the same too
        assert np.array_equal(logs[1].clients[name], logs[3].clients[name], equal_nan=True)
    assert np.array_equal(logs[1].rounds["virtual_seconds"], logs[3].rounds["virtual_seconds"])
    version = logs[1].clients["version"]
    weight = logs[1].clients["staleness_weight"]
    t = np.arange(version.shape[0])[:, None] * np.ones_like(version)
    took = ~np.isnan(version)
    assert (took.sum(axis=1) == 2).all()   # B updates per step
    tau = (t - version)[took]
    assert tau.max() >= 1, "no stale update: the test would not see the weights"
    assert np.allclose(weight[took], (tau + 1.0) ** -0.5, rtol=0, atol=1e-12)
    assert np.all(np.diff(logs[1].rounds["virtual_seconds"]) > 0)


def test_deadline_carry_is_the_same_run_at_any_world_size(tmp_path):
    """A deadline that the slow client misses: its update is carried into a later step
    with staleness ≥ 1; -n 1 and -n 3 give the same bits."""
    logs, _ = _run(tmp_path, "--set", "round.mode=deadline", "--set", "round.deadline=0.3",
                   "--set", "round.late=carry")
    assert_same_bits(tmp_path / "n1", tmp_path / "n3")
    version = logs[1].clients["version"]
    t = np.arange(version.shape[0])[:, None] * np.ones_like(version)
    late = (t - version)[~np.isnan(version)]
    assert late.max() >= 1, "no carried update"
    assert np.isnan(version[:, 0]).sum() >= 1   # the slow client missed a round


def test_a_deadline_nobody_misses_is_the_synchronous_round(tmp_path):
    """round.mode deadline with a deadline no job reaches and min_updates = m is FedAvg's
    synchronous round: the same model bits (at -n 3 against the synchronous -n 1)."""
    sync = tmp_path / "sync"
    run_here(["run", "configs/quickstart.yaml", *SLOW, "--out", str(sync)])
    _run(tmp_path, "--set", "round.mode=deadline", "--set", "round.deadline=1e9",
         "--set", "round.min_updates=4", sizes=(3,))
    a = torch.load(sync / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "n3" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = read(sync / "log.h5"), read(tmp_path / "n3" / "log.h5")
    assert np.array_equal(ra.rounds["test_accuracy"], rb.rounds["test_accuracy"])


def test_a_method_that_needs_the_whole_cohort_is_refused_naming_both_keys(tmp_path):
    proc = run_fedmpi(["run", "configs/quickstart.yaml", *SLOW, "--set", "round.mode=buffered",
                       "--set", "algorithm.name=scaffold", "--out", str(tmp_path / "x")],
                      n=0, check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()
    assert len(line) == 1 and "algorithm.name" in line[0] and "round.mode" in line[0], line
    assert not (tmp_path / "x").exists()


def test_a_wall_clock_run_replayed_at_another_world_size_is_the_same_model(tmp_path):
    """A deadline run on the wall clock at -n 3 (which updates are late depends on the
    machine), replayed from its log in one process: the same model bits and the same
    recorded steps (runtime.replay, runtime.reduction: exact)."""
    args = ["run", "configs/quickstart.yaml", *SMALL, "--set", "train.rounds=5",
            "--set", "runtime.reduction=exact", "--set", "round.mode=deadline",
            "--set", "round.deadline=0.05", "--set", "round.late=carry"]
    run_fedmpi([*args, "--out", str(tmp_path / "wall")], n=3)
    run_here([*args, "--set", f"runtime.replay={tmp_path / 'wall'}",
              "--out", str(tmp_path / "replay")])
    assert (tmp_path / "wall" / "model.pt").read_bytes() == \
        (tmp_path / "replay" / "model.pt").read_bytes()
    a, b = read(tmp_path / "wall" / "log.h5"), read(tmp_path / "replay" / "log.h5")
    for name in ("version", "staleness_weight"):
        assert np.array_equal(a.clients[name], b.clients[name], equal_nan=True)
    assert np.array_equal(a.rounds["test_accuracy"], b.rounds["test_accuracy"])


@pytest.mark.parametrize("what", ["missing", "sync"])
def test_a_log_that_cannot_be_replayed_is_one_line_naming_the_key(tmp_path, what):
    path = tmp_path / "nothing.h5"
    over = ["--set", "round.mode=buffered"]
    if what == "sync":   # the log of a synchronous run has no arrival order
        run_here(["run", "configs/quickstart.yaml", *SMALL, "--out", str(tmp_path / "s")])
        path = tmp_path / "s"
    proc = run_fedmpi(["run", "configs/quickstart.yaml", *SMALL, *over,
                       "--set", f"runtime.replay={path}", "--out", str(tmp_path / "x")],
                      n=0, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "runtime.replay" in lines[0] and str(path) in lines[0], lines
