r"""The client splits of a partition: ``iid``, ``dirichlet`` (NIID-bench label skew)
and ``shards`` (pathological label skew), each dealing a pool of sample indices out to
:math:`K` clients with a given random stream.

The hold-out, the seeding, the argument checks and the ``file`` method are
:func:`fedmpi.data.partition.make_partition`'s; these functions only split.
"""
from __future__ import annotations

import numpy as np

from fedmpi.errors import DataError

__all__ = ["DIRICHLET_MAX_TRIES", "shard_classes", "split_dirichlet", "split_iid", "split_shards"]

#: Draws of the Dirichlet split before giving up on ``min_size``.
DIRICHLET_MAX_TRIES = 1000


def split_iid(pool: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and cut into K parts whose sizes differ by at most one."""
    return list(np.array_split(rng.permutation(pool), num_clients))


def split_dirichlet(
    labels: np.ndarray,
    pool: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    min_size: int,
    min_size_reason: str,
) -> list[np.ndarray]:
    r"""Label-skewed split with Dirichlet class proportions (NIID-bench rule).

    For each class :math:`c` (with :math:`n_c` samples) draw
    :math:`p \sim \mathrm{Dir}(\alpha \mathbf{1}_K)`, set :math:`p_k = 0`
    for every client already holding :math:`\ge N/K` samples, renormalise,
    and give client :math:`k` the samples between
    :math:`\lfloor n_c \sum_{j<k} p_j \rfloor` and
    :math:`\lfloor n_c \sum_{j\le k} p_j \rfloor` of a random permutation of
    the class. The whole draw is repeated until every client holds at least
    ``min_size`` samples (at most :data:`DIRICHLET_MAX_TRIES` times).

    Only the per-class counts depend on the retries, so they are drawn first
    and the samples are shuffled and dealt out once, for the accepted draw.
    """
    n = len(pool)
    k_clients = num_clients
    y = labels[pool]
    order = np.argsort(y, kind="stable")
    by_class = [g for g in np.split(pool[order], np.flatnonzero(np.diff(y[order])) + 1) if len(g)]
    if k_clients * min_size > n:
        raise DataError(
            f"data.partition.method=dirichlet: {k_clients} clients x {min_size} samples "
            f"({min_size_reason}) exceed the {n} samples available after the server "
            f"hold-out; lower data.partition.min_size or data.num_clients"
        )
    cap = n / k_clients
    concentration = np.full(k_clients, float(alpha))
    best = -1
    for _ in range(DIRICHLET_MAX_TRIES):
        sizes = np.zeros(k_clients, dtype=np.int64)
        counts = np.zeros((len(by_class), k_clients), dtype=np.int64)
        for c, members in enumerate(by_class):
            p = rng.dirichlet(concentration)
            p = np.where(sizes < cap, p, 0.0)
            total = p.sum()
            if not total > 0.0:  # all open clients drew an underflowed 0: share equally
                p = (sizes < cap).astype(np.float64)
                total = p.sum()
            cuts = np.minimum(np.floor(np.cumsum(p / total)[:-1] * len(members)), len(members))
            bounds = np.concatenate(([0], cuts.astype(np.int64), [len(members)]))
            counts[c] = np.diff(bounds)
            sizes += counts[c]
        best = max(best, int(sizes.min()))
        if sizes.min() >= min_size:
            break
    else:
        raise DataError(
            f"data.partition.method=dirichlet: no split in {DIRICHLET_MAX_TRIES} draws gave "
            f"every one of the {k_clients} clients >= {min_size} samples ({min_size_reason}); "
            f"the smallest client reached {best}. Lower data.partition.min_size, raise "
            f"data.partition.alpha (now {alpha}) or use fewer data.num_clients"
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(k_clients)]
    for members, row in zip(by_class, counts):
        pieces = np.split(rng.permutation(members), np.cumsum(row)[:-1])
        for k, piece in enumerate(pieces):
            parts[k].append(piece)
    return [np.concatenate(p) for p in parts]


def shard_classes(
    classes: np.ndarray, num_clients: int, per_client: int, rng: np.random.Generator
) -> np.ndarray:
    r"""``[K, s]`` class assignment: each row has ``s`` distinct classes, classes balanced.

    Slots ``0 .. K s - 1`` are filled by concatenated random permutations of
    the classes and client :math:`k` takes slots :math:`ks .. ks+s-1`, so
    every class is used :math:`\lfloor Ks/C \rfloor` or
    :math:`\lceil Ks/C \rceil` times. A client whose slots straddle two
    permutations could see a class twice; to prevent it, the first entries
    of each new permutation are drawn from the classes not already in the
    straddling client's slots (possible because :math:`s \le C`).
    """
    total = num_clients * per_client
    seq: list[int] = []
    while len(seq) < total:
        filled = len(seq) % per_client
        tail = seq[len(seq) - filled:] if filled else []
        allowed = np.setdiff1d(classes, tail)
        head = rng.choice(allowed, size=per_client - filled, replace=False) if filled else allowed[:0]
        rest = rng.permutation(np.setdiff1d(classes, head))
        seq.extend(np.concatenate((head, rest)).tolist())
    return np.asarray(seq[:total], dtype=np.int64).reshape(num_clients, per_client)


def split_shards(
    labels: np.ndarray,
    pool: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    classes_per_client: int,
    num_classes: int,
) -> list[np.ndarray]:
    """Pathological label skew: every client holds exactly ``classes_per_client`` classes.

    Classes are assigned by :func:`shard_classes`; the samples of each class
    are shuffled and split as evenly as possible among the clients holding
    it. When ``K * classes_per_client < C`` some classes go to no client and
    their samples are left out of the partition.
    """
    y = labels[pool]
    present = np.unique(y)
    if classes_per_client > len(present):
        raise DataError(
            f"data.partition.classes_per_client={classes_per_client} exceeds the "
            f"{len(present)} classes present in the pool (num_classes={num_classes}); "
            f"use at most {len(present)}"
        )
    assignment = shard_classes(present, num_clients, classes_per_client, rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in present:
        holders = np.flatnonzero((assignment == c).any(axis=1))
        if holders.size == 0:
            continue
        members = rng.permutation(pool[y == c])
        if len(members) < len(holders):
            raise DataError(
                f"data.partition.method=shards: class {int(c)} has {len(members)} samples "
                f"but {len(holders)} clients hold it; use fewer data.num_clients or "
                f"data.partition.classes_per_client"
            )
        for k, piece in zip(holders, np.array_split(members, len(holders))):
            parts[k].append(piece)
    return [np.concatenate(p) for p in parts]
