"""FedAvgM (Hsu et al. 2019): server SGD with momentum on the pseudo-gradient.

    g_t = −Σ_k s_k (θ_k − θ)
    b_t = m·b_{t−1} + g_t,   d_t = g_t + m·b_t (Nesterov) or b_t,   θ ← θ − η·d_t

η = ``algorithm.server_lr`` (default 1), m = ``algorithm.fedavgm.server_momentum``
(0.9, FedVG Table A.2), Nesterov = ``algorithm.fedavgm.nesterov``. s_k come from
``aggregation.weighting``, so ``weighting: fedvg`` gives FedVG × FedAvgM
(ALGORITHMS.md FedVG.6: the FedVG-weighted pseudo-gradient into server SGD,
lr 1, momentum 0.9, Nesterov). With m = 0 the rule is FedAvg exactly.

Deviations / choices: ``algorithm.nesterov: null`` (default) turns Nesterov on
exactly when the weighting is ``fedvg``/``fedvg_avg`` (what FedVG's code does
for the combination) and off otherwise; momentum acts on parameters only, BN
running statistics are averaged (see :class:`ServerOptAlgorithm`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedmpi.config.params import param
from fedmpi.methods.server_opt import ServerOptAlgorithm, ServerSGD
from fedmpi.config.core import Config


@dataclass(frozen=True)
class FedAvgMParams:
    server_momentum: float = param(0.9, "FedAvgM server SGD momentum", ge=0, lt=1)
    nesterov: bool | None = param(None, "FedAvgM Nesterov momentum; null = on with weighting "
                                  "fedvg/fedvg_avg (FedVG code), else off")


class FedAvgM(ServerOptAlgorithm):
    name = "fedavgm"
    params = {"fedavgm": FedAvgMParams}

    def __init__(self, cfg: Config, layout, num_clients: int) -> None:
        super().__init__(cfg, layout, num_clients)
        a = self.hparams("fedavgm")
        self.momentum = float(a.server_momentum)
        self.nesterov = (cfg.aggregation.weighting in ("fedvg", "fedvg_avg")
                         if a.nesterov is None else bool(a.nesterov))

    def make_optimizer(self, size: int, device: torch.device) -> ServerSGD:
        return ServerSGD(size, device, lr=self.server_lr, momentum=self.momentum,
                         nesterov=self.nesterov)
