"""Large models: the streamed exchange (any chunk size, the same bits), messages over
2 GiB with bounded memory per rank."""
from __future__ import annotations

import pytest

from conftest import run_mpi_script

pytestmark = pytest.mark.mpi

CHUNKED_SUMS = r"""
import numpy as np
from fedmpi.comm import Comm

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
if r == 0:
    print("STREAM OK", n)
"""


@pytest.mark.parametrize("n", [2, 3])
def test_streamed_reduce_is_bit_identical_at_every_chunk_size(n):
    """The chained Reduce gives, at 1-, 3-, 1000-element, whole-message and 1 MiB pieces,
    exactly the bits of a Gather and numpy's sum over ranks in rank order (the runtime's
    reduction before streaming), signed zeros included; the streamed Bcast moves the bytes."""
    assert f"STREAM OK {n}" in run_mpi_script(CHUNKED_SUMS, n=n).stdout
