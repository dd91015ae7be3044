"""Large models: the streamed exchange (any chunk size, the same bits), messages over
2 GiB with bounded memory per rank."""
from __future__ import annotations

import pytest

from conftest import run_mpi_script

pytestmark = pytest.mark.mpi

CHUNKED_SUMS = r"""
import numpy as np
from fedmpi.comm.world import Comm

world = Comm(timeout=120)
r, n = world.rank, world.size
# every rank's float64 buffer, known to every rank for the reference; magnitudes over 30
# decades so that a change in the order of additions changes bits
rows = np.stack([np.random.default_rng(q).standard_normal(5003)
                 * 10.0 ** np.random.default_rng(100 + q).integers(-15, 15, 5003)
                 for q in range(n)])
rows[:, :40] = -0.0
# what the runtime computed before the stream: one Gather and numpy's sum over axis 0
gathered = np.zeros((n, 5003)) if r == 0 else None
world.gather_fixed(rows[r], gathered)
reference = None
if r == 0:
    reference = np.sum(gathered, axis=0)
    seq = gathered[0] + 0.0
    for q in range(1, n):
        seq = seq + gathered[q]
    assert np.array_equal(reference, seq)       # the rank order, element by element
unchunked = None
for limit in (None, 8, 24, 8 * 1000, 8 * 5003, 1 << 20):
    c = Comm(timeout=120, max_message_bytes=limit)
    out = np.full(5003, np.nan) if r == 0 else None
    c.reduce_sum(rows[r], out, patient=False)
    if r == 0:
        assert np.array_equal(out, reference), limit
        assert np.array_equal(np.signbit(out), np.signbit(reference)), limit
    b = rows[0].copy() if r == 0 else np.zeros(5003)
    c.broadcast(b, patient=False)
    assert np.array_equal(b, rows[0]), limit
# pieces over MPI's eager limit (rendezvous: a send completes only once its receive is
# posted) and more of them than the chain's slots, at every root: the root takes the
# total while the chain runs
big = np.stack([np.random.default_rng(50 + q).standard_normal(1 << 20) for q in range(n)])
c = Comm(timeout=120, max_message_bytes=1 << 18)
for root in range(n):
    out = np.full(1 << 20, np.nan) if r == root else None
    c.reduce_sum(big[r], out, root=root, patient=False)
    if r == root:
        want = big[0] + 0.0
        for q in range(1, n):
            want = want + big[q]
        assert np.array_equal(out, want), root
if r == 0:
    print("STREAM OK", n)
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_streamed_reduce_is_bit_identical_at_every_chunk_size(n):
    """The chained Reduce gives, at 1-, 3-, 1000-element, whole-message and 1 MiB pieces,
    exactly the bits of a Gather and numpy's sum over ranks in rank order (the runtime's
    reduction before streaming), signed zeros included; the streamed Bcast moves the bytes.
    An 8 MiB Reduce in 32 pieces of 256 KiB (past the eager limit) completes at every root
    with the same bits (receiving the total only after the chain stalled at -n >= 3)."""
    assert f"STREAM OK {n}" in run_mpi_script(CHUNKED_SUMS, n=n).stdout


def available_gib() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


OVER_2GIB = r"""
import numpy as np
from fedmpi.comm.world import Comm

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

world = Comm(timeout=600)
r = world.rank
n = (1 << 29) + 4099                   # float32: 2^31 + 16,396 bytes
step = 1 << 20                          # checks in 4 MiB slices

def pattern(a, b):                      # element i holds i mod 65,521 (exact in float32)
    return (np.arange(a, b, dtype=np.int64) % 65521).astype(np.float32)

base = kib("VmRSS")
buf = np.full(n, -1.0, dtype=np.float32)     # touched: resident before `held`
out = np.full(n, -1.0, dtype=np.float32) if r == 0 else None
if r == 0:
    for a in range(0, n, step):
        buf[a:a + step] = pattern(a, min(n, a + step))
held = kib("VmRSS") - base
world.broadcast(buf, patient=False)
for a in range(0, n, step):
    assert np.array_equal(buf[a:a + step], pattern(a, min(n, a + step))), ("bcast", a)
world.reduce_sum(buf, out, patient=False)
if r == 0:
    for a in range(0, n, step):
        assert np.array_equal(out[a:a + step], 2 * pattern(a, min(n, a + step))), ("reduce", a)
above = (kib("VmHWM") - base - held) / 1024
print(f"RANK {r} BYTES {buf.nbytes} ABOVE_MIB {above:.0f}", flush=True)
assert above < 128, above               # the buffers + a few 16 MiB pieces
"""


def test_messages_over_2gib_with_bounded_memory():
    """A 2^31 + 16 KiB float32 broadcast and reduce at -n 2: every element checked (in
    slices), and no rank's peak memory more than 128 MiB above the buffers it holds
    (three 16 MiB pieces in flight; MPICH's own Reduce adds 1–3 GiB)."""
    if available_gib() < 16:
        pytest.skip(f"needs 16 GiB of available memory, the machine has {available_gib():.1f}")
    out = run_mpi_script(OVER_2GIB, n=2, timeout=900).stdout
    print(out)
    assert "RANK 0 BYTES 2147500044" in out and "RANK 1 BYTES 2147500044" in out, out


RUN_WITH_MEMORY = r"""
import json, sys
from pathlib import Path
def kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
import torch, fedmpi, fedmpi.runtime
from mpi4py import MPI
base = kib("VmRSS")
fedmpi.run(sys.argv[1], out=sys.argv[2])
rank = MPI.COMM_WORLD.Get_rank()
print(json.dumps({"rank": rank, "run_bytes": (kib("VmHWM") - base) * 1024}), flush=True)
"""


def test_one_round_of_a_300m_parameter_model(tmp_path):
    """An MLP 64 → 17,400 → 17,400 → 10 (304 M parameters) on digits at -n 2 (rank 0 + one worker)
    completes a round and the evaluation; rank 0 holds at most 20 bytes per parameter
    above what ``import torch, fedmpi`` costs, plus 512 MiB (data, evaluation batches)."""
    if available_gib() < 16:
        pytest.skip(f"needs 16 GiB of available memory, the machine has {available_gib():.1f}")
    import json
    import subprocess
    import sys

    import yaml

    from conftest import ROOT, mpiexec_path

    h = 17_400
    D = 64 * h + h + h * h + h + h * 10 + 10
    assert D > 300e6
    cfg = {"name": "m300", "seed": 0,
           "data": {"dataset": "digits", "num_clients": 2,
                    "partition": {"method": "iid", "min_size": 1}},
           "model": {"name": "mlp", "mlp": {"hidden": [h, h]}},
           "train": {"rounds": 1, "clients_per_round": 1, "local_steps": 1, "batch_size": 8,
                     "lr": 0.01, "momentum": 0.0},
           "runtime": {"device": "cpu", "progress": False, "threads": 1,
                       "round_timeout": 1800, "setup_timeout": 1800}}
    path = tmp_path / "m300.yaml"
    path.write_text(yaml.safe_dump(cfg))
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    proc = subprocess.run([mpi, "-n", "2", sys.executable, "-c", RUN_WITH_MEMORY, str(path),
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mem = {m["rank"]: m["run_bytes"] for m in map(json.loads, proc.stdout.split("\n")[:-1])
           if m}
    print(f"bytes per parameter: rank 0 {mem[0] / D:.1f}, worker {mem[1] / D:.1f}")
    assert mem[0] <= 20 * D + (512 << 20), mem[0] / D
