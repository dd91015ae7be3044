"""ECGR reproduction on digits (issue 7, item 7): each baseline with and without
ECGR over the paper's five seeds, mean ± std (sample std, ddof = 1).

    python bench/ecgr_reproduce.py [--out runs/ecgr_repro] [--algorithms fedavg,fedprox,...]
                                   [--set KEY=VALUE]... [--summarize-only]

Runs ``configs/ecgr_digits.yaml`` sequentially, one process each
(``runtime.threads=1``), skipping runs whose ``log.h5`` already exists, then
prints a markdown table and, as the last line, one JSON object. Metrics per
run: final test accuracy (last round), best test accuracy over the rounds,
and the mean of the last 5 rounds (the curves at α = 0.01 oscillate).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from fedmpi.log.reader import read

SEEDS = (0, 1, 42, 999, 2025)
ROOT = Path(__file__).resolve().parents[1]


def run_dir(out: Path, algo: str, ecgr: bool, seed: int) -> Path:
    return out / f"{algo}_ecgr{str(ecgr).lower()}_s{seed}"


def completed(d: Path) -> bool:
    try:
        return read(d / "log.h5").attrs["status"] == "completed"
    except Exception:  # noqa: BLE001 - missing, being written, or unreadable
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "ecgr_digits.yaml"))
    ap.add_argument("--out", default="runs/ecgr_repro")
    ap.add_argument("--algorithms", default="fedavg,fedprox,fednova,scaffold")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--summarize-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    algos = args.algorithms.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    fedmpi = [sys.executable, "-m", "fedmpi"]

    for seed in seeds:
        for algo in algos:
            for ecgr in (False, True):
                d = run_dir(out, algo, ecgr, seed)
                if args.summarize_only or completed(d):
                    continue
                sets = [f"seed={seed}", f"algorithm.name={algo}", f"ecgr.enabled={str(ecgr).lower()}",
                        "runtime.threads=1", "runtime.progress=false", *args.set]
                cmd = [*fedmpi, "run", args.config, "--out", str(d)]
                for s in sets:
                    cmd += ["--set", s]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

    rows, table = [], ["| method | ECGR | final acc. | best acc. | mean last 5 | runs |",
                       "|---|---|---|---|---|---|"]
    for algo in algos:
        for ecgr in (False, True):
            final, best, last5 = [], [], []
            for seed in seeds:
                d = run_dir(out, algo, ecgr, seed)
                if not completed(d):
                    continue
                acc = read(d / "log.h5").rounds["test_accuracy"]
                acc = acc[~np.isnan(acc)]
                final.append(acc[-1])
                best.append(acc.max())
                last5.append(acc[-5:].mean())
            if not final:
                continue
            stats = {m: (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0)
                     for m, v in (("final", final), ("best", best), ("last5", last5))}
            rows.append({"algorithm": algo, "ecgr": ecgr, "runs": len(final),
                         **{f"{m}_mean": s[0] for m, s in stats.items()},
                         **{f"{m}_std": s[1] for m, s in stats.items()}})
            cells = " | ".join(f"{100 * s[0]:.1f} ± {100 * s[1]:.1f}" for s in stats.values())
            table.append(f"| {algo} | {'yes' if ecgr else 'no'} | {cells} | {len(final)} |")
    table += ["", "| method | Δ final acc. (ECGR − plain, paired by seed) | seeds ECGR better |",
              "|---|---|---|"]
    for algo in algos:
        diffs = []
        for seed in seeds:
            a, b = run_dir(out, algo, True, seed), run_dir(out, algo, False, seed)
            if completed(a) and completed(b):
                fin = [read(x / "log.h5").rounds["test_accuracy"] for x in (a, b)]
                diffs.append(fin[0][~np.isnan(fin[0])][-1] - fin[1][~np.isnan(fin[1])][-1])
        if diffs:
            sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else 0.0
            table.append(f"| {algo} | {100 * np.mean(diffs):+.1f} ± {100 * sd:.1f} | "
                         f"{int(np.sum(np.asarray(diffs) > 0))}/{len(diffs)} |")
            rows.append({"algorithm": algo, "paired_final_diff_mean": float(np.mean(diffs)),
                         "paired_final_diff_std": sd, "seeds": len(diffs)})
    print("\n".join(table))
    print(json.dumps({"config": args.config, "seeds": seeds, "set": args.set, "rows": rows}))


if __name__ == "__main__":
    main()
