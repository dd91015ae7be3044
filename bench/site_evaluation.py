"""What per-site evaluation (``eval.where``) costs per round.

Runs ``configs/tabular_silos.yaml`` (6 silos, breast-cancer MLP) under
``mpiexec -n W`` once per ``eval.where`` (server, clients, both; the same
``eval.client_holdout`` so every run trains on the same samples) and reads from
each log, skipping the first (warm-up) round, the mean ``wall_seconds``,
``eval_seconds`` and ``train_seconds`` per round, and the final test accuracy
(server) and combined site accuracy (clients). Per-site evaluation adds one
state ``Bcast`` and one ``Reduce`` of a [K, F] float64 table per evaluated round,
and every client's forward pass over its held-out rows on its own rank.

Usage::

    python bench/site_evaluation.py [--rounds 10] [--ranks 3]

The last stdout line is one JSON object ``{"settings": {where: {...}}, ...}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=3)
    args = ap.parse_args()
    from fedmpi.log.reader import read

    tmp = Path(tempfile.mkdtemp(prefix="site_eval_"))
    cfg = yaml.safe_load((ROOT / "configs" / "tabular_silos.yaml").read_text())
    cfg["data"]["silos"].update(path=str(tmp / "silo_{client}.csv"), test=str(tmp / "test.csv"),
                                validation=str(tmp / "validation.csv"))
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "fedmpi", "partition", str(config), "--out",
                    str(tmp / "preview"), "--export"], check=True, env=env, capture_output=True)
    out = {}
    for where in ("server", "clients", "both"):
        run_dir = tmp / where
        subprocess.run(["mpiexec", "-n", str(args.ranks), sys.executable, "-m", "fedmpi", "run",
                        str(config), "--out", str(run_dir), "--set", f"eval.where={where}",
                        "--set", f"train.rounds={args.rounds}"], check=True, env=env,
                       capture_output=True)
        log = read(run_dir / "log.h5")
        r = {k: float(np.mean(log.rounds[k][1:])) for k in
             ("wall_seconds", "eval_seconds", "train_seconds")}
        r["final_test_accuracy"] = float(log.rounds["test_accuracy"][-1])
        if where == "both":
            r["final_clients_test_accuracy"] = float(log.rounds["clients_test_accuracy"][-1])
        out[where] = r
        print(where, r, flush=True)
    print(json.dumps({"settings": out, "rounds": args.rounds, "ranks": args.ranks,
                      "config": "configs/tabular_silos.yaml", "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
