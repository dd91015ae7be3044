"""FedNova (Wang et al. 2020): normalised averaging of client updates.

Client k takes τ_k local steps; its normalising constant is a_k = ‖a_k‖₁ of
the paper's vector (Eq. 10): τ_k for plain SGD, and with client momentum ρ
(as in the official ``FedNova`` optimizer's ``local_normalizing_vec``)

    a_k = Σ_{t=1}^{τ_k} (1 − ρ^t)/(1 − ρ)

It uploads the normalised update d_k = Δ_k / a_k ("weighted", written after
the shared local path so client-side transforms such as ECGR are normalised
too). The server, with p_k = s_k from ``aggregation.weighting`` and a_k
recomputed from the reported steps (``info.steps``):

    τ_eff = Σ_k p_k a_k,        θ ← θ + η_g τ_eff Σ_k p_k d_k

With equal τ_k this is FedAvg (up to float rounding of /a·a). FedVG
substitutes p_k (Table A.8 does not list FedNova; the composition is the
natural one). η_g = ``algorithm.server_lr`` (1).

Deviations: the normalisation covers the parameters; float buffers (BN
running statistics) take the plain weighted average. The FedProx variant of
the normaliser ((1 − η μ) factors) is not implemented.
"""
from __future__ import annotations

import numpy as np
import torch

from ..train import LocalTrainer, TrainResult
from .base import Algorithm, ClientTask, RoundInfo
from .transforms import TransformChain


def normaliser(steps: np.ndarray | int, momentum: float) -> np.ndarray:
    """a = ‖a‖₁ for τ local steps: τ for ρ = 0, Σ_{t=1}^{τ} (1 − ρ^t)/(1 − ρ) otherwise."""
    tau = np.asarray(steps, dtype=np.float64)
    if momentum == 0.0:
        return tau
    rho = float(momentum)
    return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)


class FedNova(Algorithm):
    name = "fednova"

    def client_update(self, task: ClientTask, trainer: LocalTrainer, state: torch.Tensor,
                      extras: torch.Tensor, out: dict[str, torch.Tensor], transforms: TransformChain = TransformChain()) -> TrainResult:
        result = super().client_update(task, trainer, state, extras, out, transforms)
        a_k = float(normaliser(result.steps, self.local_sgd(task).momentum))
        out["delta"][: self.num_params].div_(max(a_k, 1e-12))
        return result

    def server_update(self, state: torch.Tensor, agg: dict[str, torch.Tensor],
                      info: RoundInfo) -> None:
        P = self.num_params
        a = normaliser(info.steps, self.sgd.momentum)
        tau_eff = float(np.sum(np.asarray(info.weights, dtype=np.float64) * a))
        state[:P].add_(agg["delta"][:P], alpha=self.server_lr * tau_eff)
        state[P:].add_(agg["delta"][P:], alpha=self.server_lr)
