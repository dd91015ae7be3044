"""SCAFFOLD (Karimireddy et al. 2020), control variates with option II.

Client k (K_k local steps, local lr η_l), with server variate c (downlink
extra) and its own c_k (zero until its first participation; kept only on the
worker that hosts k):

    every local step:  g ← ∇ℓ_k(w) − c_k + c           (``grad_hook``, Eq. 3)
    afterwards:        c_k⁺ = c_k − c + (θ − θ_k)/(K_k η_l)   (option II, Eq. 4)

computed from the actual final local model θ_k. Uplink: Δ_k = θ_k − θ
("weighted") and δc_k = c_k⁺ − c_k ("sum": it is *not* reweighted by FedVG).
Server (Eq. 5, Algorithm 1):

    θ ← θ + η_g Σ_k s_k Δ_k          (s_k: ``aggregation.weighting``)
    c ← c + (1/N) Σ_{k∈S} δc_k       (= c + |S|/N · mean_k δc_k)

η_g = ``algorithm.server_lr`` (1.0, FedVG Table A.2). With ``weighting:
fedvg`` only the model update takes FedVG's weights; the c update is
unchanged (FedVG Table A.8).

Server c (``algorithm.scaffold.server_c``):

* ``increment`` (default; SCAFFOLD Algorithm 1 / Eq. 5, official code):
  c ← c + (1/N) Σ_{k∈S} δc_k — under partial participation the absent
  clients' c_k enter through the old c;
* ``weighted`` (ECGR Algorithm 4, line 20; the ECGR paper-setting configs):
  c ← Σ_{k∈S} p_k c_k⁺ with p_k the round's aggregation weights
  (``aggregation.weighting``; FedVG's s_k under FedVG). The client then
  uploads c_k⁺ ("weighted", P floats) instead of δc_k.

Deviations: the paper averages Δ_k uniformly; here s_k follows
``aggregation.weighting`` (``uniform`` reproduces the paper). With client
momentum or weight decay, option II still divides by K_k η_l (as the official
and FL-bench code do). c and c_k cover the parameters only (BN running
statistics are averaged as in FedAvg). A client whose update is excluded by
the server (non-finite) keeps its locally updated c_k only if that c_k is
finite.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedmpi.training.flat import FlatModel
from fedmpi.config.params import param
from fedmpi.training.loop import StepHooks, TrainResult
from fedmpi.methods.base import Algorithm, Exchange, MethodSpec
from fedmpi.component import ClientTask, RoundInfo, Stat
from fedmpi.config.core import Config


@dataclass(frozen=True)
class ScaffoldParams:
    server_c: str = param("increment", "SCAFFOLD server c: c + (1/N) sum dc_k (SCAFFOLD Alg. 1) or "
                          "weighted = sum p_k c'_k (ECGR Alg. 4 line 20)",
                          choices=("increment", "weighted"))


class Scaffold(Algorithm):
    name = "scaffold"
    # option II: c_k from the SGD displacement / (K_k lr) of this round's steps only (no
    # carried momentum); the local step is plain SGD (docs/privacy.md)
    spec = MethodSpec(optimizers=("sgd",), fresh_optimizer=True, record_dp=True)
    params = {"scaffold": ScaffoldParams}

    def __init__(self, cfg: Config, layout, num_clients: int) -> None:
        super().__init__(cfg, layout, num_clients)
        self.c_local = self.client_store("c", self.num_params)   # c_k of hosted clients (worker)
        self.c: torch.Tensor | None = None             # server variate (rank 0)
        self._corr: torch.Tensor | None = None         # c − c_k of the client in training
        self.device = torch.device("cpu")
        self.weighted_c = self.hparams("scaffold").server_c == "weighted"
        self._dc: torch.Tensor | None = None

    def exchange(self) -> Exchange:
        """Δ_k and c_k⁺ (weighted) or δc_k (summed) up; the server variate c down."""
        c = (Stat("c_new", self.num_params, "weighted") if self.weighted_c
             else Stat("dc", self.num_params, "sum"))
        return Exchange((Stat("delta", self.state_size, "weighted"), c), self.num_params)

    def setup(self, ctx) -> None:
        if ctx.is_server:
            self.c = torch.zeros(self.num_params, device=ctx.device)

    # ----------------------------------------------------------------- client
    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        if self._corr is None:
            self._corr = torch.empty(self.num_params, device=state.device)
        corr = torch.sub(extras, self.c_local.vector(task.client, state.device), out=self._corr)

        def correct(flat: FlatModel) -> None:
            flat.grad.add_(corr)

        return StepHooks(grad_hook=correct)

    def finish_client(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor,
                      out: dict[str, torch.Tensor], result: TrainResult) -> None:
        P = self.num_params
        c_k = self.c_local.vector(task.client, state.device)
        scale = 1.0 / (max(result.steps, 1) * (result.lr or self.local_sgd(task).lr))
        # δc_k = c_k⁺ − c_k = −c + (θ − θ_k)/(K η_l) = −c − Δ_k/(K η_l)
        if self.weighted_c:
            if self._dc is None:
                self._dc = torch.empty(P, device=state.device)
            dc = self._dc
        else:
            dc = out["dc"]
        torch.mul(out["delta"][:P], -scale, out=dc)
        dc.sub_(extras)
        if self.weighted_c:
            torch.add(c_k, dc, out=out["c_new"])       # c_k⁺ (ECGR Alg. 4)
        if bool(torch.isfinite(dc).all()):
            c_k.add_(dc)

    # ----------------------------------------------------------------- server
    def fill_downlink(self, extras: torch.Tensor, round: int) -> None:
        extras.copy_(self.c)

    def server_update(self, state: torch.Tensor, agg: dict[str, torch.Tensor],
                      info: RoundInfo) -> None:
        state.add_(agg["delta"], alpha=self.server_lr)
        if self.weighted_c:
            self.c.copy_(agg["c_new"])                   # Σ_k p_k c_k⁺
        else:
            self.c.add_(agg["dc"], alpha=1.0 / info.num_clients)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"c": self.c} if self.c is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.c.copy_(state["c"])

