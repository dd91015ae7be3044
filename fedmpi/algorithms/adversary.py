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

from dataclasses import replace

import torch

from .transforms import UpdateTransform


class Adversary(UpdateTransform):
    name = "adversary"

    def __init__(self, clients: list[int], kind: str, factor: float) -> None:
        self.clients = frozenset(int(c) for c in clients)
        self.kind = kind
        self.factor = float(factor)

    @classmethod
    def from_config(cls, cfg) -> Adversary:
        return cls(cfg.adversary.clients, cfg.adversary.kind, cfg.adversary.factor)

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
