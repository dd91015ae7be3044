"""FedGPS radius: ``relative`` at one setting against the best tuned ``absolute`` λg on the
direction suite (issue 50, item 2).

    python bench/fedgps_radius.py [--seeds 0 1 2] [--rel 0.25] [--fedavg]
                                  [--out runs/fedgps_radius] [--json FILE] [--summary-only]

Three settings of ``bench/paper_direction.py``: the quickstart (digits Dir(0.5), 10 silos,
5 per round, 10 rounds: the FedGPS ablation's setting), cross-device
(``configs/fedgps_digits_cross_device.yaml``) and skewed (``configs/fedgps_digits_skewed.yaml``);
the partition follows the seed where the direction suite says so. Baseline arm: the best
absolute radius the earlier search found in each (λg = 0.05 of {0.05, 0.1, 0.5} on the
quickstart, of {0.05, 0.5} in the other two); method arm: ``radius: relative`` with one
λg for all three (``--rel``, chosen before any run from the quickstart's measured
‖θ^t − θ^{t−1}‖ = 0.15–0.37: 0.05 / [0.15, 0.37] ≈ [0.14, 0.33], so 0.25); ``--fedavg`` adds
FedAvg for context. Runs, cache, tables and CSVs are paper_direction's (``run_suite``); this
script adds one JSON with every number and each run's wall time.

``--rel-only`` runs the relative arm alone and pairs it by seed with the absolute λg = 0.05 runs
already recorded in ``bench/measured/paper_direction/`` (the same resolved config, hence the same
cache key: ``radius: absolute`` is the default; such a run re-ran bit for bit here, quickstart
seed 0). It halves the machine time on a shared CPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import csv

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper_direction as pd  # noqa: E402

GPS = pd.GPS
ABS = pd.Arm("abs005", "absolute λg = 0.05 (best tuned)", ("algorithm.name=fedgps",
                                                           GPS + "radius=absolute",
                                                           GPS + "lambda_g=0.05"))


def comparisons(rel: float, fedavg: bool) -> list[pd.Comparison]:
    rel_arm = pd.Arm("rel", f"relative λg = {rel:g}", ("algorithm.name=fedgps",
                                                      GPS + "radius=relative",
                                                      GPS + f"lambda_g={rel:g}"))
    arms = (rel_arm, *((pd.FEDAVG,) if fedavg else ()))
    settings = [
        ("radius_qs", "quickstart: digits Dir(0.5), 10 rounds", pd.cfg("quickstart.yaml"), pd.QS),
        ("radius_xdev", "cross-device: 50 clients, 5 per round, Dir(0.1), 30 rounds",
         pd.cfg("fedgps_digits_cross_device.yaml"), (pd.PSEED,)),
        ("radius_skew", "skewed: 10 clients, 5 per round, Dir(0.05), 60 rounds",
         pd.cfg("fedgps_digits_skewed.yaml"), (pd.PSEED,)),
    ]
    return [pd.Comparison(key, "FedGPS", setting, config, sets, ABS, arms)
            for key, setting, config, sets in settings]


#: where the absolute λg = 0.05 runs of each setting are recorded: (csv files, comparison, arm)
MEASURED = pd.ROOT / "bench" / "measured" / "paper_direction"
RECORDED = {"radius_qs": (("ablation_runs.csv",), "gps_abl_digits", "lg005"),
            "radius_xdev": (("direction_runs.csv", "seeds_3_5/direction_runs.csv"), "fedgps_xdev",
                            "fedgps"),
            "radius_skew": (("direction_runs.csv", "seeds_3_5/direction_runs.csv"), "fedgps_skew",
                            "fedgps")}


def recorded_absolute(key: str) -> dict[int, dict]:
    """Seed → {final, last5} of the recorded absolute λg = 0.05 runs of comparison ``key``."""
    files, comp, arm = RECORDED[key]
    out: dict[int, dict] = {}
    for name in files:
        path = MEASURED / name
        if path.exists():
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    if row["comparison"] == comp and row["arm"] == arm:
                        out[int(row["seed"])] = {"final": float(row["final"]),
                                                 "last5": float(row["last5"])}
    return out


def paired_with_recorded(runs: list[dict]) -> dict:
    """Per comparison: relative minus recorded absolute last-5 (points), paired by seed."""
    table = {}
    for key in RECORDED:
        rel = {r["seed"]: r for r in runs if r["comparison"] == key and r["arm"] == "rel"}
        rec = recorded_absolute(key)
        seeds = sorted(set(rel) & set(rec))
        if not seeds:
            continue
        d = np.array([100 * (rel[s]["last5"] - rec[s]["last5"]) for s in seeds])
        table[key] = {"seeds": seeds,
                      "absolute_last5": [100 * rec[s]["last5"] for s in seeds],
                      "relative_last5": [100 * rel[s]["last5"] for s in seeds],
                      "mean": float(d.mean()), "std": pd.std(d), "better": int((d > 0).sum()),
                      "per_seed": [round(float(x), 2) for x in d]}
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rel", type=float, default=0.25)
    ap.add_argument("--fedavg", action="store_true")
    ap.add_argument("--only", nargs="+", default=None)
    ap.add_argument("--out", default=str(pd.ROOT / "runs" / "fedgps_radius"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--summary-only", action="store_true")
    ap.add_argument("--rel-only", action="store_true",
                    help="run the relative arm only; pair with the recorded absolute runs")
    args = ap.parse_args()
    args.quick = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    comps = comparisons(args.rel, args.fedavg)
    if args.rel_only:   # the relative arm as the "base": run_suite runs it and nothing else
        comps = [replace(c, base=c.arms[0], arms=()) for c in comps]
    name = "radius_s" + "_".join(map(str, args.seeds))
    rows = pd.run_suite(name, comps, args, out)
    runs = []
    for comp in comps:
        if args.only and comp.key not in args.only:
            continue
        for arm in (comp.base, *comp.arms):
            for seed in args.seeds:
                key = pd.run_key(comp.config, pd.run_sets(comp, arm, seed, False))
                cache = out / "cache" / f"{key}.json"
                if cache.exists():
                    e = json.loads(cache.read_text())
                    runs.append({"comparison": comp.key, "arm": arm.key, "seed": seed,
                                 "wall_s": e.get("seconds"),
                                 "last5": pd.last_mean(np.asarray(e["test_accuracy"])),
                                 "test_accuracy": e["test_accuracy"]})
    result = {"seeds": args.seeds, "relative_lambda_g": args.rel, "rows": rows, "runs": runs,
              "relative_vs_recorded_absolute": paired_with_recorded(runs),
              "wall_s_total": round(sum(r["wall_s"] or 0 for r in runs), 1)}
    text = json.dumps(result, default=float)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
