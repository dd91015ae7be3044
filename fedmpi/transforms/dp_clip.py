"""Client-level DP's client side: the DP-FedAvg clip (and distributed noise share) as
the last built-in update transform (McMahan et al. 2018, Alg. 1 ``ClipFn``).

The math and rank 0's side live in :mod:`fedmpi.privacy.dp` (module docstring there).
"""
from __future__ import annotations

import math

import torch

from fedmpi.errors import ConfigError
from fedmpi.privacy.dp import SHARE_TAG, clip_, gaussian_, noise_generator
from fedmpi.component import ClientTask
from fedmpi.transforms.base import UpdateTransform


class ClientClip(UpdateTransform):
    """Clip the upload to norm C; under ``distributed`` noise add this client's share."""

    name = "dp"
    enable_key = "privacy.dp.level"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        d = cfg.privacy.dp
        self.clip, self.sigma, self.seed = float(d.clip), float(d.noise_multiplier), int(cfg.seed)
        self.distributed = d.noise == "distributed"
        self.m = cfg.train.clients_per_round or cfg.data.num_clients

    @classmethod
    def enabled(cls, cfg) -> bool:
        """On for ``privacy.dp.level: client``."""
        return bool(cfg.privacy.dp.level == "client")

    @classmethod
    def check(cls, cfg) -> None:
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
