"""Baselines comparison on digits (issue 4): every method × {samples, fedvg} weighting ×
Dirichlet α ∈ {0.1, 0.05} × seeds, in one process (world size 1; results do not depend
on the world size). Prints a markdown table of mean ± std of final and best test accuracy
and, last, one JSON object with every cell.

    .venv/bin/python bench/baselines_digits.py [--out runs/baselines] [--seeds 0 1 2]
        [--rounds 20] [--methods fedavg,scaffold] [--weightings samples,fedvg]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmpi.comm.world import Comm  # noqa: E402
from fedmpi.config.schema import load_config  # noqa: E402
from fedmpi.log.reader import read  # noqa: E402
from fedmpi.runtime.driver import run  # noqa: E402

METHODS = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedprox", "scaffold", "feddyn", "fednova",
           "elastic")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=str(ROOT / "configs" / "baselines_digits.yaml"))
    ap.add_argument("--out", default=str(ROOT / "runs" / "baselines"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.05])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--weightings", default="samples,fedvg")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args()
    comm = Comm()
    results: dict[str, dict[str, list[float]]] = {}
    cpu0 = time.process_time()
    for alpha in args.alphas:
        for method in args.methods.split(","):
            for weighting in args.weightings.split(","):
                key = f"{alpha}|{method}|{weighting}"
                cell = results.setdefault(key, {"final": [], "best": []})
                for seed in args.seeds:
                    over = [f"algorithm.name={method}", f"aggregation.weighting={weighting}",
                            f"data.partition.alpha={alpha}", f"seed={seed}",
                            f"name=a{alpha}_{method}_{weighting}_s{seed}", *args.overrides]
                    if args.rounds:
                        over.append(f"train.rounds={args.rounds}")
                    cfg = load_config(args.config, over)
                    out = Path(args.out) / cfg.name
                    t0 = time.process_time()
                    run(cfg, out, comm, overwrite=True)
                    acc = read(out / "log.h5").rounds["test_accuracy"]
                    cell["final"].append(float(acc[-1]))
                    cell["best"].append(float(np.nanmax(acc)))
                    print(json.dumps({"alpha": alpha, "method": method, "weighting": weighting,
                                      "seed": seed, "final": cell["final"][-1],
                                      "best": cell["best"][-1],
                                      "cpu_s": round(time.process_time() - t0, 2)}), flush=True)
    print(table(results, args))
    print(json.dumps({"cpu_seconds": round(time.process_time() - cpu0, 1), "cells": results}))


def fmt(v: list[float]) -> str:
    return f"{100 * np.mean(v):.1f} ± {100 * np.std(v):.1f}"


def table(results: dict, args) -> str:
    weightings = args.weightings.split(",")
    head = ["method"] + [f"α={a} {w} {m}" for a in args.alphas for w in weightings
                         for m in ("final", "best")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method in args.methods.split(","):
        row = [method]
        for a in args.alphas:
            for w in weightings:
                cell = results[f"{a}|{method}|{w}"]
                row += [fmt(cell["final"]), fmt(cell["best"])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
