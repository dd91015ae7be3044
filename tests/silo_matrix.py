"""Every method, transform, robust rule, DP level and secure aggregation on a silo of two
ranks, for tests/test_silo.py: ``mpiexec -n 3 python tests/silo_matrix.py OUT [CASE ...]``.

For each case the same small run (digits, an MLP, 2 rounds) goes twice through the real
driver in this one launch: with ``runtime.ranks_per_silo: 2`` (one silo of ranks 1 and 2)
and with 1 (two one-rank workers). Rank 0 prints one line per case::

    CASE ok DIFF METRICS        both completed; max |Δθ| of the final models, and the
                                largest difference of their final metrics
    CASE refused LINE           the silo run raised a ConfigError (LINE: its message)

and ``done`` at the end. Results do not depend on the rank layout, so the two models
agree to float rounding wherever the silo trains the same math.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

BASE = {"name": "silo-matrix", "seed": 3,
        "runtime": {"progress": False, "device": "cpu", "threads": 1, "round_timeout": 120},
        "data": {"dataset": "digits", "num_clients": 6, "partition": {"method": "iid"}},
        "model": {"name": "mlp"}, "eval": {"every": 2},
        "train": {"rounds": 2, "clients_per_round": 5, "local_steps": 3, "batch_size": 15,
                  "lr": 0.05}}
SUBMODEL = {"system.levels": [1.0, 0.5], "system.allocation": [3, 3]}
ATTACK = {"adversary.clients": [0, 1]}

CASES: dict[str, dict] = {
    **{f"method-{m}": {"algorithm.name": m} for m in
       ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedprox", "scaffold", "feddyn", "fednova",
        "elastic", "fedgps")},
    **{f"method-{m}": {"algorithm.name": m, **SUBMODEL} for m in
       ("heterofl", "fedrolex", "fiarse", "scalefl")},
    "method-fedlagc": {"algorithm.name": "fedlagc", "system.levels": [1.0, 0.75],
                       "system.allocation": [3, 3]},
    "eval-clients": {"eval.where": "both", "eval.client_holdout": 0.2, "eval.every": 1},
    "eval-sharded": {"eval.sharded": True, "eval.every": 1},
    "cross-site": {"eval.cross_site": True, "eval.where": "both", "eval.client_holdout": 0.2},
    "weighting-fedvg": {"aggregation.weighting": "fedvg"},
    "ecgr": {"ecgr.enabled": True},
    "adam-kept": {"train.optimizer": "adamw", "train.optimizer_state": "keep"},
    "class-weights": {"train.class_weights": [1.0, 2.0, 0.5, 1.0, 1.0, 3.0, 1.0, 1.0, 0.7, 1.0]},
    "batchnorm": {"model.name": "cnn", "model.norm": "bn"},
    **{f"attack-{k}": {**ATTACK, "adversary.kind": k} for k in
       ("label_flip", "sign_flip", "nan", "alie")},
    **{f"rule-{r}": {**ATTACK, "adversary.kind": "sign_flip", "aggregation.rule": r} for r in
       ("median", "trimmed_mean", "krum", "multi_krum", "geometric_median", "norm_clip",
        "fltrust")},
    "compression-topk": {"compression.uplink": "topk", "compression.topk_fraction": 0.1},
    "compression-bf16-down": {"compression.uplink": "int8", "compression.downlink": "bf16"},
    "dp-client": {"privacy.dp.level": "client", "privacy.dp.clip": 1.0,
                  "privacy.dp.noise_multiplier": 0.5, "aggregation.weighting": "uniform"},
    "dp-record": {"privacy.dp.level": "record", "privacy.dp.clip": 1.0,
                  "privacy.dp.noise_multiplier": 0.5},
    "secagg": {"privacy.secure_aggregation": True},
    "secagg-dp-distributed": {"privacy.secure_aggregation": True, "privacy.dp.level": "client",
                              "privacy.dp.noise": "distributed", "privacy.dp.clip": 1.0,
                              "privacy.dp.noise_multiplier": 0.5,
                              "aggregation.weighting": "uniform"},
}


def config(over: dict, R: int):
    import copy

    from conftest import set_dotted
    from fedmpi.config.schema import config_from_dict

    return config_from_dict(set_dotted(copy.deepcopy(BASE), {**over, "runtime.ranks_per_silo": R}))


def main() -> None:
    from mpi4py import MPI

    from fedmpi.consortium.cross_site import final_evaluations
    from fedmpi.errors import ConfigError
    from fedmpi.log.reader import read
    from fedmpi.runtime.driver import run as run_driver

    def run(cfg, out):
        return run_driver(cfg, out, final=final_evaluations(cfg))

    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(CASES)
    rank = MPI.COMM_WORLD.Get_rank()
    for name in names:
        try:
            mine = run(config(CASES[name], 2), out / name / "r2")
        except ConfigError as exc:
            if rank == 0:
                print(f"{name} refused {str(exc).splitlines()[0]}", flush=True)
            continue
        ref = run(config(CASES[name], 1), out / name / "r1")
        if rank == 0:
            a, b = (torch.load(out / name / r / "model.pt", weights_only=True) for r in ("r2", "r1"))
            diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a
                       if a[k].is_floating_point())
            metrics = max(abs(mine[k] - ref[k]) for k in ref)
            logs = [read(out / name / r / "log.h5").arrays for r in ("r2", "r1")]
            for key in ("cross_site/test_accuracy", "cross_site/test_loss"):   # K x (K + 1)
                if key in logs[1]:
                    metrics = max(metrics, float(np.abs(logs[0][key] - logs[1][key]).max()))
            print(f"{name} ok {diff:.3g} {metrics:.3g}", flush=True)
    if rank == 0:
        print("done", flush=True)


if __name__ == "__main__":
    main()
