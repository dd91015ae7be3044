"""What record-level DP-SGD (``privacy.dp.level: record``) costs per round (issue 37.1).

    python bench/dpsgd_cost.py [--settings cnn_gn,mlp] [--modes plain,record,record_vmap]
        [--repeats 2] [--rounds 4] [--json PATH]
    mpiexec -n 3 python bench/dpsgd_cost.py ...

Settings: ``cnn_gn`` is the quickstart (digits, 5 of 10 clients, 2 local epochs,
batch 32) with ``model.norm=gn``; ``mlp`` is the tabular MLP of
``configs/tabular_silos.yaml`` (breast cancer, 6 clients, 32-32 hidden, batch 16),
partitioned in memory (Dirichlet 0.5) instead of from exported silo files. Each runs
the whole job in this process (``runtime.threads=1``; world size 1, or under
``mpiexec -n 3`` rank 0 and two workers) in three modes,
interleaved ``--repeats`` times (plain, record, record_vmap, plain, record, ...):

* ``plain``: no DP;
* ``record``: DP-SGD, per-sample gradients per layer (what a run uses for these models);
* ``record_vmap``: DP-SGD with the per-layer path switched off, i.e. ``torch.func.vmap``
  (the path of any other model, and of every model before issue 37).

Per round (round 0 skipped; median over rounds, then over repeats) the log's
``wall_seconds`` and ``train_seconds``, and the ratios to ``plain`` (the issue's
goal: record ≤ 3×); ``run_seconds``: the whole job in this process (set-up, every
round, evaluation, ε accounting on rank 0, which the round's columns do not all show). The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmpi.comm.world import Comm  # noqa: E402
from fedmpi.config.schema import load_config  # noqa: E402
from fedmpi.log.reader import read  # noqa: E402
from fedmpi.privacy import dpsgd  # noqa: E402
from fedmpi.runtime.driver import run  # noqa: E402

BASE = ["runtime.threads=1", "runtime.progress=false", "runtime.round_timeout=600"]
SETTINGS = {
    "cnn_gn": ("configs/quickstart.yaml", ["model.norm=gn"]),
    "mlp": ("configs/tabular_silos.yaml", ["data.partition.method=dirichlet",
                                           "eval.metrics=[accuracy]"]),
}
MODES = {"plain": ["privacy.dp.level=none"], "record": ["privacy.dp.level=record"],
         "record_vmap": ["privacy.dp.level=record"]}
COLUMNS = ("wall_seconds", "train_seconds", "run_seconds")


def one_run(setting: str, mode: str, rounds: int, out: Path) -> dict:
    path, extra = SETTINGS[setting]
    cfg = load_config(ROOT / path, [*BASE, *extra, *MODES[mode], f"train.rounds={rounds}"])
    plan = dpsgd._layer_plan
    if mode == "record_vmap":
        dpsgd._layer_plan = lambda model, names: None   # type: ignore[assignment]
    t0 = time.perf_counter()
    try:
        run(cfg, out, comm=Comm(timeout=600))
    finally:
        dpsgd._layer_plan = plan
    elapsed = time.perf_counter() - t0
    if _rank() != 0:
        return {}
    r = read(out / "log.h5").rounds
    return {k: float(np.median(r[k][1:])) for k in COLUMNS[:2]} | {
        "run_seconds": elapsed, "final_test_accuracy": float(r["test_accuracy"][-1])}


def _rank() -> int:
    """This process's rank under ``mpiexec`` (0 without MPI)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="cnn_gn,mlp")
    ap.add_argument("--modes", default="plain,record,record_vmap")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)   # dp-accounting's skipped RDP orders
    tmp = Path(tempfile.mkdtemp(prefix="dpsgd_bench_") if _rank() == 0 else tempfile.gettempdir())
    modes = args.modes.split(",")
    results = {}
    for setting in args.settings.split(","):
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for rep in range(args.repeats):
            for mode in modes:
                runs[mode].append(one_run(setting, mode, args.rounds, tmp / f"{setting}_{mode}_{rep}"))
        if _rank() != 0:
            continue
        med = {m: {k: statistics.median(r[k] for r in rs) for k in COLUMNS}
               for m, rs in runs.items()}
        for m in modes:
            if m != "plain" and "plain" in med:
                for k in COLUMNS:
                    med[m][f"{k}_ratio"] = med[m][k] / med["plain"][k]
        results[setting] = {"median": med, "runs": runs}
        print(json.dumps({setting: med}), flush=True)
    if _rank() != 0:
        return {}
    from mpi4py import MPI

    doc = {"bench": "dpsgd_cost", "settings": results, "rounds": args.rounds,
           "world_size": MPI.COMM_WORLD.Get_size(),
           "repeats": args.repeats, "load_average": os.getloadavg(),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "torch": torch.__version__}}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc), flush=True)
    return doc


if __name__ == "__main__":
    main()
