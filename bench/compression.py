"""Accuracy and uplink bytes of the compressed uplink (issue 35): ``compression.uplink`` ∈
{none, bf16, int8, topk} on the quickstart (digits, CNN) and on the tabular silos
(breast cancer, MLP; the silo config's Dirichlet split in memory), 3 seeds, one process per
setting (world size 1). Error feedback on (the default). ``int8 + secagg`` is int8 under
``privacy.secure_aggregation`` (the round's shared per-block scale, codes summed in the
masked 2^16 ring). Prints a markdown table and, last, one JSON object (also written with
``--json``).

    .venv/bin/python bench/compression.py [--rounds 10] [--seeds 0 1 2] [--json out.json]
        [--data quickstart] [--only float32 int8 "int8 + secagg"] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmpi import api  # noqa: E402

SETTINGS = {"float32": [], "bf16": ["compression.uplink=bf16"],
            "int8": ["compression.uplink=int8"],
            "secagg": ["privacy.secure_aggregation=true"],
            "int8 + secagg": ["compression.uplink=int8", "privacy.secure_aggregation=true"],
            "topk 10%": ["compression.uplink=topk", "compression.topk_fraction=0.1"],
            "topk 1%": ["compression.uplink=topk", "compression.topk_fraction=0.01"]}
DATASETS = {"quickstart": ("configs/quickstart.yaml", []),
            "tabular silos": ("configs/tabular_silos.yaml",
                              ["data.partition.method=dirichlet", "eval.metrics=[accuracy]"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--json")
    ap.add_argument("--data", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    ap.add_argument("--only", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                    help="settings to run (float32 is always run: the ratios' base)")
    ap.add_argument("--set", nargs="+", default=[], dest="sets",
                    help="config overrides applied to every setting (e.g. aggregation.weighting=uniform)")
    args = ap.parse_args()
    settings = {k: v for k, v in SETTINGS.items() if k == "float32" or k in args.only}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for data in args.data:
            config, extra = DATASETS[data]
            for name, over in settings.items():
                acc, last, up, secs = [], [], [], []
                for seed in args.seeds:
                    t0 = time.perf_counter()
                    out = Path(tmp) / f"{data}-{name}-{seed}".replace(" ", "_").replace("%", "")
                    res = api.run(str(ROOT / config),
                                  [*extra, *args.sets, *over, f"seed={seed}", f"train.rounds={args.rounds}",
                                   "runtime.progress=false", "runtime.threads=1"], out=out)
                    secs.append(time.perf_counter() - t0)
                    acc.append(res.metrics["test_accuracy"])
                    with h5py.File(res.log_path, "r") as f:
                        up.append(float(np.mean(f["rounds/bytes_up_encoded"][:])))
                        # the final round alone swings by points on non-IID silos
                        last.append(float(np.mean(f["rounds/test_accuracy"][-5:])))
                rows.append({"data": data, "uplink": name, "accuracy": acc, "last5": last,
                             "bytes_up_per_round": float(np.mean(up)), "seconds": secs})
                print(rows[-1], file=sys.stderr, flush=True)
    print("| data | uplink | test accuracy (mean ± sd, 3 seeds) | mean of the last 5 rounds "
          "| uplink bytes per round | vs float32 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["data"] == r["data"] and b["uplink"] == "float32")
        a, b = np.array(r["accuracy"]), np.array(r["last5"])
        print(f"| {r['data']} | {r['uplink']} | {a.mean():.4f} ± {a.std(ddof=1):.4f} | "
              f"{b.mean():.4f} ± {b.std(ddof=1):.4f} | "
              f"{r['bytes_up_per_round']:,.0f} | "
              f"{r['bytes_up_per_round'] / base['bytes_up_per_round']:.3f} |")
    out = {"rounds": args.rounds, "seeds": args.seeds, "sets": args.sets, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
