"""Run an experiment from Python and read its log into pandas.

    python examples/api_to_pandas.py                  # or under mpiexec -n 3
"""
from pathlib import Path

import fedmpi
from fedmpi.log.reader import read

config = Path(__file__).resolve().parents[1] / "configs" / "tabular_silos.yaml"
result = fedmpi.run(config,
                    overrides=["data.partition.method=dirichlet",   # pooled: no silo files needed
                               "train.rounds=5", "name=api_to_pandas"])
if result.is_root:
    log = read(result.log_path)
    rounds = log.rounds_frame()                    # one row per round: /rounds/*
    print(rounds[["round", "test_accuracy", "balanced_accuracy", "macro_f1", "auroc",
                  "train_loss"]].to_string(index=False))
    per_client = log.clients["weight"]             # [rounds, clients] aggregation weights
    print("mean weight per client:", per_client.mean(axis=0).round(3))
