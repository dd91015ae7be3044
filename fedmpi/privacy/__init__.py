"""Privacy a consortium can sign off (docs/privacy.md), as stages of the update-transform
seam (:mod:`fedmpi.transforms.base`): nothing outside this package imports it except the
config assembly, which registers the stages.

* :mod:`~fedmpi.privacy.client_dp` — client-level DP (DP-FedAvg): the clip on the client,
  Gaussian noise on the sum (central or distributed), the fixed-denominator mean;
* :mod:`~fedmpi.privacy.record_dp` — record-level DP (DP-SGD) inside each silo: Poisson
  batches and per-sample clipping (:mod:`~fedmpi.privacy.dpsgd`) in the local loop;
* :mod:`~fedmpi.privacy.budget` — the server half both share: ε at δ from Google's
  ``dp-accounting`` (:mod:`~fedmpi.privacy.accountant`, the ``.[privacy]`` extra),
  ``privacy.target_epsilon``, checkpointed with the run;
* :mod:`~fedmpi.privacy.secagg` — secure aggregation (pairwise masks, fixed point): the
  uplink codec and the ``sums_only`` declaration;
* :mod:`~fedmpi.privacy.dp` — the clipping and noise math they share.

Importing the package registers the stages, after the other transforms (the DP clip is
the last stage to touch the upload).
"""
from __future__ import annotations

from fedmpi.privacy import client_dp, record_dp, secagg
from fedmpi.transforms.base import register_transform

for _stage in (client_dp.ClientDP, record_dp.RecordDP, secagg.SecureAggregation):
    register_transform(_stage)
