"""APFL (Deng, Kamani, Mahdavi 2020, "Adaptive personalized federated learning").

Each client k keeps a local model v_k and a mixing weight α_k ∈ [0, 1]; its personalised
model is the mixture of parameters (Eq. 3)

    v̄_k = α_k v_k + (1 − α_k) w.

Algorithm 1, one local step on a minibatch ξ, from (w_k, v_k, α_k) of the previous step:

    w_k ← w_k − η ∇f_k(w_k; ξ)                                  (the global model's copy)
    v_k ← v_k − η ∇_v f_k(v̄_k; ξ) = v_k − η α_k ∇f_k(v̄_k; ξ)
    α_k ← Π_[0,1]( α_k − η_α ⟨v_k − w_k, ∇f_k(v̄_k; ξ)⟩ )        (Eq. 10, adaptive α)

with v̄_k = α_k v_k + (1 − α_k) w_k of the previous step. The server averages the w_k as
FedAvg does (the uploaded Δ_k = w_k − w). ``algorithm.apfl.alpha`` is α's initial value
(0.5, the paper's), ``algorithm.apfl.adaptive: false`` keeps it fixed,
``algorithm.apfl.alpha_lr`` = η_α (null: the round's learning rate). v_k starts from the
initial model w^0 (the same on every rank); v_k and α_k live on the worker hosting k (the
per-client stores ``apfl/v`` and ``apfl/alpha``, checkpointed by client id) and never
leave it. The personal model evaluated per site is α_k v_k + (1 − α_k) w with w the
current global model (float buffers mixed alike).

Implementation: v_k's and α_k's steps run inside the shared local loop on the global
step's batch (the method's ``loss_fn``; the gradient at v̄_k from
:func:`fedmpi.training.functional.loss_and_grad`). Deviations: v_k's steps are plain SGD
whatever ``train.optimizer``; the float buffers of v̄_k are the mixture's, and the running
statistics a BatchNorm layer collects in v̄_k's forward are written back to v_k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from fedmpi.component import ClientTask
from fedmpi.config.core import Config
from fedmpi.config.params import param
from fedmpi.methods.base import Algorithm, MethodSpec
from fedmpi.methods.personal import ClientModels
from fedmpi.training.flat import FlatModel
from fedmpi.training.functional import loss_and_grad
from fedmpi.training.loop import StepHooks


@dataclass(frozen=True)
class APFLParams:
    alpha: float = param(0.5, "APFL: initial mixing weight α of the local model "
                         "(Deng et al. 2020)", ge=0, le=1)
    adaptive: bool = param(True, "APFL: learn α per client (Eq. 10); false keeps it fixed")
    alpha_lr: Optional[float] = param(None, "APFL: learning rate of α; null = the round's "
                                      "train.lr", gt=0)


class APFL(Algorithm):
    name = "apfl"
    spec = MethodSpec(own_loss=True, split_batch=False, personal=True)
    params = {"apfl": APFLParams}

    def __init__(self, cfg: Config, layout: FlatModel, num_clients: int) -> None:
        super().__init__(cfg, layout, num_clients)
        self.v = self.client_store("apfl/v", self.state_size)
        self.alpha = self.client_store("apfl/alpha", 1)
        self.initial = layout.vector.detach().clone()    # w^0: every v_k starts here
        self._mix: Optional[torch.Tensor] = None

    def personal_vector(self, client: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(v_k, α_k): w^0 and the initial α before client k's first participation."""
        if client not in self.v:
            self.v[client] = self.initial.to(self.device).clone()
            self.alpha[client] = torch.full((1,), float(self.hparams().alpha),
                                            device=self.device)
        return self.v[client], self.alpha[client]

    def mixture(self, v: torch.Tensor, alpha: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """v̄ = α v + (1 − α) w (into a reused buffer)."""
        if self._mix is None:
            self._mix = torch.empty_like(v)
        a = float(alpha[0])
        return torch.add(w.mul(1.0 - a), v, alpha=a, out=self._mix)

    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        hp = self.hparams()
        lr = self.local_sgd(task).lr
        alpha_lr = hp.alpha_lr or lr
        v, alpha = self.personal_vector(task.client)
        P = self.num_params

        def loss(flat: FlatModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            w = flat.vector.detach()
            mix = self.mixture(v, alpha, w)
            _, g = loss_and_grad(flat, mix, x, y)         # ∇f(v̄) of the previous step
            out = F.cross_entropy(flat.model(x), y)       # w's step (FedAvg), in the loop
            with torch.no_grad():
                a = float(alpha[0])
                if hp.adaptive:
                    dot = torch.dot(v[:P] - w[:P], g)
                    alpha.sub_(alpha_lr * dot).clamp_(0.0, 1.0)
                v[:P].add_(g, alpha=-lr * a)
                v[P:].copy_(mix[P:])                      # the statistics v̄'s forward kept
            return out

        return StepHooks(loss_fn=loss)

    def client_models(self) -> ClientModels:
        """Client k's personal model is the mixture ᾱ_k v_k + (1 − ᾱ_k) θ."""
        def load(client: int, state: torch.Tensor, flat: FlatModel) -> None:
            v, alpha = self.personal_vector(client)
            flat.load(self.mixture(v, alpha, state))

        return ClientModels(None, load)
