"""Which methods, uploads and models each DP level accepts (checked when a rank is built).

* ``client``: only the weighted ``delta`` upload is clipped and noised, so a method or
  transform uploading anything else (SCAFFOLD's c, FedDyn's dh, FedNova's a_k, FedGPS's
  prototypes, Elastic's sensitivities, submodel sums, ECGR's selection) is refused: that
  statistic would reach rank 0 without protection.
* ``record``: DP-SGD replaces the local gradient, so the method's local step must be plain
  SGD on the cross-entropy with nothing else computed from local data
  (:attr:`Algorithm.record_dp`); and every sample's forward pass must be independent
  of the batch, which BatchNorm's is not (:func:`~fedmpi.privacy.dpsgd.check_model`).

Bad pairs exit 2 with one line naming both keys (docs/privacy.md lists the methods).
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from fedmpi.errors import ConfigError
from fedmpi.privacy.dpsgd import check_model


def check_build(cfg, algo, stats: Sequence, model: nn.Module) -> None:
    """Refuse a run whose method, uploads or model the configured DP level cannot protect."""
    level = cfg.privacy.dp.level
    name = cfg.algorithm.name
    if level == "client":
        own = {s.name for s in algo.uplink_stats()}
        for s in stats:
            if s.name == "delta" and s.combine == "weighted":
                continue
            source = (f"algorithm.name {name!r}" if s.name in own
                      else "an update transform (ecgr.enabled / transforms)")
            raise ConfigError(f"config key 'privacy.dp.level': client-level DP clips and noises "
                              f"only the weighted 'delta' upload, but {source} also uploads "
                              f"{s.name!r} ({s.combine})")
    elif level == "record":
        if not getattr(algo, "record_dp", False):
            raise ConfigError(f"config key 'privacy.dp.level': 'record' (DP-SGD) needs a method "
                              f"whose local step is plain SGD; algorithm.name {name!r} is not one "
                              "(see docs/privacy.md)")
        check_model(model)
