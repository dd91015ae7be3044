"""FedAdam and FedYogi (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 2).

Clients run the plain local loop (FedAvg clients); the server treats
Δ_t = Σ_k s_k (θ_k − θ) as a negative gradient and applies

    m_t = β1 m_{t−1} + (1 − β1) Δ_t
    v_t = β2 v_{t−1} + (1 − β2) Δ_t²                      (FedAdam)
    v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)     (FedYogi)
    θ  ← θ + η m_t / (√v_t + τ)

η = ``algorithm.server_lr`` (default 0.01 for these methods), β1 =
``algorithm.fedadam.beta1`` (``fedyogi.*`` for FedYogi) (0.9), β2 = ``algorithm.fedadam.beta2`` (0.99), τ =
``algorithm.fedadam.tau`` (1e-3); m_{−1} = 0, v_{−1} = τ². The optimizer lives in
:mod:`fedmpi.methods.server_opt` (shared with FedAvgM).

Deviations: no bias correction (as the paper's Algorithm 2); the adaptive
step acts on parameters only, BN running statistics are averaged.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fedmpi.config.params import param
from fedmpi.methods.server_opt import ServerAdam, ServerOptAlgorithm
from fedmpi.config.core import Config


@dataclass(frozen=True)
class AdaptiveParams:
    beta1: float = param(0.9, "first-moment decay beta1", ge=0, lt=1)
    beta2: float = param(0.99, "second-moment decay beta2", ge=0, lt=1)
    tau: float = param(1e-3, "adaptivity tau (also v_0 = tau^2)", gt=0)


class FedAdam(ServerOptAlgorithm):
    name = "fedadam"
    params = {"fedadam": AdaptiveParams}
    spec = replace(ServerOptAlgorithm.spec, default_server_lr=0.01)
    yogi = False

    def __init__(self, cfg: Config, layout, num_clients: int) -> None:
        super().__init__(cfg, layout, num_clients)
        a = self.hparams(self.name)
        self.beta1, self.beta2, self.tau = float(a.beta1), float(a.beta2), float(a.tau)

    def make_optimizer(self, size: int, device: torch.device) -> ServerAdam:
        return ServerAdam(size, device, lr=self.server_lr, beta1=self.beta1, beta2=self.beta2,
                          tau=self.tau, yogi=self.yogi)


class FedYogi(FedAdam):
    name = "fedyogi"
    params = {"fedyogi": AdaptiveParams}
    yogi = True
