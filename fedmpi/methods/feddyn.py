"""FedDyn (Acar et al. 2021), the rule of the official code.

Client k with n_k samples (Σn over all N clients) uses the adaptive
coefficient α_k = α / (N·n_k/Σn) (official ``alpha_coef / weight_list``) and
minimises

    ℓ_k(w) + α_k ⟨w, −θ + h_k⟩ + ((α_k + wd)/2)‖w‖²

i.e. every local step adds α_k (h_k − θ) to the gradient (``grad_hook``), the
gradient is clipped to ``algorithm.feddyn.max_grad_norm`` (10, official code and FedVG
Table A.2), then weight decay α_k + wd is applied (``local_sgd``; the
optimizer's weight decay, after the clip, as in the official code). After
training, from the actual final model θ_k (``finish_client``):

    h_k ← h_k + (θ_k − θ)                                  (h_k = 0 initially)

Server (rank 0 keeps H = Σ_{all N} h_k, updated by the "sum" statistic
Σ_{k∈S} (θ_k − θ), so no h_k ever travels):

    θ ← θ + Σ_{k∈S} s_k (θ_k − θ) + (1/N)·H    ( = mean_S θ_k + mean_N h_k )

α = ``algorithm.feddyn.alpha`` (0.1, FedVG Table A.2). With ``weighting: fedvg`` the
averaging step takes FedVG's weights and the h correction is unchanged (FedVG
Table A.8); h is never reweighted because its statistic is "sum".

Deviations: the official code averages the θ_k uniformly; here s_k follows
``aggregation.weighting`` (``uniform`` reproduces it). The official scripts
report the accuracy of several models (the plain average, the average of all
clients, the h-corrected cloud model); we evaluate the h-corrected θ that the
clients receive. h_k and H cover the parameters only; BN running statistics
are averaged. ``algorithm.server_lr`` is not used (FedDyn has no server lr).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from fedmpi.training.flat import FlatModel
from fedmpi.config.params import param
from fedmpi.training.loop import SGDConfig, StepHooks, TrainResult
from fedmpi.methods.base import Algorithm, Exchange, MethodSpec
from fedmpi.component import ClientTask, RoundInfo, Stat
from fedmpi.config.core import Config


@dataclass(frozen=True)
class FedDynParams:
    alpha: float = param(0.1, "FedDyn regularisation alpha", gt=0)
    max_grad_norm: float | None = param(10.0, "FedDyn local gradient clip (official code: 10); "
                                        "null = train.grad_clip", gt=0)


class FedDyn(Algorithm):
    name = "feddyn"
    # alpha_k enters as coupled weight decay, not AdamW's; the local step is plain SGD
    spec = MethodSpec(optimizers=("sgd", "adam"), record_dp=True)
    params = {"feddyn": FedDynParams}

    def __init__(self, cfg: Config, layout, num_clients: int) -> None:
        super().__init__(cfg, layout, num_clients)
        p = self.hparams("feddyn")
        self.alpha = float(p.alpha)
        clip = p.max_grad_norm
        self.clip = self.sgd.grad_clip if clip is None else float(clip)
        self.alpha_k = np.full(num_clients, self.alpha)   # replaced in bind (needs n_k)
        self.h_local = self.client_store("h", self.num_params)   # h_k of hosted clients (worker)
        self.h_sum: torch.Tensor | None = None             # H = Σ_N h_k (rank 0)
        self._lin: torch.Tensor | None = None
        self.device = torch.device("cpu")

    def setup(self, ctx) -> None:
        self.alpha_k = self.adaptive_alpha(self.alpha, np.asarray(ctx.num_samples))
        if ctx.is_server:
            self.h_sum = torch.zeros(self.num_params, device=ctx.device)

    @staticmethod
    def adaptive_alpha(alpha: float, num_samples: np.ndarray) -> np.ndarray:
        """α_k = α / (N·n_k/Σn); an empty client gets α."""
        n = num_samples.astype(np.float64)
        rel = n * len(n) / max(n.sum(), 1.0)
        return np.where(rel > 0, alpha / np.maximum(rel, 1e-300), alpha)

    def exchange(self) -> Exchange:
        return Exchange((Stat("delta", self.state_size, "weighted"),
                         Stat("dh", self.num_params, "sum")))

    # ----------------------------------------------------------------- client
    def local_sgd(self, task: ClientTask) -> SGDConfig:
        a_k = float(self.alpha_k[task.client])
        sgd = super().local_sgd(task)
        return dataclasses.replace(sgd, weight_decay=a_k + sgd.weight_decay, grad_clip=self.clip)

    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        P = self.num_params
        if self._lin is None:
            self._lin = torch.empty(P, device=state.device)
        lin = torch.sub(self.h_local.vector(task.client, state.device), state[:P], out=self._lin)
        lin.mul_(float(self.alpha_k[task.client]))       # ∇ of α_k⟨w, −θ + h_k⟩

        def linear_term(flat: FlatModel) -> None:
            flat.grad.add_(lin)

        return StepHooks(grad_hook=linear_term)

    def finish_client(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor,
                      out: dict[str, torch.Tensor], result: TrainResult) -> None:
        dh = out["dh"]
        dh.copy_(out["delta"][: self.num_params])
        if bool(torch.isfinite(dh).all()):
            self.h_local.vector(task.client, state.device).add_(dh)

    # ----------------------------------------------------------------- server
    def server_update(self, state: torch.Tensor, agg: dict[str, torch.Tensor],
                      info: RoundInfo) -> None:
        self.h_sum.add_(agg["dh"])
        state.add_(agg["delta"])
        state[: self.num_params].add_(self.h_sum, alpha=1.0 / info.num_clients)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"h_sum": self.h_sum} if self.h_sum is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.h_sum.copy_(state["h_sum"])

