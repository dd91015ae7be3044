"""Your own model, dataset and method in one file, run by fedmpi.

    mpiexec -n 3 python examples/custom_method.py          # or: python examples/custom_method.py

The same objects by import path, from the repository root (no Python API):

    fedmpi run configs/quickstart.yaml --set model.name=examples.custom_method:Net \
        --set data.dataset=examples.custom_method:wine --set data.partition.min_size=5 \
        --set algorithm.name=examples.custom_method:ClippedFedAvg --set algorithm.params.max_norm=1
"""
from dataclasses import dataclass

import torch
from sklearn.datasets import load_wine
from torch import nn
from torch.utils.data import TensorDataset

import fedmpi
from fedmpi.methods.base import Algorithm


class Net(nn.Module):
    """A model: called as Net(input_shape, num_classes)."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 16), nn.Tanh(),
                                  nn.Linear(16, num_classes))

    def forward(self, x):
        return self.body(x)


def wine():
    """A dataset: (train, test) map-style datasets of (features, label)."""
    x, y = load_wine(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y)
    test = torch.arange(len(y)) % 5 == 0          # every fifth sample is test data
    return TensorDataset(x[~test], y[~test]), TensorDataset(x[test], y[test])


class ClippedFedAvg(Algorithm):
    """A method: FedAvg whose aggregated update is clipped to norm max_norm."""

    @dataclass(frozen=True)
    class Params:
        max_norm: float = 1.0

    params = {"params": Params}                     # algorithm.params, checked by fedmpi

    def server_update(self, state, agg, info):
        delta = agg["delta"]
        max_norm = self.hparams("params").max_norm
        scale = min(1.0, max_norm / (float(delta.norm()) + 1e-12))
        state.add_(delta, alpha=self.server_lr * scale)


if __name__ == "__main__":
    config = {"name": "custom_method", "data": {"num_clients": 4, "partition": {"min_size": 5}},
              "train": {"rounds": 10, "batch_size": 16, "lr": 0.1},
              "algorithm": {"params": {"max_norm": 2.0}},
              "eval": {"metrics": ["accuracy", "balanced_accuracy", "macro_f1"]},
              "runtime": {"device": "cpu", "progress": False}}
    result = fedmpi.run(config, model=Net, data=wine, algorithm=ClippedFedAvg)
    if result.is_root:
        print("final", result.metrics, "log:", result.log_path)
