"""What secure aggregation (``privacy.secure_aggregation``) costs per round, at ``-n 3``.

Run under MPI::

    mpiexec -n 3 python bench/secagg_cost.py [--settings cnn,resnet18] [--repeats 2]

Settings as in ``bench/exact_reduction.py`` (``cnn``: the quickstart, digits, 5 of 10
clients; ``resnet18``: synthetic 32×32 data, 4 of 10 clients, 2 local steps, 11.2 M
floats). Each runs the whole job in this process (:func:`fedmpi.runtime.run`) plaintext
and secure, alternating, ``--repeats`` times; per round (round 0 skipped, medians over
repeats) the log's ``wall_seconds``, ``train_seconds``, ``aggregate_seconds`` and
``overhead_seconds`` (where the masking, sealing, int64 gather and decoding sit), and the
ratio secure / plaintext of the round's wall time (the issue's goal: ≤ 2×).

The last stdout line (rank 0) is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpi4py import MPI  # noqa: E402

from fedmpi.comm import Comm  # noqa: E402
from fedmpi.config.schema import load_config  # noqa: E402
from fedmpi.log.reader import read  # noqa: E402
from fedmpi.runtime.driver import run  # noqa: E402

# the same two settings as the exact-reduction bench, so the two tables compare
from exact_reduction import BASE, SETTINGS  # noqa: E402

COLUMNS = ("wall_seconds", "train_seconds", "aggregate_seconds", "overhead_seconds")


def one_run(setting: str, secure: bool, out: Path) -> dict:
    rounds, extra = SETTINGS[setting]
    cfg = load_config(ROOT / "configs/quickstart.yaml",
                      [*BASE, *extra, f"train.rounds={rounds}",
                       f"privacy.secure_aggregation={str(secure).lower()}"])
    run(cfg, out, comm=Comm(timeout=600))
    if MPI.COMM_WORLD.Get_rank() != 0:
        return {}
    r = read(out / "log.h5").rounds
    return {k: float(np.mean(r[k][1:])) for k in COLUMNS} | {
        "final_test_accuracy": float(r["test_accuracy"][-1]) if "test_accuracy" in r else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="cnn,resnet18")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    rank = MPI.COMM_WORLD.Get_rank()
    tmp = tempfile.mkdtemp(prefix="secagg_bench_") if rank == 0 else tempfile.gettempdir()
    results = {}
    for setting in args.settings.split(","):
        runs: dict[str, list[dict]] = {"plaintext": [], "secure": []}
        for rep in range(args.repeats):
            for mode in runs:
                runs[mode].append(one_run(setting, mode == "secure",
                                          Path(tmp) / f"{setting}_{mode}_{rep}"))
        if rank == 0:
            med = {m: {k: statistics.median(r[k] for r in rs) for k in COLUMNS}
                   for m, rs in runs.items()}
            med["ratio_wall"] = med["secure"]["wall_seconds"] / med["plaintext"]["wall_seconds"]
            med["extra_seconds"] = med["secure"]["wall_seconds"] - med["plaintext"]["wall_seconds"]
            results[setting] = med
            print(json.dumps({setting: med}), flush=True)
    if rank == 0:
        print(json.dumps({"settings": results, "world_size": MPI.COMM_WORLD.Get_size(),
                          "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                      "torch": torch.__version__,
                                      "mpi": MPI.Get_library_version().splitlines()[0]}}))


if __name__ == "__main__":
    main()
