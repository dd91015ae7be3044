"""A tabular MLP with Dropout (model.name ``dropout_mlp:DropoutMLP``, tests/test_silo.py)."""
from __future__ import annotations

from torch import nn


class DropoutMLP(nn.Sequential):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        width = 1
        for d in input_shape:
            width *= int(d)
        super().__init__(nn.Flatten(), nn.Linear(width, 32), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(32, num_classes))
