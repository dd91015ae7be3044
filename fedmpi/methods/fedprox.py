"""FedProx (Li et al. 2020): a proximal term in the local objective.

Local loss ℓ_k(w) + (μ/2)‖w − θ‖² over the parameters, so every local step
adds μ(w − θ) to the gradient (the ``grad_hook`` on ``flat.grad``, before
clipping and weight decay). Server: FedAvg (weighted average with s_k from
``aggregation.weighting``; ``fedvg`` substitutes FedVG's weights, FedVG Table
A.8). μ = ``algorithm.fedprox.mu`` (0.01 FedVG; 0.125 FedGPS; 0.1 ECGR code). μ = 0 is
FedAvg exactly (adding 0·(w − θ) leaves every gradient bit-identical).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedmpi.training.flat import FlatModel
from fedmpi.config.params import param
from fedmpi.training.loop import StepHooks
from fedmpi.methods.base import Algorithm, MethodSpec
from fedmpi.component import ClientTask


@dataclass(frozen=True)
class FedProxParams:
    mu: float = param(0.01, "FedProx proximal coefficient", ge=0)


class FedProx(Algorithm):
    name = "fedprox"
    spec = MethodSpec(record_dp=True, asynchronous=True)   # plain SGD local step (docs/privacy.md)
    params = {"fedprox": FedProxParams}
    _diff: torch.Tensor | None = None   # P-sized scratch on the worker

    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        P, mu = self.num_params, self.hparams().mu
        anchor = state[:P]
        if self._diff is None:
            self._diff = torch.empty(P, device=state.device)
        diff = self._diff

        def prox(flat: FlatModel) -> None:
            torch.sub(flat.params, anchor, out=diff)
            flat.grad.add_(diff, alpha=mu)

        return StepHooks(grad_hook=prox)
