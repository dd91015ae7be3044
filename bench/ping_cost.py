"""What answering rank 0's pings costs a round (:meth:`fedmpi.comm.world.Comm.answering_pings`).

Run under MPI (≥ 2 ranks)::

    mpiexec -n 3 python bench/ping_cost.py [--repeats 30]

While a run is set up and runs rounds, every worker has a thread that wakes every
``PING_POLL`` (0.1 s) for one ``MPI_Iprobe`` (so that a round timeout can name the
missing ranks). This times, with the thread off and on, interleaved so that
background load affects both alike:

* ``allreduce_small``: 200 patient ``Allreduce`` of 8 float64 (the round's metadata;
  latency-bound, where a thread taking MPI's lock would show);
* ``bcast_10mb``: one eager 10 MB ``Bcast`` (the round's state);
* ``compute``: 40 matmuls of 256×256 float32 on every rank (local training; where
  a thread taking the GIL would show),

and reports the median seconds of each (slowest rank) and ``ratio = on / off``
(1.0 = free). The last stdout line (rank 0) is one JSON object.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpi4py import MPI  # noqa: E402

from bench.comm import timed  # noqa: E402  (seconds on the slowest rank)
from fedmpi.comm.endpoint import PING_POLL  # noqa: E402
from fedmpi.comm.world import Comm


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    fc = Comm()
    small, small_out = np.ones(8), np.zeros(8)
    big = np.ones(int(10e6 / 4), dtype=np.float32)
    a = torch.randn(256, 256)

    def allreduce_small() -> None:
        for _ in range(200):
            fc.allreduce_sum(small, small_out, what="bench Allreduce")

    def bcast_10mb() -> None:
        fc.broadcast(big, what="bench Bcast", patient=False)

    def compute() -> None:
        x = a
        for _ in range(40):
            x = torch.tanh(x @ a)

    ops = {"allreduce_small": allreduce_small, "bcast_10mb": bcast_10mb, "compute": compute}
    times: dict[str, dict[str, list[float]]] = {k: {"off": [], "on": []} for k in ops}
    for rep in range(args.repeats):
        for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):
            ctx = fc.answering_pings() if mode == "on" else contextlib.nullcontext()
            with ctx:
                time.sleep(2 * PING_POLL)   # the thread is up and polling
                for name, fn in ops.items():
                    times[name][mode].append(timed(fn, world))
    if fc.rank == 0:
        result = {}
        for name, t in times.items():
            off, on = statistics.median(t["off"]), statistics.median(t["on"])
            result[name] = {"off_seconds": off, "on_seconds": on, "ratio": on / off}
        print(json.dumps({"world_size": fc.size, "repeats": args.repeats,
                          "thread_level": MPI.Query_thread(), "ping_poll": PING_POLL,
                          "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                          "ops": result}))


if __name__ == "__main__":
    main()
