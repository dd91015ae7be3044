"""Deadline and buffered rounds end to end (issue 45, items 2-4): the point-to-point
rounds of :mod:`fedmpi.runtime.asynchronous` under ``mpiexec``, on the virtual clock."""
from __future__ import annotations

import os
import signal
import subprocess

import numpy as np
import pytest
import torch

from conftest import (SMALL, assert_same_bits, fedmpi_cmd, mpiexec_path, run_at_world_sizes,
                      run_fedmpi, run_here, wait_rounds)
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
    logs, models = _run(tmp_path, "--set", "round.mode=buffered", "--set", "round.buffer=2",
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
    # bytes are those handed to MPI: none at world size 1; at -n 3 each job is its int64
    # header and θ (float32, D entries) down, each update its float64 metadata and float32
    # row up — the same number of jobs as updates plus those still in flight at the end
    assert logs[1].rounds["bytes_up"].sum() == logs[1].rounds["bytes_down"].sum() == 0
    D = sum(v.numel() for v in models[3].values() if v.is_floating_point())
    down = logs[3].rounds["bytes_down"]
    assert down.sum() > 0 and np.all(down % (6 * 8 + 4 * D) == 0), (down, D)


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
    recorded steps (runtime.replay, runtime.reduction: exact), also with checkpoints every
    2 steps that the original did not take."""
    args = ["run", "configs/quickstart.yaml", *SMALL, "--set", "train.rounds=5",
            "--set", "runtime.reduction=exact", "--set", "round.mode=deadline",
            "--set", "round.deadline=0.05", "--set", "round.late=carry"]
    run_fedmpi([*args, "--out", str(tmp_path / "wall")], n=3)
    # with checkpoints the original did not take: taken only where the record restarts
    run_here([*args, "--set", f"runtime.replay={tmp_path / 'wall'}",
              "--set", "runtime.checkpoint_every=2", "--out", str(tmp_path / "replay")])
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


def test_a_time_budget_takes_the_steps_that_fit_and_fednova_normalises_them(tmp_path):
    """round.time_budget on the virtual clock with FedNova: every participant takes
    ⌊deadline / (slowdown_k · B · sample_seconds)⌋ local steps (the 4x slower client
    1 instead of 4), no update is late, /fednova/a is a_k of those steps (plain SGD:
    a_k = τ_k), and -n 1 and -n 3 give the same bits."""
    deadline, batch, unit = 0.3, 64, 1e-3
    logs, _ = _run(tmp_path, "--set", "round.mode=deadline", "--set", f"round.deadline={deadline}",
                   "--set", "round.time_budget=true", "--set", "algorithm.name=fednova",
                   "--set", "train.momentum=0")
    assert_same_bits(tmp_path / "n1", tmp_path / "n3")
    log = logs[1]
    version, steps = log.clients["version"], log.clients["local_steps"]
    took = ~np.isnan(version)
    t = np.arange(version.shape[0])[:, None] * np.ones_like(version)
    assert took.any() and np.all(version[took] == t[took]), "an update was late"
    slow = np.array([4, 1, 1, 1, 1, 1], dtype=np.float64)
    expect = np.floor(deadline / (slow * batch * unit) + 1e-9) * np.ones_like(version)
    assert np.array_equal(steps[took], expect[took]), (steps, expect)
    assert took[:, 0].any() and set(steps[:, 1:][took[:, 1:]].tolist()) == {4.0}
    assert np.array_equal(np.asarray(log.arrays["fednova/a"]).reshape(version.shape)[took], steps[took])
    assert np.all(log.clients["arrival_seconds"][took] <= (t[took] + 1) * deadline + 1e-9)


def test_a_wall_clock_time_budget_is_replayed_with_the_steps_it_took(tmp_path):
    """round.time_budget on the wall clock at -n 3 (the steps depend on the machine),
    replayed in one process: each job takes the recorded steps again — the same
    /clients/steps and the same model bits."""
    args = ["run", "configs/quickstart.yaml", *SMALL, "--set", "train.rounds=4",
            "--set", "runtime.reduction=exact", "--set", "round.mode=deadline",
            "--set", "round.deadline=0.2", "--set", "round.time_budget=true",
            "--set", "train.local_epochs=50"]
    run_fedmpi([*args, "--out", str(tmp_path / "wall")], n=3)
    run_here([*args, "--set", f"runtime.replay={tmp_path / 'wall'}",
              "--out", str(tmp_path / "replay")])
    a, b = read(tmp_path / "wall" / "log.h5"), read(tmp_path / "replay" / "log.h5")
    took = ~np.isnan(a.clients["version"])
    steps = a.clients["local_steps"][took]
    # 50 epochs (~200 steps) never fit in 0.2 s: the budget, not the epochs, ended them
    assert steps.min() >= 1 and steps.max() < 150, steps
    assert np.array_equal(a.clients["local_steps"], b.clients["local_steps"], equal_nan=True)
    assert (tmp_path / "wall" / "model.pt").read_bytes() == \
        (tmp_path / "replay" / "model.pt").read_bytes()


@pytest.mark.parametrize("over,keys", [
    (["--set", "round.time_budget=true"], ("round.time_budget", "round.mode")),
    (["--set", "round.mode=deadline", "--set", "round.deadline=1", "--set",
      "round.time_budget=true", "--set", "ecgr.enabled=true"], ("ecgr.enabled", "round.time_budget")),
])
def test_a_time_budget_that_cannot_apply_is_one_line_naming_both_keys(tmp_path, over, keys):
    proc = run_fedmpi(["run", "configs/quickstart.yaml", *SMALL, *over,
                       "--out", str(tmp_path / "x")], n=0, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(k in lines[0] for k in keys), lines
    assert not (tmp_path / "x").exists()


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of MPI rank ``rank`` among ``launcher``'s descendants (PMI_RANK)."""
    kids, todo = [], [launcher]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                c = [int(x) for x in f.read().split()]
        except OSError:
            continue
        kids += c
        todo += c
    for p in kids:
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if env.get(b"PMI_RANK") == str(rank).encode() and b"python" in open(
                f"/proc/{p}/cmdline", "rb").read():
            return p
    raise AssertionError(f"rank {rank} not found under pid {launcher}")


def test_a_stopped_silo_does_not_stop_deadline_rounds_and_rejoins(tmp_path):
    """-n 4, wall clock: rank 2 (clients 1, 4, 7) is stopped with SIGSTOP while 15 more
    rounds close without it; after SIGCONT its clients report again and the run ends 0."""
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    out = tmp_path / "run"
    cmd = [mpi, "-n", "4", *fedmpi_cmd(
        "run", "configs/quickstart.yaml", "--set", "train.rounds=60", "--set",
        "round.mode=deadline", "--set", "round.deadline=0.2", "--set", "round.late=carry",
        "--set", "round.min_updates=2", "--set", "round.max_staleness=100",
        "--set", "runtime.progress=false", "--set", "runtime.round_timeout=120",
        "--out", str(out))]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_rounds(out, 5, proc)
        pid = _rank_pid(proc.pid, 2)
        os.kill(pid, signal.SIGSTOP)
        stopped = wait_rounds(out, 1, proc)   # the rounds logged when the stop took effect
        resumed = wait_rounds(out, stopped + 15, proc)
        os.kill(pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    log = read(out / "log.h5")
    version = log.clients["version"]
    theirs = [1, 4, 7]   # rank 1 + c mod 3 == 2
    # an update of theirs trained from a model sent after the stop cannot arrive before SIGCONT
    during = version[stopped + 2: resumed, :][:, theirs]
    # (a job sent while the row of the step before was being written: version stopped + 1)
    assert np.all(np.isnan(during) | (during <= stopped + 1)), during
    after = version[resumed:, :][:, theirs]
    assert np.any(~np.isnan(after) & (after >= resumed)), "its clients never trained again"
    assert log.rounds["test_accuracy"].size == 60


@pytest.mark.parametrize("mode", [
    ["round.mode=deadline", "round.deadline=0.3", "round.late=carry"],
    ["round.mode=buffered", "round.buffer=2", "round.staleness=polynomial"]],
    ids=["deadline", "buffered"])
def test_a_killed_silo_ends_the_job_and_the_run_resumes_without_it_as_if_never_killed(
        tmp_path, mode):
    """Issue 45.5 as far as MPICH allows: -n 4, deadline (and buffered) rounds on the virtual clock with
    a checkpoint every 2 steps; world rank 2 (clients 1 and 4) kills itself (SIGKILL)
    before training a job of model version 3 (a deterministic hook, tests/silo_stop.py).
    The launcher ends the job (hydra tears every rank down when one dies, with or without
    -disable-auto-cleanup: docs/rounds.md), not with a clean exit; the checkpoint of steps
    < 2 was written by every rank at the HOLD; resumed at -n 3 — without the dead silo —
    the run ends with the same model bits as the run that nobody killed (-n 1), every step
    logged once."""
    args = ["run", "configs/quickstart.yaml", *SLOW, "--set", "train.rounds=6",
            *[a for kv in mode for a in ("--set", kv)], "--set", "runtime.checkpoint_every=2",
            "--set", "transforms=[silo_stop:StopHere]"]
    ref, out = tmp_path / "ref", tmp_path / "killed"
    run_here([*args, "--out", str(ref)])
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {"PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), tests]),
           "FEDMPI_STOP_RANK": "2", "FEDMPI_STOP_ROUND": "3", "FEDMPI_STOP_HOW": "kill"}
    proc = run_fedmpi([*args, "--out", str(out)], n=4, env=env, check=False)
    assert proc.returncode not in (0, 75), proc.stderr[-3000:]
    assert not (out / "model.pt").exists()
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["round"] == 2 and ckpt["world_size"] == 4
    killed = read(out / "log.h5")
    assert killed.attrs["status"] != "completed" and killed.num_rounds >= 2
    run_fedmpi([*args, "--out", str(out), "--resume"], n=3, env={"PYTHONPATH": env["PYTHONPATH"]})
    assert (out / "model.pt").read_bytes() == (ref / "model.pt").read_bytes()
    a, b = read(ref / "log.h5"), read(out / "log.h5")
    assert list(b.rounds["round"]) == list(range(6))
    assert list(b.attrs["resumed_world_sizes"]) == [3]
    for name in ("version", "staleness_weight"):
        assert np.array_equal(a.clients[name], b.clients[name], equal_nan=True)
    # replayed with the same checkpoints (the record restarts where they are): same bits
    run_here([*args, "--set", f"runtime.replay={out}", "--out", str(tmp_path / "replay")])
    assert (tmp_path / "replay" / "model.pt").read_bytes() == (ref / "model.pt").read_bytes()
