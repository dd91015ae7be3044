"""The log counts the wire (issue 46.1): ``/rounds/bytes_up`` and ``/rounds/bytes_down`` are
the bytes every rank handed MPI to send in the round's exchange.

The check is made from outside fedmpi: every rank's communicator is wrapped in a proxy that
sees each buffer passed to an mpi4py call and adds up, per round, the bytes a rank hands MPI
to send — a point-to-point message's buffer, a ``Bcast``'s buffer at its root, an
``Allreduce``'s send buffer, a gather's send buffer off the root — by reading the buffers
themselves (numpy ``nbytes``), not fedmpi's own counter. The per-round sums over ranks (one
raw ``Allreduce`` outside the proxy) must equal the logged figures, for every uplink codec,
with and without secure aggregation, at ``-n 1`` (no message: 0) and ``-n 3``.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import mpiexec_path, run_mpi_script

INTERPOSED = r'''
import json, sys
import numpy as np
from mpi4py import MPI
from fedmpi.comm.world import Comm
from fedmpi.config.schema import load_config
from fedmpi.runtime import federation
from fedmpi.runtime.driver import run

W = MPI.COMM_WORLD
rank = W.Get_rank()
count = {"down": 0, "up": 0}

def nbytes(spec):
    arr = spec[0] if isinstance(spec, (list, tuple)) else spec
    return np.asarray(arr).nbytes

class Proxy:
    """mpi4py's communicator, counting the send buffers handed to it."""
    def __init__(self, comm):
        self._c = comm
    def __getattr__(self, name):
        return getattr(self._c, name)
    def Dup(self):
        return Proxy(self._c.Dup())
    def Isend(self, buf, dest, tag=0):
        count["up"] += nbytes(buf)
        return self._c.Isend(buf, dest=dest, tag=tag)
    def Ibcast(self, buf, root=0):
        if self._c.Get_rank() == root:
            count["down"] += nbytes(buf)
        return self._c.Ibcast(buf, root=root)
    def Iallreduce(self, send, recv, op=MPI.SUM):
        count["up"] += nbytes(send)
        return self._c.Iallreduce(send, recv, op=op)
    def Igather(self, send, recv, root=0):
        if self._c.Get_rank() != root:
            count["up"] += nbytes(send)
        return self._c.Igather(send, recv, root=root)
    def Igatherv(self, send, recv, root=0):
        if self._c.Get_rank() != root:
            count["up"] += nbytes(send)
        return self._c.Igatherv(send, recv, root=root)

per_round = []
plain_round = federation.Federation.round

def counted_round(self, t):
    count["down"] = count["up"] = 0
    cmd = plain_round(self, t)
    per_round.append((count["up"], count["down"]))
    return cmd

federation.Federation.round = counted_round
out = sys.argv[1]
cfg = load_config("configs/quickstart.yaml", sys.argv[2:])
run(cfg, out, comm=Comm(comm=Proxy(W), timeout=120))
mine = np.array(per_round, dtype=np.int64)
total = np.zeros_like(mine)
W.Allreduce(mine, total)
if rank == 0:
    print("WIRE", json.dumps(total.tolist()))
'''

BASE = ["data.num_clients=6", "train.clients_per_round=4", "train.rounds=3",
        "train.local_epochs=1", "train.batch_size=64", "runtime.progress=false",
        "runtime.round_timeout=120", "eval.sharded=false"]
CASES = {
    "none": [],
    "bf16": ["compression.uplink=bf16", "compression.downlink=bf16"],
    "int8": ["compression.uplink=int8"],
    "int8 exact": ["compression.uplink=int8", "runtime.reduction=exact"],
    "topk": ["compression.uplink=topk", "compression.topk_fraction=0.05"],
    "secagg": ["privacy.secure_aggregation=true"],
    "int8+secagg": ["compression.uplink=int8", "privacy.secure_aggregation=true"],
    "float32 wire": ["runtime.wire=float32"],
}


def _wire(tmp_path, n: int, extra: list[str]) -> tuple[np.ndarray, dict]:
    """(per round: Σ over ranks of (up, down) bytes the proxy saw, the log's /rounds)."""
    import json
    import subprocess
    import sys

    from fedmpi.log.reader import read

    out = tmp_path / f"n{n}"
    args = [sys.executable, "-c", INTERPOSED, str(out), *BASE, *extra]
    if n > 1:
        mpi = mpiexec_path()
        if mpi is None:
            pytest.skip("mpiexec not found (pip install -e .[mpich])")
        args = [mpi, "-n", str(n), *args]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("WIRE "))
    return np.array(json.loads(line[5:])), read(out / "log.h5").rounds


@pytest.mark.parametrize("case", list(CASES))
def test_logged_bytes_are_the_buffers_handed_to_mpi(tmp_path, case):
    """At -n 3 every round's logged bytes_up / bytes_down equal what the ranks handed
    MPI (the last counted round is the stop, which logs no row and sends only the
    header); at -n 1 nothing is sent and the log says 0. The encoded per-participant
    figure stays in its own column."""
    if mpiexec_path() is None:
        pytest.skip("mpiexec not found (pip install -e .[mpich])")
    seen, rounds = _wire(tmp_path, 3, CASES[case])
    logged = np.stack([rounds["bytes_up"], rounds["bytes_down"]], axis=1)
    R = logged.shape[0]
    assert R == 3 and seen.shape[0] == R + 1
    np.testing.assert_array_equal(logged, seen[:R])
    assert (logged > 0).all()
    assert (rounds["bytes_up_encoded"] > 0).all()
    single, rounds1 = _wire(tmp_path, 1, CASES[case])
    assert not single.any()
    assert not rounds1["bytes_up"].any() and not rounds1["bytes_down"].any()
    np.testing.assert_array_equal(rounds1["bytes_up_encoded"], rounds["bytes_up_encoded"])

    if case in ("none", "float32 wire"):   # the layout, from its sizes alone
        from fedmpi.runtime.server import META_FIELDS

        D = int(rounds["bytes_down_encoded"][0]) // 4 // 4   # 4 participants, float32 θ
        K, F, n = 6, len(META_FIELDS), 3
        # the reduction chain sends the float64 (float32) sum three times (1 → 0 → 2 → 0);
        # each rank sends the metadata Allreduce buffer (K rows, per rank a signal and
        # its two byte counts)
        word = 8 if case == "none" else 4
        assert rounds["bytes_up"][0] == n * word * D + n * 8 * (K * F + 3 * n)
        assert rounds["bytes_down"][0] == 4 * D + 8 * (4 + K)   # θ once, the header once
    if case in ("bf16", "topk"):   # each participant's code, one message to rank 0
        from fedmpi.runtime.server import META_FIELDS

        K, F, n = 6, len(META_FIELDS), 3
        assert (rounds["bytes_up"] == rounds["bytes_up_encoded"] + n * 8 * (K * F + 3 * n)).all()
    if case.startswith("int8"):   # the codes' uint16 ring and the scale agreement (≈ 1/4
        # of the float64 sums' bytes)
        import math

        from fedmpi.runtime.server import META_FIELDS

        K, F, n = 6, len(META_FIELDS), 3
        e = int(rounds["bytes_up_encoded"][0]) // 4   # per participant: 2D + 8⌈D/256⌉
        D = next(d for d in range(e // 3, e // 2) if 2 * d + 8 * math.ceil(d / 256) == e)
        blocks = math.ceil(D / 256)
        # (round 1: secure aggregation's key exchange is round 0's)
        assert rounds["bytes_up"][1] == n * 2 * D + n * 8 * blocks + n * 8 * (K * F + 3 * n)


@pytest.mark.parametrize("wire", ["float64", "float32"])
def test_float32_wire_rounds_each_partial_sum_once(wire):
    """runtime.wire at world size 1: rank 0's float64 sum of two weighted clients arrives
    as it is (float64) or rounded once to float32 and widened in place (float32), over
    several pieces of the streamed buffer (numpy computes the expected values here)."""
    import torch

    from fedmpi.comm.world import Comm
    from fedmpi.component import Stat
    from fedmpi.runtime.collective import CollectiveExchange, plan_uplink
    from fedmpi.runtime.server import META_FIELDS, STATUS_OK

    D = 3 * (1 << 20) + 5   # four pieces of vecops.pieces (2^20 entries each)
    plan = plan_uplink([Stat("delta", D)], per_client_weighting=False)
    ex = CollectiveExchange(Comm(), plan, D, 0, num_clients=2, max_local=2, max_rows=2,
                            host=np.zeros(2, dtype=np.int64), device=torch.device("cpu"),
                            wire=wire)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, D)).astype(np.float32)
    w = (0.3, 1.7)
    ex.control(0, None)
    ex.begin_uplink(2)
    for k in range(2):
        meta = (STATUS_OK, w[k], 0.0, 1.0, 1.0, 0.0)[: len(META_FIELDS)]
        ex.put_update(k, k, {"delta": torch.from_numpy(x[k])}, meta, w[k], True)
    up = ex.reduce_updates(0, np.ones(2, dtype=bool), 0)
    acc = torch.zeros(D, dtype=torch.float64)   # the worker's float64 partial sum
    for k in range(2):
        acc.add_(torch.from_numpy(x[k]), alpha=w[k])
    exact = acc.numpy()
    expected = exact if wire == "float64" else exact.astype(np.float32).astype(np.float64)
    assert up is not None and up.reduced["delta"].dtype == torch.float64
    np.testing.assert_array_equal(up.reduced["delta"].numpy(), expected)
    assert wire == "float64" or not np.array_equal(expected, exact)
