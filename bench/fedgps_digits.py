"""FedGPS reproduction on digits (issue 8, item 8): the paper's Table 1 columns.

Five heterogeneous scenarios (Dirichlet α = 0.1, partition seeds 0..4) ×
{FedAvg, FedGPS, static objective only, dynamic rectification only}, run
sequentially with one thread each. Per scenario: best test accuracy, the first
round (1-based) at which a method reaches FedAvg's best accuracy of that
scenario ("ROUND", None if never), and the speed-up FedAvg-round / method-round.

    python bench/fedgps_digits.py [--rounds 30] [--out runs/fedgps_digits]

Prints a markdown table, then one JSON object (last line).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "configs" / "fedgps_digits.yaml"
METHODS = {
    "FedAvg": ["algorithm.name=fedavg", "aggregation.weighting=samples"],
    "FedGPS": [],
    "static only": ["algorithm.fedgps.dynamic=false"],
    "dynamic only": ["algorithm.fedgps.static=false"],
}


def run(out: Path, sets: list[str]) -> np.ndarray:
    from fedmpi.log.reader import read

    if not (out / "log.h5").exists() or read(out / "log.h5").attrs["status"] != "completed":
        cmd = [sys.executable, "-m", "fedmpi", "run", str(CFG), "--out", str(out), "--overwrite"]
        for s in sets + ["runtime.threads=1", "runtime.progress=false"]:
            cmd += ["--set", s]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    return np.asarray(read(out / "log.h5").rounds["test_accuracy"], dtype=float)


def first_reach(acc: np.ndarray, target: float) -> int | None:
    hit = np.flatnonzero(acc >= target - 1e-12)
    return int(hit[0]) + 1 if hit.size else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--scenarios", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "runs" / "fedgps_digits"))
    args = ap.parse_args()
    res: dict[str, list[dict]] = {m: [] for m in METHODS}
    for s in range(args.scenarios):
        curves = {}
        for m, sets in METHODS.items():
            tag = m.replace(" ", "_")
            curves[m] = run(Path(args.out) / f"s{s}_{tag}",
                            sets + [f"data.partition.seed={s}", f"train.rounds={args.rounds}",
                                    f"name=fedgps_digits_s{s}_{tag}"])
        target = float(np.nanmax(curves["FedAvg"]))
        base = first_reach(curves["FedAvg"], target)
        for m, acc in curves.items():
            r = first_reach(acc, target)
            res[m].append({"best": float(np.nanmax(acc)), "round": r,
                           "speedup": (base / r) if r else None, "target": target})
    print("| method | " + " | ".join(f"S{s + 1} acc / round / speed-up" for s in range(args.scenarios))
          + " | mean acc ± std |")
    print("|---" * (args.scenarios + 2) + "|")
    for m, rows in res.items():
        cells = []
        for r in rows:
            speed = f"{r['speedup']:.1f}x" if r["speedup"] else "None"
            cells.append(f"{100 * r['best']:.2f} / {r['round'] or 'None'} / {speed}")
        best = np.array([r["best"] for r in rows]) * 100
        print(f"| {m} | " + " | ".join(cells) + f" | {best.mean():.2f} ± {best.std():.2f} |")
    print(json.dumps({"rounds": args.rounds, "results": res}))


if __name__ == "__main__":
    main()
