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
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rel", type=float, default=0.25)
    ap.add_argument("--fedavg", action="store_true")
    ap.add_argument("--only", nargs="+", default=None)
    ap.add_argument("--out", default=str(pd.ROOT / "runs" / "fedgps_radius"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--summary-only", action="store_true")
    args = ap.parse_args()
    args.quick = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    comps = comparisons(args.rel, args.fedavg)
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
              "wall_s_total": round(sum(r["wall_s"] or 0 for r in runs), 1)}
    text = json.dumps(result, default=float)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
