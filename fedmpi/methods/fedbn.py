"""FedBN (Li et al., ICLR 2021): normalisation layers stay local.

Every client keeps the affine parameters (γ, β) and the running statistics (μ, σ²) of
each normalisation layer (BatchNorm, GroupNorm, LayerNorm) to itself; everything else is
averaged as in FedAvg. Algorithm 1 of the paper: for each layer l,

    w_l ← Σ_k s_k w_{k,l}    if l is not a BN layer,    w_{k,l} kept by client k otherwise

(the paper's aggregation is the same weighted average as FedAvg, Eq. 1 of McMahan et al.,
restricted to the non-BN layers). Here the norm layers are personal parameters
(:mod:`fedmpi.methods.personal`): they are not in the exchanged vector at all, so the
server's rule is FedAvg's on the rest. A model without normalisation layers is refused
(FedBN would be FedAvg). The global model that rank 0 evaluates carries the initial norm
layers; the per-site evaluation (``eval.where: clients``) scores each site with its own
(docs/personalisation.md).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from fedmpi.config.core import Config
from fedmpi.errors import ConfigError
from fedmpi.methods.base import Algorithm, MethodSpec
from fedmpi.methods.personal import norm_layer_names


class FedBN(Algorithm):
    name = "fedbn"
    spec = replace(MethodSpec(), personal=True, record_dp=False)

    @classmethod
    def personal_names(cls, cfg: Config, model: torch.nn.Module) -> set[str]:
        names = norm_layer_names(model)
        if not names:
            raise ConfigError("config keys 'algorithm.name' and 'model.norm': fedbn keeps the "
                              "normalisation layers local, and this model has none (use a "
                              "model with BatchNorm/GroupNorm/LayerNorm, e.g. model.norm: bn)")
        return names | super().personal_names(cfg, model)
