"""FedNova (Wang et al. 2020): normalised averaging of client updates.

Client k takes τ_k local steps; its normalising constant a_k
(``algorithm.fednova.normaliser``):

* ``momentum`` (default; the official ``FedNova`` optimizer's
  ``local_normalizing_vec``, paper Eq. 10 with client momentum ρ):
  a_k = ‖a_k‖₁ = Σ_{t=1}^{τ_k} (1 − ρ^t)/(1 − ρ)  (= τ_k for ρ = 0);
* ``steps``: a_k = τ_k whatever the momentum — ECGR Algorithm 3 ("normalise g'
  by τ_i", τ_eff = Σ p_i τ_i), used by the ECGR paper-setting configs.

It uploads the normalised update d_k = Δ_k / a_k ("weighted", written after
the shared local path so client-side transforms such as ECGR are normalised
too) and a_k itself (``fednova/a``, a per-client statistic of one float,
logged as ``/fednova/a``). The server, with p_k = s_k from
``aggregation.weighting``:

    τ_eff = Σ_k p_k a_k,        θ ← θ + η_g τ_eff Σ_k p_k d_k

With equal τ_k this is FedAvg (up to float rounding of /a·a). Under ``round.mode:
deadline`` with ``round.time_budget`` the τ_k differ by design (each client takes the
steps that fit before the deadline) and this is the rule that keeps the aggregate from
leaning towards the fast clients' objectives (Wang et al. 2020, Theorem 1); a stale
update (``round.late: carry``, buffered rounds) enters with its staleness weight s(τ) in
p_k d_k, τ_eff = Σ_k p_k a_k over the step's updates. FedVG
substitutes p_k (Table A.8 does not list FedNova; the composition is the
natural one) and scores the client model θ + a_k d_k = θ_k (FedVG Eq. 4, via
``spec.delta_scale``), never θ + d_k. η_g = ``algorithm.server_lr`` (1).

Deviations: the normalisation covers the parameters; float buffers (BN
running statistics) take the plain weighted average. The FedProx variant of
the normaliser ((1 − η μ) factors) is not implemented.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedmpi.config.params import param
from fedmpi.training.loop import TrainResult
from fedmpi.methods.base import Algorithm, Exchange, MethodSpec
from fedmpi.component import ClientTask, RoundInfo, Stat

A_STAT = "fednova/a"


def normaliser(steps: np.ndarray | int, momentum: float) -> np.ndarray:
    """a = ‖a‖₁ for τ local steps: τ for ρ = 0, Σ_{t=1}^{τ} (1 − ρ^t)/(1 − ρ) otherwise."""
    tau = np.asarray(steps, dtype=np.float64)
    if momentum == 0.0:
        return tau
    rho = float(momentum)
    return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)


@dataclass(frozen=True)
class FedNovaParams:
    normaliser: str = param("momentum", "FedNova a_k: momentum-aware (official FedNova code) or "
                            "steps = tau_k (ECGR Alg. 3)", choices=("momentum", "steps"))


class FedNova(Algorithm):
    name = "fednova"
    # a_k normalises SGD steps (with momentum rho) from a zero momentum buffer each round;
    # θ_k − θ = a_k d_k on the parameters (FedVG scores θ_k, not θ + d_k); each update
    # carries its own a_k, so a step of the deadline or buffered rounds is the same rule
    # over the updates it aggregates (round.time_budget's unequal τ_k)
    spec = MethodSpec(optimizers=("sgd",), fresh_optimizer=True, record_dp=True,
                      delta_scale=A_STAT, asynchronous=True)
    params = {"fednova": FedNovaParams}

    def exchange(self) -> Exchange:
        return Exchange((*super().exchange().uplink, Stat(A_STAT, 1, "client")))

    def client_normaliser(self, steps: int, momentum: float) -> float:
        """a_k of ``algorithm.fednova.normaliser`` (module docstring)."""
        if self.hparams("fednova").normaliser == "steps":
            return float(steps)
        return float(normaliser(steps, momentum))

    def finish_client(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor,
                      out: dict[str, torch.Tensor], result: TrainResult) -> None:
        """Upload d_k = Δ_k / a_k on the parameters, and a_k."""
        a_k = max(self.client_normaliser(result.steps, self.local_sgd(task).momentum), 1e-12)
        out["delta"][: self.num_params].div_(a_k)
        out[A_STAT].fill_(a_k)

    def server_update(self, state: torch.Tensor, agg: dict[str, torch.Tensor],
                      info: RoundInfo) -> None:
        P = self.num_params
        a_all = agg[A_STAT]
        rows = torch.as_tensor(info.clients, dtype=torch.long, device=a_all.device)
        a = a_all[rows, 0].double().cpu().numpy()
        tau_eff = float(np.sum(np.asarray(info.weights, dtype=np.float64) * a))
        state[:P].add_(agg["delta"][:P], alpha=self.server_lr * tau_eff)
        state[P:].add_(agg["delta"][P:], alpha=self.server_lr)
