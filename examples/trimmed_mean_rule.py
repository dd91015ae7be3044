"""A server-side aggregation rule: coordinate-wise trimmed mean (Yin et al., ICML 2018).

    mpiexec -n 3 fedmpi run configs/quickstart.yaml \
        --set aggregation.rule=examples.trimmed_mean_rule:TrimmedMean \
        --set aggregation.params.beta=0.2
"""
from dataclasses import dataclass

import torch

from fedmpi.aggregation.rules import ServerRule


@dataclass(frozen=True)
class Params:
    beta: float = 0.1          # fraction of clients trimmed on each side, per coordinate


class TrimmedMean(ServerRule):
    """Per coordinate: drop the ⌊βn⌋ largest and smallest values, average the rest."""

    params = {"params": Params}     # its keys: aggregation.params.*
    per_client = True               # every client's update reaches rank 0 as a row

    def aggregate(self, rows, info):
        b = int(self.hparams("params").beta * len(info.clients))
        out = {}
        for name, x in rows.items():                 # x: [n clients, size] float32
            kept = torch.sort(x, dim=0).values[b: x.shape[0] - b]
            out[name] = kept.mean(dim=0)
        return out                                   # the method's server rule applies it
