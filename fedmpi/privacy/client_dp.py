r"""Client-level differential privacy, DP-FedAvg (McMahan, Ramage, Talwar, Zhang 2018), as
one stage: the clip on the client, the noise and fixed denominator on rank 0, the
accountant and the budget (:class:`~fedmpi.privacy.budget.AccountedStage`).

Per round t with the m sampled clients S_t (fixed size, without replacement):

1. **clip on the client** (:meth:`ClientDP.on_upload`, the last stage to touch the
   upload): Δ̄_k = Δ_k · min(1, C / ‖Δ_k‖₂) over the whole uploaded state (parameters
   and float buffers; Alg. 1 ``ClipFn``); under ``privacy.dp.noise: distributed`` the
   client adds its share N(0, σ²C²/m);
2. **noise on the sum**, std σC per coordinate, added either by rank 0
   (``central``, :meth:`ClientDP.on_aggregate`) or in m equal shares by the participants
   themselves (``distributed``), so the sum carries N(0, σ²C²) and no single party adds it;
3. **fixed-denominator mean** (the paper's estimator f̃_f with uniform weights w_k = 1 and
   qW = m): Δ̃ = (Σ_{k accepted} Δ̄_k + z) / m. ``aggregation.weighting`` must be
   ``uniform`` (config check); the denominator is m even when a participant is excluded,
   so it never depends on anyone's data.

A participant whose upload is excluded (non-finite) takes its noise share with it. Rank 0
then adds the missing shares, N(0, σ²C²·e/m) for e excluded participants, so the released
aggregate still carries std σC and the accountant's σ holds for everyone who sees the
models; that top-up is known to rank 0 itself, so against rank 0 the noise it did not add
has std σC·√((m−e)/m) in such a round (logged as an event; docs/privacy.md).

Noise is drawn from streams keyed by (seed, round) on rank 0 and (seed, client, round) on
a client, so it does not depend on the rank layout and a resumed run draws the same noise.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from fedmpi.component import ClientTask, RoundInfo
from fedmpi.errors import ConfigError
from fedmpi.privacy.budget import AccountedStage
from fedmpi.privacy.dp import CENTRAL_TAG, SHARE_TAG, clip_, gaussian_, noise_generator
from fedmpi.transforms.base import RunParts

if TYPE_CHECKING:
    from fedmpi.config.core import Config


class ClientDP(AccountedStage):
    """``privacy.dp.level: client`` (module docstring)."""

    name = "client_dp"
    level = "client"

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        d = cfg.privacy.dp
        self.seed = int(cfg.seed)
        self.distributed = d.noise == "distributed"
        self.m = cfg.train.clients_per_round or cfg.data.num_clients

    @classmethod
    def check(cls, cfg: Config) -> None:
        """DP-FedAvg's fixed-denominator mean of clipped updates needs uniform weights and
        the plain mean rule; ``pld`` has no fixed-size (without replacement) sampling."""
        agg = cfg.aggregation
        if agg.weighting != "uniform":
            raise ConfigError(f"config key 'aggregation.weighting' must be 'uniform' with "
                              f"privacy.dp.level 'client' (DP-FedAvg's fixed-denominator mean), "
                              f"got {agg.weighting!r}")
        if agg.rule != "mean":
            raise ConfigError(f"config key 'aggregation.rule' must be 'mean' with "
                              f"privacy.dp.level 'client' (the noise is calibrated to the mean "
                              f"of clipped updates), got {agg.rule!r}")
        n = cfg.data.num_clients
        m = cfg.train.clients_per_round or n
        if cfg.privacy.dp.accountant == "pld" and m < n:
            raise ConfigError("config key 'privacy.dp.accountant': 'pld' has no fixed-size "
                              "(without replacement) sampling; use 'rdp' with "
                              f"train.clients_per_round {m} < data.num_clients {n}")

    def validate(self, parts: RunParts) -> None:
        """Only the weighted ``delta`` upload is clipped and noised: a method or transform
        uploading anything else would send it to rank 0 unprotected."""
        own = {s.name for s in parts.algorithm.exchange().uplink}
        for s in parts.stats:
            if s.name == "delta" and s.combine == "weighted":
                continue
            source = (f"algorithm.name {parts.cfg.algorithm.name!r}" if s.name in own
                      else "an update transform (ecgr.enabled / transforms)")
            raise ConfigError(f"config key 'privacy.dp.level': client-level DP clips and noises "
                              f"only the weighted 'delta' upload, but {source} also uploads "
                              f"{s.name!r} ({s.combine})")

    # ------------------------------------------------------------- client half
    @property
    def share_std(self) -> float:
        """Std of one participant's share: σC/√m, so m shares sum to std σC."""
        return self.sigma * self.clip / math.sqrt(self.m)

    def on_upload(self, task: ClientTask, out: dict[str, torch.Tensor]) -> None:
        delta = out["delta"]
        clip_(delta, self.clip)
        if self.distributed:
            gen = noise_generator(delta.device, self.seed, SHARE_TAG, task.client, task.round)
            gaussian_(delta, self.share_std, gen)

    # ------------------------------------------------------------- server half
    def noise_std(self, selected: int, accepted: int) -> float:
        """Std rank 0 adds to the sum: σC (central), or σC·√(e/m) for e = m − accepted
        excluded shares (distributed)."""
        if not self.distributed:
            return self.sigma * self.clip
        return self.sigma * self.clip * math.sqrt(max(0, selected - accepted) / max(1, selected))

    def on_aggregate(self, agg: dict[str, torch.Tensor], info: RoundInfo) -> None:
        """``agg["delta"]`` = (1/accepted) Σ Δ̄_k in place → (Σ Δ̄_k + z)/m."""
        mean, selected, accepted = agg["delta"], info.num_selected, len(info.clients)
        mean.mul_(accepted / selected)
        std = self.noise_std(selected, accepted)
        gen = noise_generator(mean.device, self.seed, CENTRAL_TAG, info.round)
        gaussian_(mean, std / selected, gen)
        if self.distributed and accepted < selected and std > 0:
            self.report.event(f"distributed DP noise: {selected - accepted} participant "
                              f"share(s) excluded; rank 0 added N(0, (sigma*C)^2*"
                              f"{selected - accepted}/{selected}) so the model carries std "
                              "sigma*C", echo=True)
