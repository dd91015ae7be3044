"""FedPer and FedRep: a shared body and a personal head.

**FedPer** (Arivazhagan et al. 2019, "Federated learning with personalization layers",
§3, Algorithm 1–2): the model is split into base layers W_B (shared) and personalisation
layers W_P^k (the last ``algorithm.fedper.head_layers`` layers that hold parameters). Each
client runs its local SGD on (W_B, W_P^k) jointly; the server averages the base layers only,

    W_B ← Σ_k s_k W_{B,k},      W_P^k never leaves client k.

**FedRep** (Collins et al., ICML 2021, Algorithm 1): the same split into a representation
φ (body) and a head h_k, but the local update alternates — first τ_h steps on the head with
the body fixed (Eq. 3: h_k ← GRD(f_k(h, φ^t), h, η), ``algorithm.fedrep.head_epochs``
epochs), then τ steps on the body with the new head fixed (Eq. 4: φ_k ← GRD(f_k(h_k, φ),
φ, η), ``train.local_epochs`` or ``train.local_steps``); the server averages the bodies
(Eq. 5, φ^{t+1} = Σ_k s_k φ_k; the paper's 1/m is ``aggregation.weighting: uniform``).

Both keep the head as personal parameters (:mod:`fedmpi.methods.personal`): it is not in
the exchanged vector, so every message and aggregate holds the body only. FedRep's phases
are one pass of the shared local loop whose gradient hook zeroes the body's gradient
during the first τ_h steps and the head's afterwards; so that a zeroed gradient means a
parameter that does not move, FedRep takes plain SGD without momentum or weight decay
(the paper's optimizer; refused otherwise). Deviations: the head steps use the round's
learning rate (the paper's code uses the same lr for both phases).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fedmpi.component import ClientTask
from fedmpi.config.core import Config
from fedmpi.config.params import param
from fedmpi.errors import ConfigError
from fedmpi.methods.base import Algorithm, MethodSpec
from fedmpi.methods.personal import head_names
from fedmpi.training.flat import FlatModel
from fedmpi.training.loop import SGDConfig, StepHooks, epoch_bounds, num_local_steps


@dataclass(frozen=True)
class FedPerParams:
    head_layers: int = param(1, "FedPer: the last N layers holding parameters are the "
                             "personal head (Arivazhagan et al. 2019: 1 or 2)", ge=1)


@dataclass(frozen=True)
class FedRepParams:
    head_layers: int = param(1, "FedRep: the last N layers holding parameters are the "
                             "personal head", ge=1)
    head_epochs: int = param(10, "FedRep: epochs on the head (body fixed) before the body "
                             "epochs (Collins et al. 2021, Alg. 1; their code: 10)", ge=1)


class FedPer(Algorithm):
    name = "fedper"
    spec = replace(MethodSpec(), personal=True, record_dp=False)
    params = {"fedper": FedPerParams}

    @classmethod
    def personal_names(cls, cfg: Config, model: torch.nn.Module) -> set[str]:
        block = next(iter(cls.params))
        layers = int(cfg.get(f"algorithm.{block}.head_layers"))
        return head_names(model, layers) | super().personal_names(cfg, model)


class FedRep(FedPer):
    name = "fedrep"
    spec = replace(FedPer.spec, optimizers=("sgd",), fresh_optimizer=True)
    params = {"fedrep": FedRepParams}

    @classmethod
    def check(cls, cfg: Config) -> None:
        t = cfg.train
        for key, value in (("train.momentum", t.momentum), ("train.weight_decay", t.weight_decay)):
            if value:
                raise ConfigError(f"config keys {key!r} and 'algorithm.name': fedrep fixes the "
                                  "body during the head steps and the head during the body "
                                  f"steps, which {key.split('.')[1]} would still move; set it to 0")

    def head_steps(self, task: ClientTask) -> int:
        """τ_h: ``head_epochs`` epochs over the client's samples."""
        n = task.indices.numel()
        return self.hparams().head_epochs * (len(epoch_bounds(n, self.sgd.batch_size)) - 1)

    def local_sgd(self, task: ClientTask) -> SGDConfig:
        """τ_h head steps, then τ body steps (``train.local_epochs`` / ``local_steps``)."""
        sgd = super().local_sgd(task)
        body = num_local_steps(task.indices.numel(), sgd)
        return replace(sgd, local_steps=self.head_steps(task) + body)

    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        head = self.head_steps(task)
        step = [0]

        def alternate(flat: FlatModel) -> None:
            (flat.grad if step[0] < head else flat.personal_grad).zero_()
            step[0] += 1

        return StepHooks(grad_hook=alternate)
