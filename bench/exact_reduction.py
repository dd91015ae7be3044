"""What ``runtime.reduction: exact`` costs against ``default``, per round, at ``-n 3``.

Run under MPI::

    mpiexec -n 3 python bench/exact_reduction.py [--settings cnn,resnet18] [--repeats 2]

For each setting (``cnn``: the quickstart as it ships, digits, 5 of 10 clients,
2 local epochs; ``resnet18``: synthetic 32×32 data, 4 of 10 clients, 2 local
steps) it runs the whole job in this process (:func:`fedmpi.runtime.run`) in
both modes, alternating, ``--repeats`` times, and reports per round (round 0,
the warm-up, skipped; medians over repeats):

* ``uplink_bytes``: what the workers sent towards rank 0 for the statistics
  (``Reduce``/``Gather`` of the float64 partial sums in default mode; the
  per-client float32 rows in exact mode), from :class:`fedmpi.comm.endpoint.Traffic`;
* the log's ``wall_seconds``, ``train_seconds`` (slowest worker),
  ``aggregate_seconds`` (server step: exact mode's client-order float64 sum is
  here) and ``overhead_seconds`` (communication, waiting, bookkeeping), and
  ``exposed_seconds`` = aggregation + overhead: what the round costs beyond
  local training and evaluation;
* ``extra_*``: exact − default.

The alternative mechanism — an order-independent integer fixed-point sum with a
scale agreed from the clients' maxima (same bytes as default plus 8 bytes per
statistic per rank) — is measured by its parts at the same vector size: the
per-client max-abs pass during training, the exposed conversion of each hosted
client's w̃_k x_k to int64 once the scale is known, and the int64 gather-sum
against the float64 one of the default mode (``fixed_point``).

The last stdout line (rank 0) is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpi4py import MPI  # noqa: E402

from fedmpi.comm.world import Comm  # noqa: E402
from fedmpi.config.schema import load_config  # noqa: E402
from fedmpi.data.datasets import load_dataset  # noqa: E402
from fedmpi.training.flat import FlatModel  # noqa: E402
from fedmpi.log.reader import read  # noqa: E402
from fedmpi.models import build_model  # noqa: E402
from fedmpi.runtime.driver import run  # noqa: E402

BASE = ["runtime.threads=1", "runtime.progress=false", "runtime.round_timeout=600"]
SETTINGS = {
    "cnn": (6, ["model.name=cnn"]),
    "resnet18": (4, ["model.name=resnet18", "data.dataset=synthetic", "train.clients_per_round=4",
                     "train.local_steps=2", "eval.every=1000", "eval.batch_size=256"]),
}
UPLINK_OPS = ("reduce", "send", "gatherv")


def one_run(setting: str, mode: str, out: Path) -> dict:
    rounds, extra = SETTINGS[setting]
    cfg = load_config(ROOT / "configs/quickstart.yaml",
                      [*BASE, *extra, f"train.rounds={rounds}", f"runtime.reduction={mode}"])
    comm = Comm(timeout=600)
    run(cfg, out, comm=comm)
    sent = np.array([sum(comm.traffic.sent.get(op, 0) for op in UPLINK_OPS)], dtype=np.float64)
    total = np.zeros(1)
    MPI.COMM_WORLD.Allreduce(sent, total)
    if comm.rank != 0:
        return {}
    r = read(out / "log.h5").rounds
    sl = slice(1, None)
    per = {k: float(np.mean(r[k][sl])) for k in
           ("wall_seconds", "train_seconds", "aggregate_seconds", "overhead_seconds", "eval_seconds")}
    # wall − slowest worker's training − evaluation (which, overlapped, is not in wall)
    per["exposed_seconds"] = per["aggregate_seconds"] + per["overhead_seconds"]
    per["uplink_bytes"] = float(total[0]) / rounds
    return per


def fixed_point_parts(D: int, local_clients: int, clients: int, repeats: int) -> dict:
    """Times of the fixed-point alternative's steps on this rank (see module docstring)."""
    comm = Comm(timeout=600)
    rank = comm.rank
    x = [torch.randn(D) for _ in range(local_clients)] if rank else []
    w = [0.1 + 0.01 * i for i in range(local_clients)]
    f64 = np.zeros(D)
    i64 = np.zeros(D, dtype=np.int64)
    rec64 = np.zeros(D) if rank == 0 else None
    reci = np.zeros(D, dtype=np.int64) if rank == 0 else None
    times: dict[str, list[float]] = {"max_abs_pass": [], "convert_and_add": [],
                                     "int64_gather_sum": [], "float64_gather_sum": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        e = max((int(math.frexp(float((xi.double() * wi).abs().max()))[1]) for xi, wi in zip(x, w)),
                default=0)
        t1 = time.perf_counter()
        scale = 2.0 ** (62 - math.ceil(math.log2(clients)) - e)
        acc = torch.from_numpy(i64)
        acc.zero_()
        for xi, wi in zip(x, w):
            acc.add_(torch.round(xi.double() * wi * scale).to(torch.int64))
        t2 = time.perf_counter()
        times["max_abs_pass"].append(t1 - t0)
        times["convert_and_add"].append(t2 - t1)
        for name, send, recv in (("int64_gather_sum", i64, reci), ("float64_gather_sum", f64, rec64)):
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            comm.reduce_sum(send, recv, patient=False)
            times[name].append(time.perf_counter() - t0)
    mine = np.array([statistics.median(v) for v in times.values()])
    worst = np.zeros_like(mine)
    MPI.COMM_WORLD.Allreduce(mine, worst, op=MPI.MAX)
    return dict(zip(times, worst.tolist()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="cnn,resnet18")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    # only rank 0 writes a run's files; the workers' out path is never used
    tmp = tempfile.mkdtemp(prefix="exact_bench_") if rank == 0 else tempfile.gettempdir()
    results = {}
    for setting in args.settings.split(","):
        runs: dict[str, list[dict]] = {"default": [], "exact": []}
        for rep in range(args.repeats):
            for mode in runs:
                runs[mode].append(one_run(setting, mode, Path(tmp) / f"{setting}_{mode}_{rep}"))
        if rank == 0:
            med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
            med["extra"] = {k: med["exact"][k] - med["default"][k] for k in med["default"]}
            results[setting] = med
        cfg = load_config(ROOT / "configs/quickstart.yaml", [*BASE, *SETTINGS[setting][1]])
        data = load_dataset(cfg.data.dataset)
        D = FlatModel(build_model(cfg.model.name, data.input_shape, data.num_classes, cfg.model.norm)).size
        m = cfg.train.clients_per_round
        local = len(range(rank - 1, m, size - 1)) if rank else 0
        fp = fixed_point_parts(D, local, m, repeats=5)
        if rank == 0:
            results[setting]["state_size"] = D
            results[setting]["clients_per_round"] = m
            results[setting]["fixed_point"] = {**fp, "extra_bytes_per_round": 8 * size,
                                               "exposed_extra_seconds": fp["convert_and_add"]
                                               + fp["int64_gather_sum"] - fp["float64_gather_sum"]}
            print(json.dumps({setting: results[setting]}), flush=True)
    if rank == 0:
        print(json.dumps({"settings": results, "world_size": size,
                          "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                      "torch": torch.__version__,
                                      "mpi": MPI.Get_library_version().splitlines()[0]}}))


if __name__ == "__main__":
    main()
