"""Digits accuracy under differential privacy (issue 25): ε ∈ {1, 3, 8, ∞} for client-level
(DP-FedAvg) and record-level (DP-SGD) DP, 3 seeds, in one process (world size 1).

For each finite ε the noise multiplier σ is the smallest that keeps ε(δ) ≤ target after the
run's rounds, found with dp-accounting's own calibration (``calibrate_dp_mechanism``) on
the same events the run composes (:mod:`fedmpi.privacy.accountant`); ε = ∞ is the same
setting without DP (``privacy.dp.level: none``). Prints a markdown table and, last, one JSON
object (also written with ``--json``).

    .venv/bin/python bench/privacy_digits.py [--seeds 0 1 2] [--json bench/measured/...json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dp_accounting  # noqa: E402
from dp_accounting import rdp  # noqa: E402

from fedmpi.comm.world import Comm  # noqa: E402
from fedmpi.config.schema import config_from_dict  # noqa: E402
from fedmpi.privacy.accountant import client_round_event, record_step_event  # noqa: E402
from fedmpi.training.loop import num_local_steps, sgd_config  # noqa: E402
from fedmpi.privacy.dpsgd import poisson_rate  # noqa: E402
from fedmpi.runtime.driver import run  # noqa: E402

DELTA = 1e-5
#: shared settings: an MLP (no BatchNorm, so DP-SGD applies), iid digits
BASE = {"data": {"dataset": "digits", "partition": {"method": "iid"},
                 "validation": {"fraction": 0.0}},
        "model": {"name": "mlp", "mlp": {"hidden": [64]}},
        "aggregation": {"weighting": "uniform"},
        "eval": {"every": 5},
        "runtime": {"progress": False, "threads": 1}}
#: client level: many small clients, a fixed-size sample of them per round
CLIENT = {"data": {"num_clients": 100},
          "train": {"rounds": 30, "clients_per_round": 40, "local_epochs": 1, "batch_size": 16,
                    "lr": 0.1},
          "privacy": {"dp": {"clip": 0.5}}}
#: record level: a few silos, every silo every round
RECORD = {"data": {"num_clients": 5},
          "train": {"rounds": 15, "clients_per_round": None, "local_epochs": 1, "batch_size": 32,
                    "lr": 0.1},
          "privacy": {"dp": {"clip": 1.0}}}


def merge(*ds: dict) -> dict:
    out: dict = {}
    for d in ds:
        for k, v in d.items():
            out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
                else v
    return out


def run_events(cfg_dict: dict) -> list:
    """Per silo (record) or once (client): σ ↦ the DP event the whole run composes,
    built by the run's own event constructors (:mod:`fedmpi.privacy.accountant`)."""
    cfg = config_from_dict(cfg_dict)
    R, K = cfg.train.rounds, cfg.data.num_clients
    if cfg.privacy.dp.level == "client":
        m = cfg.train.clients_per_round or K
        return [lambda s: dp_accounting.SelfComposedDpEvent(client_round_event(K, m, s), R)]
    from fedmpi.data.silos import build_local   # the silos' sizes n_k decide q_k and τ_k
    from fedmpi.usercode import UserCode

    n = np.asarray(build_local(cfg, Comm(), list(range(K)), True, None,
                               needs=UserCode().data_needs(cfg)).num_samples)
    sgd = sgd_config(cfg)

    def steps(k: int) -> int:   # τ_k, as the accountant foresees it (fedmpi.privacy.budget)
        return num_local_steps(int(n[k]), sgd)
    return [lambda s, k=k: dp_accounting.SelfComposedDpEvent(
        record_step_event(poisson_rate(int(n[k]), cfg.train.batch_size), s), R * steps(k))
        for k in range(K)]


def calibrate(cfg_dict: dict, target: float) -> float:
    """Smallest σ with ε(δ) ≤ target for every silo, by dp-accounting's calibration."""
    relation = (dp_accounting.NeighboringRelation.REPLACE_ONE
                if cfg_dict["privacy"]["dp"]["level"] == "client"
                else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    return max(float(dp_accounting.calibrate_dp_mechanism(
        lambda: rdp.RdpAccountant(neighboring_relation=relation), event, target, DELTA,
        dp_accounting.LowerEndpointAndGuess(0.1, 1.0), tol=0.001)) for event in run_events(cfg_dict))


def finite(x):
    """JSON has no infinity: ∞ is written as the string "inf"."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "runs" / "privacy_digits"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0, math.inf])
    ap.add_argument("--levels", default="client,record")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cells = []
    for level in args.levels.split(","):
        setting = merge(BASE, CLIENT if level == "client" else RECORD,
                        {"privacy": {"dp": {"level": level, "delta": DELTA}}})
        for eps in args.epsilons:
            d = merge(setting, {"privacy": {"dp": {"level": "none"}}}) if math.isinf(eps) else \
                merge(setting, {"privacy": {"dp": {"noise_multiplier": calibrate(setting, eps)}}})
            sigma = d["privacy"]["dp"].get("noise_multiplier") if not math.isinf(eps) else 0.0
            accs, logged, secs = [], [], []
            for seed in args.seeds:
                cfg = config_from_dict(merge(d, {"seed": seed, "name": f"{level}_eps{eps}_s{seed}"}))
                t0 = time.perf_counter()
                m = run(cfg, Path(args.out) / cfg.name, comm=Comm(), overwrite=True)
                secs.append(time.perf_counter() - t0)
                accs.append(m["test_accuracy"])
                logged.append(m.get("epsilon", math.inf))
            cell = {"level": level, "target_epsilon": eps, "noise_multiplier": sigma,
                    "clip": setting["privacy"]["dp"]["clip"], "delta": DELTA,
                    "logged_epsilon": logged, "accuracy": accs, "seconds": secs,
                    "accuracy_mean": float(np.mean(accs)), "accuracy_std": float(np.std(accs))}
            cells.append(cell)
            print(f"{level} eps={eps} sigma={sigma:.3f} acc={cell['accuracy_mean']:.4f}"
                  f"±{cell['accuracy_std']:.4f} logged eps={logged}", file=sys.stderr, flush=True)
    print("| level | ε (δ=1e-5) | σ | test accuracy (mean ± std, 3 seeds) |")
    print("|---|---|---|---|")
    for c in cells:
        eps = "∞ (no DP)" if math.isinf(c["target_epsilon"]) else f"{c['target_epsilon']:g}"
        print(f"| {c['level']} | {eps} | {c['noise_multiplier']:.3f} | "
              f"{100 * c['accuracy_mean']:.2f} ± {100 * c['accuracy_std']:.2f}% |")
    out = {"settings": {"base": BASE, "client": CLIENT, "record": RECORD}, "cells": cells}
    text = json.dumps(finite(out))
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
