"""What secure aggregation (``privacy.secure_aggregation``) costs per round, at ``-n 3``.

Run under MPI::

    mpiexec -n 3 python bench/secagg_cost.py [--settings cnn,resnet18] [--repeats 2]

Settings as in ``bench/exact_reduction.py`` (``cnn``: the quickstart, digits, 5 of 10
clients; ``resnet18``: synthetic 32×32 data, 4 of 10 clients, 2 local steps, 11.2 M
floats). Each runs the whole job in this process (:func:`fedmpi.runtime.run`) in each of
``--modes`` (plaintext, secure; ``secure_every_pair``: the sealing before issue 37),
taking turns, ``--repeats`` times; per round (round 0 skipped, medians over
repeats) the log's ``wall_seconds``, ``train_seconds``, ``aggregate_seconds`` and
``overhead_seconds`` (where the masking, sealing, int64 gather and decoding sit), and the
ratio secure / plaintext of the round's wall time (issue 37's goal: within noise at
``-n 1``, ≤ 1.1× at ``-n 3`` on the quickstart). Also runs at ``-n 1`` (one rank hosts
every client: nothing to mask).

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

from fedmpi.comm.world import Comm  # noqa: E402
from fedmpi.config.schema import load_config  # noqa: E402
from fedmpi.log.reader import read  # noqa: E402
from fedmpi.privacy.secagg import SecureAggregator, encode  # noqa: E402
from fedmpi.runtime.driver import run  # noqa: E402

# the same two settings as the exact-reduction bench, so the two tables compare
from exact_reduction import BASE, SETTINGS  # noqa: E402

COLUMNS = ("wall_seconds", "train_seconds", "aggregate_seconds", "overhead_seconds")


def _seal_every_pair(self, partial, t, mine, accepted, out) -> None:
    """The sealing before issue 37: every accepted pair drawn, same-rank ones included
    (they cancel in the rank's own sum; same E_r)."""
    out[:] = encode(partial.detach().cpu(), self.scale_bits).numpy()
    for k in mine:
        self._add_mask(out, int(k), t, accepted)


def one_run(setting: str, mode: str, out: Path) -> dict:
    rounds, extra = SETTINGS[setting]
    secure = mode != "plaintext"
    cfg = load_config(ROOT / "configs/quickstart.yaml",
                      [*BASE, *extra, f"train.rounds={rounds}",
                       f"privacy.secure_aggregation={str(secure).lower()}"])
    seal = SecureAggregator.seal
    if mode == "secure_every_pair":
        SecureAggregator.seal = _seal_every_pair   # type: ignore[method-assign]
    try:
        run(cfg, out, comm=Comm(timeout=600))
    finally:
        SecureAggregator.seal = seal   # type: ignore[method-assign]
    if MPI.COMM_WORLD.Get_rank() != 0:
        return {}
    r = read(out / "log.h5").rounds
    return {k: float(np.mean(r[k][1:])) for k in COLUMNS} | {
        "final_test_accuracy": float(r["test_accuracy"][-1]) if "test_accuracy" in r else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="cnn,resnet18")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="plaintext,secure",
                    help="of plaintext, secure, secure_every_pair (the sealing before issue "
                         "37, which also drew the pairs of clients on the same rank)")
    ap.add_argument("--json", default=None, help="rank 0 also writes the summary here")
    args = ap.parse_args()
    rank = MPI.COMM_WORLD.Get_rank()
    tmp = tempfile.mkdtemp(prefix="secagg_bench_") if rank == 0 else tempfile.gettempdir()
    results = {}
    for setting in args.settings.split(","):
        runs: dict[str, list[dict]] = {m: [] for m in args.modes.split(",")}
        for rep in range(args.repeats):
            for mode in runs:
                runs[mode].append(one_run(setting, mode, Path(tmp) / f"{setting}_{mode}_{rep}"))
        if rank == 0:
            med: dict = {m: {k: statistics.median(r[k] for r in rs) for k in COLUMNS}
                         for m, rs in runs.items()}
            for m in runs:
                if m != "plaintext" and "plaintext" in runs:
                    med[m]["ratio_wall"] = med[m]["wall_seconds"] / med["plaintext"]["wall_seconds"]
                    med[m]["extra_seconds"] = (med[m]["wall_seconds"]
                                               - med["plaintext"]["wall_seconds"])
            if "secure" in med and "ratio_wall" in med["secure"]:   # the keys of earlier JSON
                med["ratio_wall"] = med["secure"]["ratio_wall"]
                med["extra_seconds"] = med["secure"]["extra_seconds"]
            med["runs"] = runs
            results[setting] = med
            print(json.dumps({setting: {k: v for k, v in med.items() if k != "runs"}}), flush=True)
    if rank == 0:
        doc = {"bench": "secagg_cost", "settings": results, "world_size": MPI.COMM_WORLD.Get_size(),
               "repeats": args.repeats, "load_average": os.getloadavg(),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "torch": torch.__version__,
                           "mpi": MPI.Get_library_version().splitlines()[0]}}
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc))


if __name__ == "__main__":
    main()
