r"""Splitting the training pool into a server hold-out and K client shards.

:func:`make_partition` works in two steps on a pool of :math:`N` labelled
samples with :math:`C` classes:

1. **Server hold-out** (FedVG's validation set): :func:`stratified_holdout`
   removes a fraction :math:`f` of the pool, class by class.
2. **Client split** of the remaining samples into :math:`K` clients by one
   of the methods ``iid``, ``dirichlet``, ``shards`` -- or both steps are
   read from a file (``file``).

Randomness: ``np.random.SeedSequence(seed).spawn(2)`` gives two independent
streams, one for the hold-out and one for the split, so the same ``seed``
(and the same arguments) always yields the identical partition.

The three client splits themselves are :mod:`fedmpi.data.client_splits`; this module
holds what every partition shares (seeding, hold-out, argument checks, minimum sizes,
the ``file`` method) so a partition is defined once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from fedmpi.data.client_splits import split_dirichlet, split_iid, split_shards
from fedmpi.data.partition_file import check_partition, read_partition_file, write_partition_file
from fedmpi.errors import ConfigError, DataError

__all__ = ["PARTITION_METHODS", "Partition", "check_batch_floor", "local_batches",
           "make_partition", "stratified_holdout"]

PARTITION_METHODS: tuple[str, ...] = ("iid", "dirichlet", "shards", "file", "institutions")


@dataclass(eq=False)
class Partition:
    """Which training-pool samples each client and the server hold.

    Attributes
    ----------
    client_indices:
        One sorted ``int64`` array of training-pool indices per client.
    validation_indices:
        Sorted ``int64`` indices of the server hold-out (may be empty).
    class_counts:
        ``[K, C]`` ``int64`` matrix; entry ``(k, c)`` is the number of
        samples of class ``c`` held by client ``k``.
    client_test_indices:
        Per client, the pool indices of its held-out evaluation samples
        (``eval.where: clients | both``, :mod:`fedmpi.data.heldout`); empty
        list when clients do not evaluate.
    """

    client_indices: list[np.ndarray]
    validation_indices: np.ndarray
    class_counts: np.ndarray
    client_test_indices: list[np.ndarray] = field(default_factory=list)

    @property
    def num_clients(self) -> int:
        """Number of clients :math:`K`."""
        return len(self.client_indices)

    @property
    def sizes(self) -> np.ndarray:
        """``int64`` client sample counts :math:`n_k`, shape ``[K]``."""
        return np.array([len(ix) for ix in self.client_indices], dtype=np.int64)

    def save(self, path: str) -> None:
        """Write the partition as a ``.json`` or ``.npz`` file readable by ``method='file'``."""
        write_partition_file(path, self.client_indices, self.validation_indices)


# ------------------------------------------------------------------ hold-out
def _holdout_count(fraction: float, n: int) -> int:
    r"""Samples to hold out of a class with :math:`n` candidates.

    :math:`m = \lfloor f n + 1/2 \rfloor`, clipped to :math:`[1, n-1]` when
    :math:`0 < f < 1` and :math:`n \ge 2` (every class is represented in the
    hold-out and keeps at least one sample outside it); a class with a single
    sample is never held out for :math:`f < 1`; :math:`f \ge 1` takes all.
    """
    if fraction <= 0.0 or n == 0:
        return 0
    if fraction >= 1.0:
        return n
    if n == 1:
        return 0
    return min(max(math.floor(fraction * n + 0.5), 1), n - 1)


def stratified_holdout(
    labels: np.ndarray,
    fraction: float,
    rng_or_seed: np.random.Generator | np.random.SeedSequence | int,
    candidates: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    r"""Draw a class-stratified subset of ``candidates``.

    For every class :math:`c` with :math:`n_c` candidates, :math:`m_c`
    samples are drawn uniformly without replacement, with
    :math:`m_c = \mathrm{round}(f\,n_c)` (half up), but at least 1 and at
    most :math:`n_c - 1` when :math:`0 < f < 1` and :math:`n_c \ge 2`
    (a singleton class stays out of the hold-out).

    Parameters
    ----------
    labels:
        Labels of the whole pool, shape ``[N]``.
    fraction:
        :math:`f \in [0, 1]`.
    rng_or_seed:
        A ``numpy.random.Generator``, or a seed for ``np.random.default_rng``.
    candidates:
        Pool indices to draw from (default: all of ``0 .. N-1``).

    Returns
    -------
    held, rest:
        Sorted ``int64`` indices: the hold-out, and the candidates not in it.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
    if isinstance(rng_or_seed, np.random.Generator):
        rng = rng_or_seed
    else:
        rng = np.random.default_rng(rng_or_seed)
    labels = np.asarray(labels)
    if candidates is None:
        cand = np.arange(len(labels), dtype=np.int64)
    else:
        cand = np.unique(np.asarray(candidates, dtype=np.int64))
    if fraction == 0.0 or cand.size == 0:
        return np.zeros(0, dtype=np.int64), cand
    # Group candidates by class (ascending class, ascending index within a class).
    order = np.argsort(labels[cand], kind="stable")
    grouped = cand[order]
    bounds = np.flatnonzero(np.diff(labels[grouped])) + 1
    held = [
        rng.choice(group, size=_holdout_count(fraction, len(group)), replace=False)
        for group in np.split(grouped, bounds)
    ]
    held_ix = np.sort(np.concatenate(held)).astype(np.int64)
    return held_ix, np.setdiff1d(cand, held_ix, assume_unique=True)


# ---------------------------------------------------------------- interface
def _check_labels(labels: np.ndarray, num_classes: int | None) -> tuple[np.ndarray, int]:
    y = np.asarray(labels)
    if y.ndim != 1 or (y.size and y.dtype.kind not in "iu"):
        raise DataError(
            f"partition labels must be a 1-D integer array, got shape {y.shape} dtype {y.dtype}"
        )
    y = y.astype(np.int64)
    if y.size == 0:
        raise DataError("the training pool is empty; nothing to partition")
    inferred = int(y.max()) + 1
    if num_classes is None:
        num_classes = inferred
    if y.min() < 0 or inferred > num_classes:
        raise DataError(
            f"partition labels must lie in [0, {num_classes}), found range "
            f"[{int(y.min())}, {int(y.max())}]"
        )
    return y, int(num_classes)


def _check_args(
    num_clients: int, method: str, seed: int, alpha: float, classes_per_client: int,
    min_size: int, validation_fraction: float, min_batches: int, batch_size: int,
) -> None:
    if method not in PARTITION_METHODS:
        raise ConfigError(
            f"data.partition.method={method!r} is unknown; expected one of "
            f"{', '.join(PARTITION_METHODS)}"
        )
    checks = [
        (num_clients >= 1, f"data.num_clients must be >= 1, got {num_clients}"),
        (seed >= 0, f"seed must be a non-negative integer, got {seed}"),
        (alpha > 0, f"data.partition.alpha must be > 0, got {alpha}"),
        (classes_per_client >= 1,
         f"data.partition.classes_per_client must be >= 1, got {classes_per_client}"),
        (min_size >= 0, f"data.partition.min_size must be >= 0, got {min_size}"),
        (0.0 <= validation_fraction < 1.0,
         f"data.validation.fraction must lie in [0, 1), got {validation_fraction}"),
        (min_batches >= 0, f"min_batches must be >= 0, got {min_batches}"),
        (batch_size >= 1, f"train.batch_size must be >= 1, got {batch_size}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _file_split(
    labels: np.ndarray,
    num_clients: int,
    file: str | None,
    validation_fraction: float,
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Clients (and optionally the hold-out) from a file; see :mod:`fedmpi.data.partition_file`."""
    if not file:
        raise ConfigError(
            "data.partition.method=file needs data.partition.file (a .json or .npz path)"
        )
    clients, validation = read_partition_file(file)
    n = len(labels)
    check_partition(clients, validation, n, num_clients, file)
    if validation is not None:
        return clients, validation
    # No explicit hold-out: draw round(f N) samples, stratified, from the unlisted indices.
    listed = np.concatenate(clients) if clients else np.zeros(0, dtype=np.int64)
    unlisted = np.setdiff1d(np.arange(n, dtype=np.int64), listed)
    wanted = math.floor(validation_fraction * n + 0.5)
    if wanted == 0:
        return clients, np.zeros(0, dtype=np.int64)
    if len(unlisted) < wanted:
        raise DataError(
            f"data.partition.file={file!r} lists {len(listed)} of the {n} pool samples, leaving "
            f"{len(unlisted)} for the server hold-out, but data.validation.fraction="
            f"{validation_fraction} needs {wanted}; add a 'validation' list to the file, "
            f"list fewer samples, or lower data.validation.fraction"
        )
    held, _ = stratified_holdout(labels, wanted / len(unlisted), rng, candidates=unlisted)
    return clients, held


def split_institutions(groups: np.ndarray | None, pool: np.ndarray,
                       num_clients: int) -> list[np.ndarray]:
    """One client per institution: the pool samples of institution k (natural silos)."""
    if groups is None:
        raise ConfigError("config key 'data.partition.method': 'institutions' needs a data set "
                          "whose sites are institutions (data.dataset: medpar)")
    count = int(groups.max()) + 1 if groups.size else 0
    if num_clients != count:
        raise ConfigError(f"config key 'data.num_clients' must be {count} with "
                          f"data.partition.method 'institutions' (one client per institution), "
                          f"got {num_clients}")
    return [pool[groups[pool] == k] for k in range(count)]


def local_batches(n: int, batch_size: int) -> int:
    """Batches of one local epoch over ``n`` samples, as :func:`fedmpi.training.loop.epoch_bounds`
    forms them: ⌈n/B⌉, less one when a one-sample remainder joins the previous batch."""
    full = math.ceil(n / batch_size)
    return full - 1 if full >= 2 and n - (full - 1) * batch_size == 1 else full


def _by(key: str) -> str:
    return f" by {key}" if key else ""


def check_batch_floor(sizes: Sequence[int], min_batches: int, batch_size: int, key: str,
                      where: str, advice: str) -> None:
    """DataError naming the first client (and ``where``) whose ``sizes[k]`` samples make
    fewer than ``min_batches`` local batches of ``batch_size`` (:func:`local_batches`);
    ``key``: the config key of the component that asks for them."""
    short = [k for k, n in enumerate(sizes) if local_batches(int(n), batch_size) < min_batches]
    if min_batches > 0 and short:
        k, n = short[0], int(sizes[short[0]])
        raise DataError(
            f"{where}: client {k} has {n} samples, {local_batches(n, batch_size)} batch(es) of "
            f"train.batch_size={batch_size}, but {min_batches} local batches are required"
            f"{_by(key)}; {len(short)} such client(s): {advice}")


def make_partition(
    labels: np.ndarray,
    num_clients: int,
    method: str,
    *,
    seed: int,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    min_size: int = 10,
    file: str | None = None,
    validation_fraction: float = 0.0,
    num_classes: int | None = None,
    min_batches: int = 0,
    batch_size: int = 1,
    min_batches_key: str = "",
    groups: np.ndarray | None = None,
) -> Partition:
    r"""Split the training pool into a stratified server hold-out and ``num_clients`` clients.

    Parameters
    ----------
    labels:
        Integer labels of the training pool, shape ``[N]``.
    num_clients:
        :math:`K` (``data.num_clients``).
    method:
        ``iid`` (shuffle, K near-equal parts), ``dirichlet`` (per-class
        proportions :math:`\mathrm{Dir}(\alpha \mathbf 1_K)`, resampled until
        every client has ``min_size`` samples), ``shards`` (every client holds
        exactly ``classes_per_client`` classes) or ``file`` (read from ``file``).
    seed:
        Seeds everything; same arguments and seed give the same partition.
    alpha, classes_per_client, min_size, file:
        ``data.partition.*`` parameters of the respective methods. ``min_size``
        is the Dirichlet resampling criterion only.
    validation_fraction:
        :math:`f` of the pool held out for the server (``data.validation.fraction``),
        drawn by :func:`stratified_holdout` before the client split. For
        ``file``, an explicit ``validation`` list in the file takes precedence;
        otherwise :math:`\mathrm{round}(fN)` samples are drawn, stratified,
        from the pool indices no client lists.
    num_classes:
        :math:`C` (default ``max(labels) + 1``); sets the width of ``class_counts``.
    min_batches, batch_size, min_batches_key:
        When ``min_batches > 0`` every client must have ``min_batches`` local
        batches as the trainer forms them (:func:`local_batches`: a one-sample
        remainder joins the previous batch), i.e. roughly
        :math:`\lceil n_k / B \rceil \ge` ``min_batches`` (asked for by a
        component with ``min_local_steps``, under the config key
        ``min_batches_key``). For ``dirichlet`` this joins the resampling criterion as
        :math:`n_k \ge \max(\text{min\_size}, (\text{min\_batches}-1)B + 2)`;
        for the other methods a violation is an error (:func:`check_batch_floor`).

    Raises
    ------
    ConfigError
        An argument is out of range (the message names the config key).
    DataError
        The data cannot be split as asked (empty client, impossible
        ``min_size``, malformed file, ...).
    """
    _check_args(num_clients, method, seed, alpha, classes_per_client, min_size,
                validation_fraction, min_batches, batch_size)
    y, num_classes = _check_labels(labels, num_classes)
    holdout_seq, split_seq = np.random.SeedSequence(seed).spawn(2)
    holdout_rng, split_rng = np.random.default_rng(holdout_seq), np.random.default_rng(split_seq)

    if method == "file":
        clients, validation = _file_split(y, num_clients, file, validation_fraction, holdout_rng)
    else:
        validation, pool = stratified_holdout(y, validation_fraction, holdout_rng)
        if method == "institutions":
            clients = split_institutions(groups, pool, num_clients)
        elif method == "iid":
            clients = split_iid(pool, num_clients, split_rng)
        elif method == "dirichlet":
            need = max(min_size, 1)
            reason = f"data.partition.min_size={min_size}"
            first = (min_batches - 1) * batch_size + (2 if min_batches > 1 else 1)
            if min_batches > 0 and first > need:   # smallest n with min_batches batches
                need = first
                reason = (f"{min_batches} batches of train.batch_size={batch_size} required"
                          f"{_by(min_batches_key)}")
            clients = split_dirichlet(y, pool, num_clients, split_rng, alpha, need, reason)
        else:
            clients = split_shards(y, pool, num_clients, split_rng, classes_per_client, num_classes)

    clients = [np.sort(ix).astype(np.int64) for ix in clients]
    sizes = [len(ix) for ix in clients]
    for k, size in enumerate(sizes):
        if size == 0:
            raise DataError(
                f"data.partition.method={method}: client {k} gets no samples "
                f"({sum(sizes)} samples for {num_clients} clients); every client needs >= 1, "
                f"use fewer data.num_clients or a smaller data.validation.fraction"
            )
    check_batch_floor(sizes, min_batches, batch_size, min_batches_key,
                      f"data.partition.method={method}", "use fewer data.num_clients or a smaller "
                      "train.batch_size")
    class_counts = np.stack([np.bincount(y[ix], minlength=num_classes) for ix in clients])
    return Partition(
        client_indices=clients,
        validation_indices=np.sort(validation).astype(np.int64),
        class_counts=class_counts.astype(np.int64),
    )
