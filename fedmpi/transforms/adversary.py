r"""Simulated malicious or broken clients (``adversary.*``), an update transform.

Kinds, applied to the clients listed in ``adversary.clients``:

``nan``        the uploaded update is NaN (a crashed or numerically broken silo)
``scale``      Δ_k ← factor · Δ_k (model-replacement / boosting attack)
``sign_flip``  Δ_k ← −factor · Δ_k
``label_flip`` local training uses labels C − 1 − y (data poisoning)
``crash``      local training raises (exercises the job-failure path)
``gaussian``   Δ_k ← ε with ε ~ N(0, σ² I), σ = ‖Δ_k‖/√d: noise of the client's own benign
               norm (E‖ε‖ ≈ ‖Δ_k‖), the Gaussian Byzantine attack of Blanchard et al. 2017
               (NeurIPS, §5) and Xie et al. 2018 ("Generalized Byzantine-tolerant SGD")
               scaled so that a norm test cannot tell it from an honest update; drawn from
               the client's (seed, client, round) stream
``alie``       "A little is enough" (Baruch et al. 2019, NeurIPS, Algorithm 3): every
               attacker uploads μ − z·σ, μ and σ the coordinate-wise mean and standard
               deviation (ddof 0) of the round's benign accepted updates, z =
               ``adversary.alie_z`` or, when null, the paper's
               z_max = Φ⁻¹((n − s)/n) with s = ⌊n/2 + 1⌋ − f (n participants, f attackers
               among them): the largest shift a majority of benign coordinates still exceeds

As a transform (:mod:`fedmpi.transforms.base`) it acts before training
(crash, label flip) and on the final upload (after ECGR), so an attack corrupts
exactly what the client would send.

``alie`` is *omniscient*: the attackers need this round's benign updates. A
real colluding attacker would gather them (or estimate them from its own
silos); the simulation takes a shortcut and writes the attackers' rows on rank
0 after the uplink, from the benign rows it holds, before any weighting or
rule sees them: the transform's server half (:meth:`Adversary.on_rows`). Every
weighted statistic then travels as per-client rows (:attr:`Adversary.needs_rows`),
whatever the rule; only ``delta`` is attacked, the attackers' other statistics stay
honest.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from fedmpi.errors import ConfigError
from fedmpi.config.params import load_group, param
from fedmpi.component import RoundInfo
from fedmpi.transforms.base import UpdateTransform

if TYPE_CHECKING:
    from fedmpi.config.core import Config

__all__ = ["Adversary", "alie_z"]


def alie_z(n: int, f: int) -> float:
    """Baruch et al. 2019, Algorithm 3: z_max = Φ⁻¹((n − s)/n), s = ⌊n/2 + 1⌋ − f."""
    s = n // 2 + 1 - f
    p = (n - s) / n
    return NormalDist().inv_cdf(p) if 0 < p < 1 else 0.0


@dataclass(frozen=True)
class AdversaryParams:
    """``adversary.*`` (:mod:`fedmpi.config.params`)."""

    clients: list[int] = param([], "ids of misbehaving clients")
    kind: str = param("nan", "attack type (crash: local training raises, to exercise the "
                             "failure path; gaussian and alie: docs/robust-aggregation.md)",
                      choices=("nan", "scale", "sign_flip", "label_flip", "crash", "gaussian",
                               "alie"))
    factor: float = param(10.0, "attack strength (scale factor)")
    alie_z: float | None = param(None, "alie: the shift z of mu - z*sigma (null: the paper's "
                                       "z_max from the participants and attackers)")


class Adversary(UpdateTransform):
    name = "adversary"
    params = {"adversary": AdversaryParams}
    enable_key = "adversary.clients"

    def __init__(self, clients: list[int], kind: str, factor: float,
                 z: Optional[float] = None) -> None:
        self.clients = frozenset(int(c) for c in clients)
        self.kind = kind
        self.factor = float(factor)
        self.z = z

    @classmethod
    def build(cls, cfg: Config) -> Adversary:
        """From the block ``adversary.*``."""
        p = load_group(cfg, "adversary", AdversaryParams)
        adversary = cls(p.clients, p.kind, p.factor, p.alie_z)
        adversary.cfg = cfg
        return adversary

    @classmethod
    def enabled(cls, cfg: Config) -> bool:
        return bool(cfg.get("adversary.clients"))

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Listed clients exist and are listed once."""
        n, clients = cfg.data.num_clients, cfg.get("adversary.clients")
        for c in clients:
            if not 0 <= c < n:
                raise ConfigError(f"config key 'adversary.clients' has client id {c} outside "
                                  f"[0, {n}) (data.num_clients = {n})")
        if len(set(clients)) != len(clients):
            raise ConfigError(f"config key 'adversary.clients' lists a client twice: {clients}")

    @classmethod
    def per_client_reason(cls, cfg: Config) -> Optional[tuple[str, str]]:
        if cfg.get("adversary.clients") and cfg.get("adversary.kind") == "alie":
            return "adversary.kind", "the simulated alie attack rewrites the attackers' rows on rank 0"
        return None

    @property
    def needs_rows(self) -> bool:
        """``alie`` rewrites the attackers' rows on rank 0 (module docstring)."""
        return self.kind == "alie"

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
        self.corrupt(task.client, out["delta"], task.seed)

    def corrupt(self, client: int, delta: torch.Tensor, seed: int = 0) -> None:
        """Rewrite the uploaded update Δ_k in place (client-side kinds)."""
        if client not in self.clients:
            return
        if self.kind == "nan":
            delta.fill_(float("nan"))
        elif self.kind == "scale":
            delta.mul_(self.factor)
        elif self.kind == "sign_flip":
            delta.mul_(-self.factor)
        elif self.kind == "gaussian":
            sigma = float(torch.linalg.vector_norm(delta)) / max(1, delta.numel()) ** 0.5
            gen = torch.Generator(device=delta.device).manual_seed(seed)
            delta.normal_(0.0, sigma, generator=gen)

    def on_rows(self, state: torch.Tensor, rows: dict[str, torch.Tensor],
                info: RoundInfo) -> list[int]:
        """Rank 0, ``alie`` only (simulation shortcut, see module docstring): overwrite the
        attackers' rows of ``delta`` (``[n, d]``, row i of client ``info.clients[i]``) in
        place with μ − z·σ of the other rows. Returns the clients rewritten."""
        if self.kind != "alie":
            return []
        clients, delta, num_participants = info.clients, rows["delta"], info.num_selected
        bad = np.array([int(k) in self.clients for k in clients])
        if not bad.any() or bad.all():
            return []
        benign = delta[torch.as_tensor(np.flatnonzero(~bad), device=delta.device)]
        z = self.z if self.z is not None else alie_z(num_participants, int(bad.sum()))
        std, mean = torch.std_mean(benign, dim=0, correction=0)
        attack = mean.sub_(std, alpha=z)
        for i in np.flatnonzero(bad):
            delta[int(i)].copy_(attack)
        return [int(clients[i]) for i in np.flatnonzero(bad)]
