"""Ditto (Li, Hu, Beirami, Smith, ICML 2021): a personal model per client, regularised
towards the global one.

Objective (Eq. 1–2): the global model solves FedAvg's problem
G(w) = Σ_k p_k F_k(w); client k's personal model solves

    min_{v_k}  h_k(v_k; w*) = F_k(v_k) + (λ/2) ‖v_k − w*‖².

Algorithm 1 (the paper's solver): in round t client k runs its local steps on w (FedAvg,
the uploaded Δ_k = w_k − w^t) and s steps on its personal model

    v_k ← v_k − η_p (∇F_k(v_k) + λ (v_k − w^t))

with w^t the global model it received (``algorithm.ditto.lam`` = λ,
``algorithm.ditto.personal_lr`` = η_p, the round's learning rate by default). The
server is FedAvg's. v_k starts from the initial model w^0 (the same on every rank) and
lives on the worker hosting k (the per-client store ``ditto/v``, checkpointed by client
id); it never leaves the rank. The personal model evaluated per site is v_k.

Implementation: the personal step runs inside the shared local loop, on the same batch as
the global step (the method's ``loss_fn`` returns the global model's loss and steps v_k
from the gradient :func:`fedmpi.training.functional.loss_and_grad` computes at v_k), so
both take s = τ_k steps over the same samples. Deviations: the paper draws the two
models' minibatches independently; v_k's steps are plain SGD (no momentum) whatever
``train.optimizer``; λ applies to parameters only (float buffers such as BatchNorm
statistics are v_k's own running averages).
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
class DittoParams:
    lam: float = param(0.1, "Ditto λ: pull of each personal model towards the global model "
                       "(Li et al. 2021, Eq. 2; 0 = local training alone)", ge=0)
    personal_lr: Optional[float] = param(None, "Ditto: learning rate of the personal model's "
                                         "steps; null = the round's train.lr", gt=0)


class Ditto(Algorithm):
    name = "ditto"
    # the personal step rides on the global step's batch: its loss is the method's own, the
    # personal model is not data-parallel over a silo, and DP-SGD would not cover it
    spec = MethodSpec(own_loss=True, split_batch=False, personal=True)
    params = {"ditto": DittoParams}

    def __init__(self, cfg: Config, layout: FlatModel, num_clients: int) -> None:
        super().__init__(cfg, layout, num_clients)
        self.v = self.client_store("ditto/v", self.state_size)
        self.initial = layout.vector.detach().clone()    # w^0: every v_k starts here

    def personal_vector(self, client: int) -> torch.Tensor:
        """v_k (w^0 before client k's first participation)."""
        if client not in self.v:
            self.v[client] = self.initial.to(self.device).clone()
        return self.v[client]

    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        hp = self.hparams()
        lr = hp.personal_lr or self.local_sgd(task).lr
        v, anchor, P = self.personal_vector(task.client), state[:self.num_params], self.num_params

        def loss(flat: FlatModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = F.cross_entropy(flat.model(x), y)     # the global model's step (FedAvg)
            _, g = loss_and_grad(flat, v, x, y)
            with torch.no_grad():
                g.add_(v[:P] - anchor, alpha=hp.lam)
                v[:P].add_(g, alpha=-lr)
            return out

        return StepHooks(loss_fn=loss)

    def client_models(self) -> ClientModels:
        """v_k is client k's personal model (its evaluation scores v_k, not θ)."""
        return ClientModels(None, lambda client, state, flat: flat.load(self.personal_vector(client)))
