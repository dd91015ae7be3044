"""Simulated malicious or broken clients (``adversary.*``), an update transform.

Kinds, applied to the clients listed in ``adversary.clients``:

``nan``        the uploaded update is NaN (a crashed or numerically broken silo)
``scale``      Δ_k ← factor · Δ_k (model-replacement / boosting attack)
``sign_flip``  Δ_k ← −factor · Δ_k
``label_flip`` local training uses labels C − 1 − y (data poisoning)
``crash``      local training raises (exercises the job-failure path)

As a transform (:mod:`fedmpi.algorithms.transforms`) it acts before training
(crash, label flip) and on the final upload (after ECGR), so an attack corrupts
exactly what the client would send.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import ConfigError
from ..params import param
from .transforms import UpdateTransform


@dataclass(frozen=True)
class AdversaryParams:
    """``adversary.*`` (:mod:`fedmpi.params`)."""

    clients: list[int] = param([], "ids of misbehaving clients")
    kind: str = param("nan", "attack type (crash: local training raises, to exercise the "
                             "failure path)",
                      choices=("nan", "scale", "sign_flip", "label_flip", "crash"))
    factor: float = param(10.0, "attack strength (scale factor)")


class Adversary(UpdateTransform):
    name = "adversary"
    params = {"adversary": AdversaryParams}
    enable_key = "adversary.clients"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        p = self.hparams("adversary")
        self.clients = frozenset(int(c) for c in p.clients)
        self.kind = p.kind
        self.factor = float(p.factor)

    @classmethod
    def enabled(cls, cfg) -> bool:
        return bool(cfg.adversary.clients)

    @classmethod
    def check(cls, cfg) -> None:
        """Listed clients exist and are listed once."""
        n, clients = cfg.data.num_clients, cfg.adversary.clients
        for c in clients:
            if not 0 <= c < n:
                raise ConfigError(f"config key 'adversary.clients' has client id {c} outside "
                                  f"[0, {n}) (data.num_clients = {n})")
        if len(set(clients)) != len(clients):
            raise ConfigError(f"config key 'adversary.clients' lists a client twice: {clients}")

    def before_training(self, task):
        if task.client not in self.clients:
            return task
        if self.kind == "crash":
            raise RuntimeError(f"simulated crash of client {task.client} in round {task.round} "
                               "(adversary.kind=crash)")
        if self.kind == "label_flip":
            return replace(task, flip_labels=True)
        return task

    def on_upload(self, task, out: dict[str, torch.Tensor]) -> None:
        self.corrupt(task.client, out["delta"])

    def corrupt(self, client: int, delta: torch.Tensor) -> None:
        """Rewrite the uploaded update Δ_k in place."""
        if client not in self.clients:
            return
        if self.kind == "nan":
            delta.fill_(float("nan"))
        elif self.kind == "scale":
            delta.mul_(self.factor)
        elif self.kind == "sign_flip":
            delta.mul_(-self.factor)
