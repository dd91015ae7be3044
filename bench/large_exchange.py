"""Messages over 2 GiB: fedmpi's streamed Bcast and Reduce against raw mpi4py, with memory.

Run under MPI (≥ 2 ranks)::

    mpiexec -n 2 python bench/large_exchange.py [--floats 540e6] [--dtype float32] [--repeats 3]
                                                [--device cuda]

Each rank holds one buffer of ``--floats`` elements (rank 0 also the result). First
fedmpi's :meth:`~fedmpi.comm.world.Comm.broadcast` and :meth:`~fedmpi.comm.world.Comm.reduce_sum`
run once and each rank records its peak resident set size (``VmHWM``) above what it held
before (its buffers included); then, ``--repeats`` times interleaved (fedmpi, raw, fedmpi,
raw …, so background load hits both alike), the same calls and plain blocking
``MPI.COMM_WORLD.Bcast/Reduce``, the time of each being that of the slowest rank. The raw
calls' extra memory is recorded after them (``VmHWM`` only grows). The values are checked
against numpy. The last stdout line (rank 0) is one JSON object: the medians, the ratio
reduce ÷ broadcast for fedmpi and raw, and each rank's peak above its buffers in MiB.
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


def kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def all_equal(x: np.ndarray, value: float) -> bool:
    """``x == value`` everywhere, checked in slices (no message-sized temporary)."""
    step = 1 << 22
    return all(bool(np.all(x[i:i + step] == value)) for i in range(0, x.size, step))


def timed(fn, world) -> float:
    world.Barrier()
    t0 = time.perf_counter()
    fn()
    out = np.zeros(1)
    world.Allreduce(np.array([time.perf_counter() - t0]), out, op=MPI.MAX)
    return float(out[0])


def staged_times(fc: Comm, world, n: int, args) -> dict:
    """A device buffer through pinned host memory (device → host, the streamed call,
    host → device), as the runtime stages GPU state; times of the slowest rank, values
    checked on the device."""
    import torch

    dev = torch.device(args.device)
    rank = world.Get_rank()
    gbuf = torch.full((n,), float(rank + 1), dtype=getattr(torch, args.dtype), device=dev)
    host = torch.empty(n, dtype=gbuf.dtype, pin_memory=True)
    out = torch.empty_like(host, pin_memory=True) if rank == 0 else None

    def bcast() -> None:
        host.copy_(gbuf)
        fc.broadcast(host.numpy(), patient=False)
        gbuf.copy_(host)
        torch.cuda.synchronize(dev)

    def reduce() -> None:
        host.copy_(gbuf)
        fc.reduce_sum(host.numpy(), out.numpy() if out is not None else None, patient=False)
        if out is not None:
            gbuf.copy_(out)
        torch.cuda.synchronize(dev)

    t_b = timed(bcast, world)
    assert bool((gbuf == 1).all()), "staged broadcast: wrong values"
    t_r = timed(reduce, world)
    assert rank != 0 or bool((gbuf == world.Get_size()).all()), "staged reduce: wrong values"
    return {"device": str(torch.cuda.get_device_name(dev)), "bcast_seconds": t_b,
            "reduce_seconds": t_r, "reduce_over_bcast": t_r / t_b}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floats", type=float, default=540e6)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-message-bytes", type=int, default=None)
    ap.add_argument("--device", default="cpu",
                    help="cuda: also time the exchange of a GPU buffer staged through pinned "
                         "host memory, as the runtime moves device state")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    n = int(args.floats)
    base = kib("VmRSS")
    buf = np.full(n, rank + 1, dtype=args.dtype)          # touched: resident from here
    recv = np.full(n, -1, dtype=args.dtype) if rank == 0 else None
    held = kib("VmRSS") - base
    fc = Comm(timeout=3600, max_message_bytes=args.max_message_bytes)
    t_bcast = timed(lambda: fc.broadcast(buf, patient=False), world)
    assert all_equal(buf, 1), "fedmpi broadcast: wrong values"
    expect = size   # every rank now holds rank 0's ones
    t_reduce = timed(lambda: fc.reduce_sum(buf, recv, patient=False), world)
    assert rank != 0 or all_equal(recv, expect), "fedmpi reduce: wrong values"
    ours_peak = (kib("VmHWM") - base - held) / 1024
    times: dict[str, list[float]] = {"bcast": [t_bcast], "reduce": [t_reduce],
                                     "raw_bcast": [], "raw_reduce": []}
    for i in range(args.repeats):
        if i:
            times["bcast"].append(timed(lambda: fc.broadcast(buf, patient=False), world))
            times["reduce"].append(timed(lambda: fc.reduce_sum(buf, recv, patient=False), world))
        times["raw_bcast"].append(timed(lambda: world.Bcast(buf, root=0), world))
        times["raw_reduce"].append(timed(lambda: world.Reduce(buf, recv, op=MPI.SUM, root=0),
                                         world))
        assert rank != 0 or all_equal(recv, expect), "raw reduce: wrong values"
    raw_peak = (kib("VmHWM") - base - held) / 1024
    staged = staged_times(fc, world, n, args) if args.device != "cpu" else {}
    peaks = np.zeros((size, 2))
    world.Gather(np.array([ours_peak, raw_peak]), peaks, root=0)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({
            "world_size": size, "mpi": MPI.Get_library_version().splitlines()[0],
            "elements": n, "dtype": args.dtype, "message_bytes": buf.nbytes,
            "chunk_bytes": fc.chunk(buf.dtype) * buf.itemsize, "seconds": times,
            "median_seconds": med,
            "reduce_over_bcast": med["reduce"] / med["bcast"], "staged_from_gpu": staged,
            "raw_reduce_over_raw_bcast": med["raw_reduce"] / med["raw_bcast"],
            "peak_above_buffers_mib": {"fedmpi": peaks[:, 0].tolist(),
                                       "raw_after_fedmpi": peaks[:, 1].tolist()}}))


if __name__ == "__main__":
    main()
