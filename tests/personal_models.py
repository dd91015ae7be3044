"""Models for tests/test_personal.py, importable by every rank of an mpiexec job
(``model.name=personal_models:<fn>`` with tests/ on PYTHONPATH)."""
from __future__ import annotations

import torch
from torch import nn

#: the values of ``tag``, whose gradient is exactly 0 (it enters the output times 0), so
#: it keeps them through training: bytes no message may carry when ``tag`` is personal
SENTINEL = torch.arange(16, dtype=torch.float32) * 0.125 + 1234.5


class Tagged(nn.Module):
    def __init__(self, width: int, num_classes: int) -> None:
        super().__init__()
        self.body = nn.Linear(width, 16)
        self.head = nn.Linear(16, num_classes)
        self.tag = nn.Parameter(SENTINEL.clone())

    def forward(self, x):
        return self.head(torch.relu(self.body(x.flatten(1)))) + 0.0 * self.tag.sum()


def sentinel_mlp(input_shape, num_classes):
    c, h, w = input_shape
    return Tagged(c * h * w, num_classes)


def bn_mlp(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, num_classes))


def mlp(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 16), nn.ReLU(),
                         nn.Linear(16, num_classes))
