"""Whole runs under mpiexec: world-size invariance, exclusion, failures, the log."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import h5py
import numpy as np
import pytest
import torch

from conftest import ROOT, SMALL, fedmpi_cmd, run_fedmpi, run_here, wait_rounds
from fedmpi.log.reader import read

pytestmark = pytest.mark.mpi
CFG = "configs/quickstart.yaml"


def _model(path) -> dict[str, torch.Tensor]:
    return torch.load(path / "model.pt", weights_only=True)


RUN = ["run", CFG, *SMALL, "--set", "runtime.threads=1", "--set", "train.momentum=0.5",
       "--set", "eval.every=2"]


@pytest.fixture(scope="module")
def world_sizes(tmp_path_factory):
    """RUN under ``mpiexec -n 2`` (one worker hosting every client) and ``-n 4`` (3 workers,
    evaluation sharded over all ranks), and alone in this process: (directory with n1/,
    n2/, n4/; the -n 2 launch's stdout)."""
    root = tmp_path_factory.mktemp("world")
    n2 = run_fedmpi([*RUN, "--out", str(root / "n2")], n=2)
    run_fedmpi([*RUN, "--set", "eval.sharded=true", "--out", str(root / "n4")], n=4)
    run_here([*RUN, "--out", str(root / "n1")])
    return root, n2.stdout


def test_world_size_invariance(world_sizes):
    """-n 1, 2 and 4 give the same accuracy trajectory and final model (1e-5).

    The -n 4 run shards evaluation over all ranks (``eval.sharded``): its accuracy
    and loss must equal rank 0's whole-test-set evaluation of the same model.
    """
    root, _ = world_sizes
    logs = {n: read(root / f"n{n}" / "log.h5") for n in (1, 2, 4)}
    models = {n: _model(root / f"n{n}") for n in (1, 2, 4)}
    for n in (1, 2, 4):
        assert logs[n].attrs["world_size"] == n
    for n in (2, 4):
        np.testing.assert_allclose(logs[n].rounds["test_accuracy"], logs[1].rounds["test_accuracy"],
                                   atol=1e-5)
        np.testing.assert_allclose(logs[n].rounds["test_loss"], logs[1].rounds["test_loss"], atol=1e-5)
        np.testing.assert_array_equal(logs[n].clients["selected"], logs[1].clients["selected"])
        for key, ref in models[1].items():
            if ref.is_floating_point():
                torch.testing.assert_close(models[n][key], ref, atol=1e-5, rtol=0, msg=key)
    # the run actually trained: the model moved and accuracy is far above chance
    assert logs[1].rounds["test_accuracy"][-1] > 0.5


def test_nan_adversary_excluded_every_round(tmp_path):
    out = tmp_path / "nan"
    run_fedmpi(["run", CFG, *SMALL, "--set", "adversary.clients=[2]", "--set", "adversary.kind=nan",
                "--set", "train.clients_per_round=6", "--out", str(out)], n=3)
    log = read(out / "log.h5")
    assert log.attrs["status"] == "completed"
    excluded = log.clients["excluded"]
    assert excluded[:, 2].all() and excluded.sum() == excluded.shape[0]
    assert (log.clients["weight"][:, 2] == 0).all()
    np.testing.assert_allclose(np.nansum(log.clients["weight"], axis=1), 1.0, atol=1e-9)
    assert all(torch.isfinite(v).all() for v in _model(out).values() if v.is_floating_point())
    assert any("excluded" in m and c == 2 for c, m in zip(log.events["client"], log.events["message"]))
    assert log.rounds["test_accuracy"][-1] > 0.25  # still learns (chance is 0.1)


def test_worker_exception_stops_job_quickly(tmp_path):
    start = time.monotonic()
    proc = run_fedmpi(["run", CFG, *SMALL, "--set", "adversary.clients=[1]", "--set", "adversary.kind=crash",
                       "--set", "train.clients_per_round=6", "--out", str(tmp_path / "crash")],
                      n=3, check=False, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    assert "client 1 on rank 2" in proc.stderr and "simulated crash" in proc.stderr
    # failed in its first round: nothing is left that would block the corrected rerun
    assert not (tmp_path / "crash" / "log.h5").exists()


def test_log_schema_and_final_line(world_sizes):
    """The -n 2 run of RUN (eval.every=2): rank 0's last line and the log's layout."""
    root, stdout = world_sizes
    out = root / "n2"
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("final test_accuracy=")
    acc = float(last.split("=")[1])
    with h5py.File(out / "log.h5", "r") as f:
        for key in ("schema_version", "fedmpi_version", "config_yaml", "world_size", "status"):
            assert key in f.attrs
        assert f.attrs["status"] == "completed"
        R, K = 3, 6
        for name in ("round", "test_accuracy", "test_loss", "train_loss", "wall_seconds",
                     "bytes_up", "bytes_down"):
            assert f[f"rounds/{name}"].shape == (R,), name
        assert f["clients/num_samples"].shape == (K,)
        for name in ("selected", "weight", "excluded"):
            assert f[f"clients/{name}"].shape == (R, K)
        assert f["partition/class_counts"].shape == (K, 10)
        assert f["partition/class_counts"][:].sum(1).tolist() == f["clients/num_samples"][:].tolist()
        acc_log = f["rounds/test_accuracy"][:]
        assert np.isnan(acc_log[0]) and not np.isnan(acc_log[1])  # eval.every=2, last round always
        assert acc_log[-1] == pytest.approx(acc, abs=1e-6)
        assert (f["clients/selected"][:].sum(1) == 4).all()
        assert (f["rounds/bytes_down"][:] > 0).all()


def test_sigkill_leaves_readable_log(tmp_path):
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(fedmpi_cmd("run", CFG, *SMALL, "--set", "train.rounds=500",
                                       "--set", "runtime.threads=1", "--out", str(out)),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        seen = wait_rounds(out, 3, proc, timeout=300)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    log = read(out / "log.h5")
    assert log.num_rounds >= seen
    assert log.attrs["status"] == "running"
    assert list(log.rounds["round"]) == list(range(log.num_rounds))


# (overlapped evaluation logs the rows of the synchronous one: tests/test_exact.py, whose
# -n 3 run evaluates overlapped and equals the run alone bit for bit)


COMM_SCRIPT = r"""
import numpy as np
from fedmpi.comm.world import Comm
c = Comm(timeout=60)
r, n = c.rank, c.size
for patient in (True, False):
    send = np.full(5, r + 1.0); recv = np.zeros(5)
    c.allreduce_sum(send, recv, patient=patient)
    assert np.all(recv == n * (n + 1) / 2), recv
    state = np.arange(1000, dtype=np.float32) if r == 0 else np.zeros(1000, np.float32)
    c.broadcast(state, patient=patient)
    assert np.array_equal(state, np.arange(1000, dtype=np.float32))
    out = np.zeros(3) if r == 0 else None
    c.reduce_sum(np.array([r, 1.0, 2.0 * r]), out, patient=patient)
    if r == 0:
        assert np.array_equal(out, [n * (n - 1) / 2, n, n * (n - 1)]), out
ok = np.zeros((n, 1), np.uint8) if r == 0 else None
c.gather_fixed(np.ones(1, np.uint8), ok, patient=False)
if r == 0:
    print("COMM OK", int(ok.sum()))
"""


def test_comm_collectives_patient_and_eager(comm_scripts):
    """Allreduce/Bcast/Reduce through fedmpi.comm give the hand-computed sums in both
    wait modes (patient: sleeping poll; eager: spin) on 3 ranks."""
    assert "COMM OK 3" in comm_scripts


CHUNK_SCRIPT = r"""
import numpy as np
from fedmpi.comm.world import Comm

LIMIT = 100                     # bytes per message: 25 float32, 12 float64, 100 uint8
sent = []                       # (call, bytes this rank sent in it)


class Spy:
    # the mpi4py communicator, recording the send buffer of every call
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        f = getattr(self.inner, name)
        if name == "Dup":               # the reduction chain's own communicator: spied too
            return lambda: Spy(f())
        if not (name[0] == "I" and callable(f)):
            return f
        def call(*a, **k):
            buf = a[0][0] if isinstance(a[0], list) else a[0]
            if isinstance(buf, np.ndarray):
                sent.append((name, buf.nbytes))
            return f(*a, **k)
        return call


small = Comm(timeout=60, max_message_bytes=LIMIT)
small.comm = Spy(small.comm)
whole = Comm(timeout=60)
r, n = small.rank, small.size
per_rank = [np.random.default_rng(i).standard_normal(333) for i in range(n)]

# Bcast: 1001 float32 (41 messages of <= 25)
x = np.random.default_rng(9).standard_normal(1001).astype(np.float32)
b = x.copy() if r == 0 else np.zeros_like(x)
small.broadcast(b)
assert np.array_equal(b, x)

# Reduce (the chain in rank order): bit-identical to the one-message path and to
# ((x0 + x1) + x2), at every root; a root without a buffer adds +0.0 (-0.0 turns to +0.0)
ref = per_rank[0].copy()
for v in per_rank[1:]:
    ref = ref + v
for c in (small, whole):
    for root in range(n):
        out = np.full(333, np.nan) if r == root else None
        c.reduce_sum(per_rank[r], out, root=root)
        if r == root:
            assert np.array_equal(out, ref), (c.max_message_bytes, root)
    signed = np.full(7, -0.0) if r else None
    out = np.full(7, np.nan) if r == 0 else None
    c.reduce_sum(signed, out)
    if r == 0:
        assert not np.signbit(out).any() and not out.any()

# Gatherv of row blocks: rows 2, 0, 3 ... of width 17
rows = [(2, 0, 3)[i % 3] for i in range(n)]
mine = np.full((rows[r], 17), r, np.float32) + np.arange(17, dtype=np.float32)
out = np.zeros((sum(rows), 17), np.float32) if r == 0 else None
small.gatherv_rows(mine, out, rows)
if r == 0:
    expect = np.concatenate([np.full((k, 17), i, np.float32) + np.arange(17, dtype=np.float32)
                             for i, k in enumerate(rows)])
    assert np.array_equal(out, expect)

# rows narrower than a call's share (5 float32, 2 senders, 25 per call): element ranges of
# 12 per rank straight into their places, for the contiguous and a strided-looking layout alike
for rows in ([(2, 0, 3)[i % 3] for i in range(n)], [(1, 4, 0)[i % 3] for i in range(n)]):
    mine = np.arange(rows[r] * 5, dtype=np.float32).reshape(rows[r], 5) + 100 * r
    out = np.full((sum(rows), 5), np.nan, np.float32) if r == 0 else None
    small.gatherv_rows(mine, out, rows)
    if r == 0:
        expect = np.concatenate([np.arange(k * 5, dtype=np.float32).reshape(k, 5) + 100 * i
                                 for i, k in enumerate(rows)])
        assert np.array_equal(out, expect), rows

# Scatterv: one call within the limit; more is refused
rows = [1 + i for i in range(n)]
full = np.arange(sum(rows) * 5, dtype=np.uint8).reshape(-1, 5)
got = np.zeros((rows[r], 5), np.uint8)
small.scatterv_rows(full if r == 0 else None, got, rows)
assert np.array_equal(got, full[sum(rows[:r]): sum(rows[:r + 1])])
try:
    small.scatterv_rows(None, np.zeros((rows[r], 50), np.uint8), rows)
    raise AssertionError("scatterv over the limit was not refused")
except ValueError:
    pass

# fixed Gather of 64 bytes per rank (192 > 100: column blocks)
out = np.zeros((n, 64), np.uint8) if r == 0 else None
small.gather_fixed(np.full(64, r + 1, np.uint8), out)
if r == 0:
    assert np.array_equal(out, np.repeat(np.arange(1, n + 1, dtype=np.uint8)[:, None], 64, 1))

# point to point: 250 float32 from every worker, in 10 pieces, one arrival each
if r == 0:
    bufs = [np.zeros(250, np.float32) for _ in range(1, n)]
    arrived = []
    small.wait([small.start_recv(bufs[i - 1], i, tag=7) for i in range(1, n)], "rows",
               on_done=arrived.append)
    assert sorted(arrived) == list(range(n - 1))
    for i in range(1, n):
        assert np.array_equal(bufs[i - 1], np.arange(250, dtype=np.float32) * i)
else:
    small.wait([small.start_send(np.arange(250, dtype=np.float32) * r, 0, tag=7)], "rows")

# Allreduce sum and max
tot = np.zeros(500)
small.allreduce_sum(np.full(500, r + 1.0), tot)
assert np.all(tot == n * (n + 1) / 2)
mx = np.zeros(40, np.int64)
small.allreduce_max(np.arange(40, dtype=np.int64) * (r + 1), mx)
assert np.array_equal(mx, np.arange(40) * n)

assert max(b for _, b in sent) <= LIMIT, max(sent, key=lambda t: t[1])
assert len(sent) > 100
if r == 0:
    print("CHUNK OK", len(sent))
"""


def test_every_comm_call_is_chunked_below_max_message_bytes(comm_scripts):
    """With max_message_bytes=100 every buffer a rank sends in one MPI call is at
    most 100 bytes, and Bcast, the Reduce chain (every root, a root without a buffer),
    Gatherv, Scatterv, Gather, Isend/Irecv and Allreduce give what plain numpy computes
    (the Reduce bit for bit, equal to the one-message path)."""
    assert "CHUNK OK" in comm_scripts


@pytest.fixture(scope="module")
def comm_scripts() -> str:
    """COMM_SCRIPT, then CHUNK_SCRIPT, in ONE ``mpiexec -n 3`` job: its stdout."""
    from conftest import run_mpi_script

    return run_mpi_script(COMM_SCRIPT + CHUNK_SCRIPT).stdout
