"""Simulated malicious or broken clients (``adversary.*``) for robustness studies.

Kinds, applied to the clients listed in ``adversary.clients``:

``nan``        the uploaded update is NaN (a crashed or numerically broken silo)
``scale``      Δ_k ← factor · Δ_k (model-replacement / boosting attack)
``sign_flip``  Δ_k ← −factor · Δ_k
``label_flip`` local training uses labels C − 1 − y (data poisoning)
``crash``      local training raises (exercises the job-failure path)
"""
from __future__ import annotations

import torch


class Adversary:
    def __init__(self, clients: list[int], kind: str, factor: float) -> None:
        self.clients = frozenset(int(c) for c in clients)
        self.kind = kind
        self.factor = float(factor)

    def check_crash(self, client: int, round: int) -> None:
        if self.kind == "crash" and client in self.clients:
            raise RuntimeError(f"simulated crash of client {client} in round {round} (adversary.kind=crash)")

    def flips_labels(self, client: int) -> bool:
        return self.kind == "label_flip" and client in self.clients

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
