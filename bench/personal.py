"""Personalised FL per site (issue 47): FedAvg, FedAvg + fine-tune, FedBN, FedPer, FedRep,
Ditto, APFL and the site training alone, on digits split by Dirichlet(0.1),
Dirichlet(0.5) and uniformly (IID), on the breast-cancer table split by Dirichlet(0.5)
and on medpar's 21 hospitals (natural silos: :mod:`fedmpi.data.institutions`), several
seeds, one process at a time (world size 1: results do not depend on it). The model is an
MLP with BatchNorm (so that FedBN has norm layers) for every method. Each site scores on its own
held-out quarter the four models of ``/site_models`` (:mod:`fedmpi.consortium.site_models`):
local only (``eval.local_only``: from w^0 for the local steps the site took), the global
model, its personal model and the global model fine-tuned one epoch at the site
(``eval.finetune_epochs: 1``; FedAvg's is "FedAvg + fine-tune"). Prints a markdown table
and, last, one JSON object with every cell.

    OMP_NUM_THREADS=1 python bench/personal.py [--seeds 0 1 2] [--rounds 20] [--out DIR]
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

import torch  # noqa: E402
from torch import nn  # noqa: E402

#: name → overrides
METHODS = {
    "fedavg": ["algorithm.name=fedavg"],
    "fedbn": ["algorithm.name=fedbn"],
    "fedper": ["algorithm.name=fedper"],
    "fedrep": ["algorithm.name=fedrep", "algorithm.fedrep.head_epochs=2"],
    "ditto": ["algorithm.name=ditto", "algorithm.ditto.lam=0.1"],
    "apfl": ["algorithm.name=apfl"],
}
#: data set → (overrides, sites)
DATA = {
    "digits Dir(0.1)": (["data.dataset=digits", "data.partition.alpha=0.1"], 10),
    "digits Dir(0.5)": (["data.dataset=digits", "data.partition.alpha=0.5"], 10),
    "digits IID": (["data.dataset=digits", "data.partition.method=iid"], 10),
    "breast_cancer Dir(0.5)": (["data.dataset=breast_cancer", "data.partition.alpha=0.5"], 5),
    # natural silos: 21 Arizona hospitals (fedmpi/data/institutions.py; extra [institutions])
    "medpar hospitals": (["data.dataset=medpar", "data.partition.method=institutions",
                          "data.validation.fraction=0"], 21),
}


def bn_mlp(input_shape, num_classes):
    """Flatten → Linear 64 → BatchNorm → ReLU → Linear num_classes."""
    width = int(torch.tensor(input_shape).prod())
    return nn.Sequential(nn.Flatten(), nn.Linear(width, 64), nn.BatchNorm1d(64), nn.ReLU(),
                         nn.Linear(64, num_classes))


def base(rounds: int, sites: int, seed: int) -> list[str]:
    return [f"seed={seed}", f"data.num_clients={sites}", "train.clients_per_round=null",
            "data.partition.min_size=20", f"train.rounds={rounds}",
            "train.local_epochs=1", "train.batch_size=32", "train.lr=0.05", "train.momentum=0",
            "eval.where=clients", "eval.client_holdout=0.25", f"eval.every={rounds}",
            "eval.local_only=true", "eval.finetune_epochs=1",
            "runtime.progress=false", "runtime.threads=1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--data", default=",".join(DATA))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="personal-"))
    methods, datas = args.methods.split(","), args.data.split(",")
    cells = []
    for data in datas:
        over, sites = DATA[data]
        for seed in args.seeds:
            for name in methods:
                d = out / f"{data.split()[0]}-{data.split()[-1]}-s{seed}-{name}"
                t0 = time.perf_counter()
                api.run("configs/quickstart.yaml", base(args.rounds, sites, seed) + over
                        + METHODS[name], model=bn_mlp, out=d, overwrite=True)
                acc = read(d / "log.h5").arrays["site_models/test_accuracy"]
                cells.append({"data": data, "seed": seed, "method": name,
                              "sites": np.asarray(acc, dtype=float).tolist(),
                              "seconds": time.perf_counter() - t0})
                a = np.asarray(acc, dtype=float)
                own = np.nanmean(a[:, 2]) if np.isfinite(a[:, 2]).any() else float("nan")
                print(f"{data} seed {seed} {name:7s} local {a[:, 0].mean():.3f} global "
                      f"{a[:, 1].mean():.3f} personal {own:.3f} fine-tuned "
                      f"{a[:, 3].mean():.3f}", flush=True)
    print()
    print("Per-site held-out accuracy: mean over sites (worst site), mean ± spread over seeds. "
          "wins: seeds where the row's model beats, on the mean site, both FedAvg's global "
          "model and local only.")
    print()
    print("| data | model | mean site | worst site | wins |")
    print("|---|---|---|---|---|")
    for data in datas:
        rows = [c for c in cells if c["data"] == data]
        avg = {c["seed"]: np.asarray(c["sites"]) for c in rows if c["method"] == "fedavg"}
        bar = {s: max(a[:, 0].mean(), a[:, 1].mean()) for s, a in avg.items()}
        lines = [("local only", "fedavg", 0), ("FedAvg (global)", "fedavg", 1),
                 ("FedAvg + fine-tune", "fedavg", 3)]
        lines += [(m, m, 2) for m in methods if m != "fedavg"]
        for label, m, col in lines:
            got = [(c["seed"], np.asarray(c["sites"])[:, col]) for c in rows if c["method"] == m]
            if not got:
                continue
            mean = [v.mean() for _, v in got]
            worst = [v.min() for _, v in got]
            wins = sum(1 for s, v in got if s in bar and v.mean() > bar[s])
            print(f"| {data} | {label} | {np.mean(mean):.3f} ± {np.std(mean):.3f} | "
                  f"{np.mean(worst):.3f} ± {np.std(worst):.3f} | "
                  + ("–" if col == 0 or label.startswith("FedAvg (") else f"{wins}/{len(got)}")
                  + " |")
    print(json.dumps({"bench": "personal", "rounds": args.rounds,
                      "columns": ["local only", "global", "personal", "fine-tuned"],
                      "cells": cells}))


if __name__ == "__main__":
    main()
