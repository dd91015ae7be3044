"""fedmpi's comm layer against raw mpi4py buffer calls, same sizes.

Run under MPI (≥ 2 ranks)::

    mpiexec -n 3 python bench/comm.py [--sizes-mb 1,10,100] [--repeats 10] [--ops gatherv,...]

For each message size (float32, model-sized) it times ``Bcast``, ``Reduce``
(SUM) and ``Gatherv`` (one row per worker) through :class:`fedmpi.comm.world.Comm`
and through plain blocking ``MPI.COMM_WORLD.Bcast/Reduce/Gatherv``,
interleaving the two so background load affects both alike (fedmpi's side both
eager, as the runtime moves round data, and patient), and reports the
median time of each and ``ratio = raw_seconds / fedmpi_seconds`` (≥ 0.8 is the
target; 1.0 = parity). The last stdout line (rank 0) is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpi4py import MPI  # noqa: E402

from fedmpi.comm.world import Comm  # noqa: E402


def timed(fn, comm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    # the operation ends when the slowest rank finishes it
    dt = np.array([time.perf_counter() - t0])
    out = np.zeros(1)
    comm.Allreduce(dt, out, op=MPI.MAX)
    return float(out[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="1,10,100")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--ops", default="", help="comma-separated subset of bcast, reduce, "
                    "gatherv, bcast_patient, reduce_patient, gatherv_patient (default: all)")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    fc = Comm()
    results = {}
    for mb in [float(s) for s in args.sizes_mb.split(",")]:
        n = int(mb * 1e6 / 4)
        buf = np.full(n, rank, dtype=np.float32)
        recv = np.zeros(n, dtype=np.float32)
        rows = [0] + [1] * (size - 1)            # one row per worker, like per-client uplink
        send_rows = np.full((rows[rank], n), rank, dtype=np.float32)
        recv_rows = np.zeros((size - 1, n), dtype=np.float32) if rank == 0 else None
        counts = [r * n for r in rows]
        displs = [0] + list(np.cumsum(counts)[:-1])

        raw_gatherv = (lambda: world.Gatherv(send_rows, [recv_rows, counts, displs, MPI.FLOAT]
                                             if rank == 0 else None, root=0))
        # eager = how the runtime moves round data (after a patient sync, peers are there);
        # patient = the sleeping-poll wait, as used for the header/metadata collectives
        ops = {
            "bcast": (lambda: fc.broadcast(buf, patient=False), lambda: world.Bcast(buf, root=0)),
            "reduce": (lambda: fc.reduce_sum(buf, recv, patient=False),
                       lambda: world.Reduce(buf, recv, op=MPI.SUM, root=0)),
            "gatherv": (lambda: fc.gatherv_rows(send_rows, recv_rows, rows, patient=False), raw_gatherv),
            "bcast_patient": (lambda: fc.broadcast(buf), lambda: world.Bcast(buf, root=0)),
            "reduce_patient": (lambda: fc.reduce_sum(buf, recv),
                               lambda: world.Reduce(buf, recv, op=MPI.SUM, root=0)),
            "gatherv_patient": (lambda: fc.gatherv_rows(send_rows, recv_rows, rows), raw_gatherv),
        }
        if args.ops:
            ops = {k: v for k, v in ops.items() if k in args.ops.split(",")}
        for name, (ours, raw) in ops.items():
            t_ours, t_raw = [], []
            for i in range(args.repeats + 1):
                a, b = timed(ours, world), timed(raw, world)
                if i:  # first repetition warms up
                    t_ours.append(a)
                    t_raw.append(b)
            mo, mr = statistics.median(t_ours), statistics.median(t_raw)
            results[f"{name}_{mb:g}MB"] = {"fedmpi_seconds": mo, "raw_seconds": mr, "ratio": mr / mo}
            if rank == 0:
                print(json.dumps({f"{name}_{mb:g}MB": results[f"{name}_{mb:g}MB"]}), flush=True)
    if rank == 0:
        print(json.dumps({"world_size": size, "mpi": MPI.Get_library_version().splitlines()[0],
                          "max_sleep": fc.max_sleep, "results": results,
                          "min_ratio": min((r["ratio"] for k, r in results.items() if "patient" not in k),
                                          default=None),
                          "min_ratio_patient": min((r["ratio"] for k, r in results.items()
                                                    if "patient" in k), default=None)}))


if __name__ == "__main__":
    main()
