"""Small-scale FedVG reproduction on digits: FedAvg vs FedVG over Dirichlet α and seeds.

    python bench/fedvg_repro.py [--rounds 20] [--seeds 0 1 2] [--alphas 100 1 0.05]
                                [--out runs/fedvg_repro]

Runs every (α, seed, weighting) of ``configs/fedvg_digits.yaml`` in this process
(one rank, ``runtime.threads=1``), sequentially. Prints a markdown table of
final and best test accuracy (mean ± std over seeds) and, as its last line, one
JSON object with every number.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from fedmpi.comm.world import Comm
from fedmpi.config.schema import load_config
from fedmpi.log.reader import read
from fedmpi.runtime.driver import run

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"FedAvg": "samples", "FedVG": "fedvg"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "fedvg_digits.yaml"))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--alphas", type=float, nargs="+", default=[100.0, 1.0, 0.05])
    ap.add_argument("--out", default=str(ROOT / "runs" / "fedvg_repro"))
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE overrides")
    args = ap.parse_args()
    comm = Comm()
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    t0 = time.perf_counter()
    for alpha in args.alphas:
        for method, weighting in METHODS.items():
            cell = results.setdefault(f"{alpha:g}", {}).setdefault(
                method, {"final": [], "best": [], "seconds": []})
            for seed in args.seeds:
                name = f"{method.lower()}_a{alpha:g}_s{seed}"
                cfg = load_config(args.config, [
                    f"name={name}", f"seed={seed}", f"data.partition.alpha={alpha}",
                    f"aggregation.weighting={weighting}", f"train.rounds={args.rounds}",
                    "runtime.threads=1", "runtime.progress=false", *args.set])
                t = time.perf_counter()
                out = Path(args.out) / name
                run(cfg, out, comm, overwrite=True)
                acc = read(out / "log.h5").rounds["test_accuracy"]
                cell["final"].append(float(acc[-1]))
                cell["best"].append(float(np.nanmax(acc)))
                cell["seconds"].append(time.perf_counter() - t)
    total = time.perf_counter() - t0

    def ms(v: list[float]) -> str:
        return f"{100 * np.mean(v):.2f} ± {100 * np.std(v):.2f}"

    print(f"\ndigits, {args.rounds} rounds, seeds {args.seeds}; test accuracy (%) mean ± std\n")
    print("| α | method | final | best |\n|---|---|---|---|")
    for alpha, cells in results.items():
        for method, c in cells.items():
            print(f"| {alpha} | {method} | {ms(c['final'])} | {ms(c['best'])} |")
    summary = {a: {m: {"final_mean": float(np.mean(c["final"])), "final_std": float(np.std(c["final"])),
                       "best_mean": float(np.mean(c["best"])), "best_std": float(np.std(c["best"])),
                       "final": c["final"], "best": c["best"],
                       "seconds_per_run": float(np.mean(c["seconds"]))}
                   for m, c in cells.items()} for a, cells in results.items()}
    print(json.dumps({"rounds": args.rounds, "seeds": args.seeds, "total_seconds": total,
                      "results": summary}))


if __name__ == "__main__":
    main()
