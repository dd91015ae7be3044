r"""Each client's held-out evaluation samples (``eval.where: clients | both``).

A client that evaluates the global model on its own data needs samples it does
not train on: a file per silo (``data.silos.client_test``, read by the hosting
rank) or a share ``f = eval.client_holdout`` of its samples. The share is drawn
per client from the RNG stream (seed, client), as positions in the client's
sample order, so the pooled run and the silo-local run of the same split hold
out the same samples, whatever the world size:

.. math::

    m_k = \operatorname{clip}(\lfloor f\,n_k + 1/2 \rfloor,\ 1,\ n_k - 1)
    \quad (n_k \ge 2;\ m_k = 0 \text{ otherwise})

held out of :math:`n_k` samples; the client trains on the other
:math:`n_k - m_k` (its weight :math:`n_k` in the server average counts those).
"""
from __future__ import annotations

import numpy as np

from fedmpi.data.partition import Partition
from fedmpi.config.core import Config

__all__ = ["holdout_positions", "split_partition", "holdout_seed"]


def holdout_seed(cfg: Config) -> int:
    """The split's seed: ``data.partition.seed``, or the top-level ``seed`` when null."""
    p = cfg.data.partition
    return int(cfg.seed if p.seed is None else p.seed)


def holdout_positions(n: int, fraction: float, seed: int, client: int) -> np.ndarray:
    """Sorted positions (in ``[0, n)``) of client ``client``'s held-out samples."""
    if n < 2:
        return np.zeros(0, dtype=np.int64)
    m = min(max(int(np.floor(fraction * n + 0.5)), 1), n - 1)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xE7A1, client]))
    return np.sort(rng.permutation(n)[:m]).astype(np.int64)


def split_partition(partition: Partition, labels: np.ndarray, fraction: float, seed: int,
                    num_classes: int) -> Partition:
    """``partition`` with :func:`holdout_positions` of every client moved from its
    training indices to ``client_test_indices``; class counts of the training part."""
    train, test = [], []
    for k, ix in enumerate(partition.client_indices):
        pos = holdout_positions(len(ix), fraction, seed, k)
        test.append(ix[pos])
        train.append(np.delete(ix, pos))
    counts = np.stack([np.bincount(labels[ix], minlength=num_classes) for ix in train]) \
        if train else partition.class_counts
    return Partition(train, partition.validation_indices, counts.astype(np.int64), test)
