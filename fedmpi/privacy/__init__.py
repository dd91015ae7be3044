"""Privacy a consortium can sign off (issue 25; docs/privacy.md).

* :mod:`~fedmpi.privacy.dp` — client-level DP (DP-FedAvg): clipping on the client,
  Gaussian noise on the sum (central or distributed), fixed-denominator mean;
* :mod:`~fedmpi.privacy.dpsgd` — record-level DP (DP-SGD) inside each silo:
  per-sample clipping via ``torch.func``, Poisson batches, noise per batch;
* :mod:`~fedmpi.privacy.accountant` — ε at δ from Google's ``dp-accounting``
  (the ``.[privacy]`` extra), checkpointed with the run;
* :mod:`~fedmpi.privacy.policy` — which methods and models each level accepts;
* :mod:`~fedmpi.privacy.secagg` — secure aggregation (pairwise masks, fixed point).

Submodules are imported where used. None imports :mod:`fedmpi.algorithms`: the
client clip transform built on :mod:`~fedmpi.privacy.dp` is
:class:`fedmpi.transforms.dp_clip.ClientClip`.
"""
