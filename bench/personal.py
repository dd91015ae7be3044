"""Personalised FL per site (issue 47): FedAvg, FedPer, FedRep, Ditto, APFL and the site
training alone, on digits split by Dirichlet(α), several seeds, one process at a time
(world size 1: results do not depend on it). Each site scores on its own held-out
quarter (``eval.where: clients``) the global model (``/clients/test_accuracy``) and its
personal model (``/clients/personal_test_accuracy``). "local only" is Ditto with λ = 0:
its personal model v_k trains alone from w^0 for exactly the federated clients' local
steps. Prints a markdown table and, last, one JSON object with every cell.

    OMP_NUM_THREADS=1 python bench/personal.py [--seeds 0 1 2] [--alphas 0.1 0.5]
        [--rounds 20] [--out /tmp/personal]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmpi import api  # noqa: E402
from fedmpi.log.reader import read  # noqa: E402

#: name → overrides; the row's personal column is /clients/personal_test_accuracy
METHODS = {
    "fedavg": ["algorithm.name=fedavg"],
    "fedper": ["algorithm.name=fedper"],
    "fedrep": ["algorithm.name=fedrep", "algorithm.fedrep.head_epochs=2"],
    "ditto": ["algorithm.name=ditto", "algorithm.ditto.lam=0.1"],
    "apfl": ["algorithm.name=apfl"],
    "local only": ["algorithm.name=ditto", "algorithm.ditto.lam=0.0"],
}


def base(rounds: int, alpha: float, seed: int) -> list[str]:
    return [f"seed={seed}", "data.dataset=digits", "data.num_clients=10",
            "train.clients_per_round=null", f"data.partition.alpha={alpha}",
            "data.partition.min_size=20", "model.name=mlp", f"train.rounds={rounds}",
            "train.local_epochs=1", "train.batch_size=32", "train.lr=0.05", "train.momentum=0",
            "eval.where=clients", "eval.client_holdout=0.25", f"eval.every={rounds}",
            "runtime.progress=false", "runtime.threads=1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.5])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="personal-"))
    cells = []
    for alpha in args.alphas:
        for seed in args.seeds:
            for name in args.methods.split(","):
                d = out / f"a{alpha}-s{seed}-{name.replace(' ', '_')}"
                t0 = time.perf_counter()
                api.run("configs/quickstart.yaml", base(args.rounds, alpha, seed) + METHODS[name],
                        out=d, overwrite=True)
                log = read(d / "log.h5")
                glob = np.asarray(log.clients["test_accuracy"][-1], dtype=float)
                own = np.asarray(log.clients["personal_test_accuracy"][-1], dtype=float) \
                    if "personal_test_accuracy" in log.clients else glob
                cells.append({"alpha": alpha, "seed": seed, "method": name,
                              "global_sites": glob.tolist(), "personal_sites": own.tolist(),
                              "seconds": time.perf_counter() - t0})
                print(f"alpha {alpha} seed {seed} {name:10s} global {glob.mean():.3f} "
                      f"personal {own.mean():.3f} worst {own.min():.3f}", flush=True)
    print()
    print("| α | method | global: mean site | personal: mean site | personal: worst site |"
          " beats global and local only (seeds) |")
    print("|---|---|---|---|---|---|")
    for alpha in args.alphas:
        local = {c["seed"]: np.mean(c["personal_sites"]) for c in cells
                 if c["alpha"] == alpha and c["method"] == "local only"}
        for name in args.methods.split(","):
            rows = [c for c in cells if c["alpha"] == alpha and c["method"] == name]
            g = [np.mean(c["global_sites"]) for c in rows]
            p = [np.mean(c["personal_sites"]) for c in rows]
            w = [np.min(c["personal_sites"]) for c in rows]
            wins = sum(1 for c in rows if c["seed"] in local and
                       np.mean(c["personal_sites"]) > max(np.mean(c["global_sites"]),
                                                          local[c["seed"]]))
            print(f"| {alpha} | {name} | {np.mean(g):.3f} ± {np.std(g):.3f} | "
                  f"{np.mean(p):.3f} ± {np.std(p):.3f} | {np.mean(w):.3f} ± {np.std(w):.3f} | "
                  f"{wins}/{len(rows)} |")
    print(json.dumps({"bench": "personal", "rounds": args.rounds, "cells": cells}))


if __name__ == "__main__":
    main()
