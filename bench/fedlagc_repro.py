"""FedLAGC reproduction on digits (README table): FedLAGC, FedLAGC w/o GC, FIARSE (its
code's rule, and the former recovering rule with FedLAGC's critical set), HeteroFL,
FedRolex, ScaleFL × seeds on ``configs/fedlagc_digits.yaml``, one process each.

    python bench/fedlagc_repro.py --out runs/fedlagc_repro [--seeds 0 1 2] [--methods fiarse ...]
                                  [--summary-only]

Prints a markdown table (per-level accuracy = mean of the last ``--last`` rounds,
mean ± std over seeds) and, last, one JSON object with the same numbers.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

METHODS = {"fedlagc": ("FedLAGC", []),
           "fedlagc_nogc": ("FedLAGC w/o GC", ["--set", "algorithm.fedlagc.correction=false"]),
           "fiarse": ("FIARSE", []),
           "fiarse_recover": ("FIARSE (recover, critical kept)",
                              ["--set", "algorithm.fiarse.below_threshold=recover",
                               "--set", "algorithm.fiarse.always_keep=critical"]),
           "heterofl": ("HeteroFL", []),
           "heterofl_noscaler": ("HeteroFL w/o Scaler", ["--set", "algorithm.heterofl.scaler=false"]),
           "fiarse_maskable": ("FIARSE (code budget)", ["--set", "algorithm.fiarse.budget=maskable"]),
           "fedrolex": ("FedRolex", []), "scalefl": ("ScaleFL", [])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/fedlagc_repro")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--last", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--summary-only", action="store_true")
    args = ap.parse_args()
    from fedmpi.log.reader import read

    out = Path(args.out)
    if not args.summary_only:
        for seed in args.seeds:
            for key in args.methods:
                extra = METHODS[key][1]
                name = key.split("_")[0]
                subprocess.run([sys.executable, "-m", "fedmpi", "run", "configs/fedlagc_digits.yaml",
                                "--set", f"algorithm.name={name}", *extra, "--set", f"seed={seed}",
                                "--set", f"train.rounds={args.rounds}", "--set", "runtime.threads=1",
                                "--set", "runtime.progress=false", "--out", str(out / f"{key}_s{seed}"),
                                "--overwrite"],
                               check=True)
    result = {}
    print("| method | r=1 | r=1/4 | r=1/16 | r=1/64 | global (mean of levels) | MB up/round |")
    print("|---|---|---|---|---|---|---|")
    for key, (label, _) in METHODS.items():
        logs = [read(out / f"{key}_s{s}" / "log.h5") for s in args.seeds
                if (out / f"{key}_s{s}" / "log.h5").exists()]
        if not logs:
            continue
        acc = 100 * np.array([L.arrays["submodel/level_accuracy"][-args.last:].mean(0) for L in logs])
        glob = acc.mean(1)
        mb = float(np.mean([L.rounds["bytes_up_encoded"].mean() / 1e6 for L in logs]))
        cells = [f"{m:.1f} ± {s:.1f}" for m, s in zip(acc.mean(0), acc.std(0))]
        print(f"| {label} | " + " | ".join(cells) + f" | {glob.mean():.1f} ± {glob.std():.1f} | {mb:.2f} |")
        result[key] = {"level_mean": acc.mean(0).tolist(), "level_std": acc.std(0).tolist(),
                       "global_mean": float(glob.mean()), "global_std": float(glob.std()),
                       "seeds": len(logs), "mb_up_per_round": mb}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
