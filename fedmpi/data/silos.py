r"""Each rank's share of the federation's data: pooled, or silo-local (``data.partition.method: silos``).

Pooled (every other method): every rank loads the whole pool and computes the
same partition (:func:`~fedmpi.data.build_partition`), as before.

Silo-local: client ``k``'s samples are read **only on the rank that hosts k**,
from ``data.silos.path`` with ``{client}`` replaced by ``k`` and ``{site}`` by its name in
``data.silos.names`` (a CSV, Parquet or
HDF5 table, :mod:`fedmpi.data.tabular`) or from ``fn(k)`` for
``data.silos.loader: "pkg.module:fn"`` returning ``(x [n_k, ...], y [n_k])``.
Rank 0 alone reads the test set (``data.silos.test``) and the server validation
set (``data.silos.validation``, also when only the clients evaluate if a component
scores on it: :class:`~fedmpi.data.build.DataNeeds`). A rank's :class:`Dataset`
then holds its hosted clients' samples back to back (rank 0: then the validation
samples), and its :class:`Partition` indexes into that local pool.

What every rank must know travels as metadata in two small collectives through
:mod:`fedmpi.comm` (no sample leaves its silo):

1. ``Allreduce(MAX)`` of the input shape (and its negation, for the minimum) and
   the largest label: the ranks agree on the input shape and on C.
2. ``Allreduce(SUM)`` of one float64 row per client (and one for the validation
   set): class counts ``[C]``, per-channel sums :math:`S_c = \sum x` and
   :math:`Q_c = \sum x^2` and the count. A row is non-zero on exactly one rank,
   so the sum is exact and every rank gets the same rows whatever the layout; the
   class counts give :math:`n_k` (sample weights, sampling, FedVG, ECGR, logs) and
   the normalisation is :math:`\mu_c = \sum_r S_{r,c} / \sum_r n_r`,
   :math:`\sigma_c = (\sum_r Q_{r,c} / \sum_r n_r - \mu_c^2)^{1/2}` summed over
   the rows in client order: the statistics of the union of the silos and the
   validation set, i.e. of the training pool they were cut from.

A read error on any rank is agreed on first (one more ``Allreduce``), so every
rank stops with the same one-line :class:`~fedmpi.errors.DataError`. Every table is
checked as it is read (:func:`~fedmpi.data.tabular.read_named_table`: a NaN or an
infinite feature, a label that is no class id, named by file, row and column), and
then against client 0's: the rank that read client 0's silo sends its feature
columns' names and its row shape to every rank (one ``Allreduce`` of a few bytes), and
a file without one of those columns, with another one, or with rows of another shape
is named with the column; the same columns in another order are put in client 0's
order (so no feature is silently mixed up with another).

Just over 400 lines with one job: reading each silo on the rank that hosts it, with the
agreements between ranks that reading needs (columns, shape, errors, file digests).
"""
from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from fedmpi.data.base import Dataset, channel_sums, check_class_ids, stats_from_sums
from fedmpi.data.build import DataNeeds, build_partition, load_pool
from fedmpi.data.heldout import holdout_positions, holdout_seed, split_partition
from fedmpi.data.partition import Partition, check_batch_floor
from fedmpi.data.tabular import Table, finite_features, read_named_table
from fedmpi.errors import ConfigError, DataError, UserError
from fedmpi.config.core import Config

__all__ = ["LocalData", "agree_on_errors", "agree_on_shape", "build_local", "read_silo",
           "site_names"]

MAX_DIMS = 6          # input rank supported by the shape agreement
ERR_BYTES = 512       # one error line per rank in the failure agreement


@dataclass
class LocalData:
    """This rank's data: ``data`` (hosted clients' samples; rank 0 also the test and
    validation sets), ``partition`` (indices into ``data``'s pool for the hosted clients,
    empty for the others; class counts of *all* clients) and ``num_samples`` n_k of all K."""

    data: Dataset
    partition: Partition
    num_samples: np.ndarray
    files: list[tuple[str, str, str]] = field(default_factory=list)   # (role, path, SHA-256)


def build_local(cfg: Config, comm: Any, hosted: Sequence[int], is_server: bool,
                data: Optional[Any] = None, *, needs: DataNeeds) -> LocalData:
    """This rank's :class:`LocalData` (see the module docstring).

    ``hosted``: the clients this rank trains; ``is_server``: rank 0 (reads the
    test and validation sets); ``data``: a user dataset for the pooled mode
    (:func:`fedmpi.run`'s ``data=``); ``needs``: what the run's components ask of
    the data (a floor of local batches per client, rank 0's validation set).
    Collective in silo mode.
    """
    if cfg.data.partition.method != "silos":
        pool = load_pool(cfg, data)
        partition = build_partition(cfg, pool, needs)
        if clients_evaluate(cfg):
            partition = split_partition(partition, pool.y_train.cpu().numpy(),
                                        cfg.eval.client_holdout, holdout_seed(cfg),
                                        pool.num_classes)
        return LocalData(pool, partition, partition.sizes)
    if data is not None:
        raise ConfigError("a dataset object was given, but data.partition.method is 'silos' "
                          "(silo data comes from data.silos.path or data.silos.loader)")
    return _silos(cfg, comm, list(hosted), is_server, needs)


def clients_evaluate(cfg: Config) -> bool:
    """Whether every client evaluates on its own held-out data: the global model each
    evaluated round (``eval.where``), or the models of the cross-site validation after
    the last one (``eval.cross_site``)."""
    return cfg.eval.where != "server" or cfg.eval.cross_site


def _server_reads_validation(cfg: Config, needs: DataNeeds) -> bool:
    """Rank 0 reads ``data.silos.validation`` unless only the clients evaluate and no
    component works on it (``needs.server_validation``; then rank 0 reads no data file
    at all)."""
    return cfg.data.silos.validation is not None and (cfg.eval.where != "clients"
                                                      or needs.server_validation)


def _held_out(cfg: Config, client: int, silo: Table, test: Optional[Table]
              ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(training part, held-out part) of client ``client``'s silo: its
    ``data.silos.client_test`` table ``test``, or
    :func:`~fedmpi.data.heldout.holdout_positions`."""
    if test is not None:
        return (silo.x, silo.y), (test.x, test.y)
    x, y = silo.x, silo.y
    pos = holdout_positions(len(y), cfg.eval.client_holdout, holdout_seed(cfg), client)
    keep = np.ones(len(y), dtype=bool)
    keep[pos] = False
    return (x[keep], y[keep]), (x[pos], y[pos])


def read_silo(cfg: Config, client: int, loader: Optional[Callable[[int], Any]] = None,
              finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Client ``client``'s ``(x float32, y int64)`` from ``data.silos.path`` or the loader
    (``finite=False``: missing values stay NaN, for ``fedmpi stats``)."""
    table = silo_table(cfg, client, loader, finite)
    return table.x, table.y


def silo_table(cfg: Config, client: int, loader: Optional[Callable[[int], Any]] = None,
               finite: bool = True) -> Table:
    """Client ``client``'s silo as a checked :class:`~fedmpi.data.tabular.Table`."""
    s = cfg.data.silos
    if s.path is not None or loader is None:
        return read_named_table(silo_path(s.path, cfg, client), cfg.data.tabular.label, finite)
    try:
        x, y = loader(client)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: name the key and client
        from fedmpi.errors import code_error_line

        raise DataError(f"{code_error_line('silo loader', s.loader, exc)} (client {client})"
                        ) from None
    x = np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x, dtype=np.float32)
    y = np.asarray(y.cpu() if isinstance(y, torch.Tensor) else y)
    if x.ndim == 1:
        x = x[:, None]
    if y.ndim != 1 or len(y) != len(x) or (len(y) and (not np.issubdtype(y.dtype, np.integer)
                                                       or y.min() < 0)):
        raise DataError(f"data.silos.loader {s.loader!r}: client {client} must give x [n, ...] "
                        f"and integer labels y [n] >= 0; got x {x.shape}, y {y.shape} {y.dtype}")
    where = f"data.silos.loader {s.loader!r}: client {client}"
    check_class_ids(y, where)
    if finite:
        x = finite_features(Table(x, y, None, where))
    return Table(np.ascontiguousarray(x), y.astype(np.int64), None, where)


def _reference(comm: Any, mine: Optional[Table]) -> Optional[tuple[str, Any, tuple[int, ...]]]:
    """Collective: ``(file, feature column names or None, row shape)`` of client 0's
    table, sent by the one rank that read it (``mine``) to every rank (module docstring)."""
    text = b"" if mine is None else json.dumps(
        [mine.path, None if mine.columns is None else list(mine.columns),
         list(mine.x.shape[1:])]).encode()
    size = np.array([len(text)], dtype=np.int64)
    agreed = np.zeros_like(size)
    comm.allreduce_max(size, agreed, what="silo columns Allreduce")
    if agreed[0] == 0:
        return None
    buf = np.zeros(int(agreed[0]), dtype=np.uint8)
    buf[: len(text)] = np.frombuffer(text, dtype=np.uint8)
    out = np.zeros_like(buf)
    comm.allreduce_sum(buf, out, what="silo columns Allreduce")
    path, columns, shape = json.loads(bytes(out).decode())
    return path, columns, tuple(shape)


def _match_reference(tables: Sequence[Table], ref: tuple[str, Any, tuple[int, ...]]) -> None:
    """Every table's columns (in place: put in the reference's order) and row shape
    against client 0's; DataError naming the file and the column otherwise."""
    path, columns, shape = ref
    for t in tables:
        if columns is not None and t.columns is not None and list(t.columns) != columns:
            missing = [c for c in columns if c not in t.columns]
            if missing:
                raise DataError(f"{t.path}: no column {missing[0]!r}, which client 0's {path} "
                                "has; every silo table needs the same feature columns")
            extra = [c for c in t.columns if c not in columns]
            if extra:
                raise DataError(f"{t.path}: column {extra[0]!r}, which client 0's {path} does "
                                "not have; every silo table needs the same feature columns")
            t.x[:] = t.x[:, [t.columns.index(c) for c in columns]]   # client 0's order
        if t.x.shape[1:] != shape:
            raise DataError(f"{t.path}: rows of shape {tuple(t.x.shape[1:])}, but client 0's "
                            f"{path} has {shape}; every silo table needs the same features")


def silo_path(template: str, cfg: Config, client: int) -> str:
    """A per-client file template (``data.silos.path``, ``data.silos.client_test``) for
    ``client``: ``{client}`` is its index, ``{site}`` its name in ``data.silos.names``
    (a consortium's files named by site: ``silos/{site}.csv``)."""
    names = cfg.data.silos.names
    return template.format(client=client,
                           site=str(names[client]) if names is not None else str(client))


def shown_path(path: str) -> str:
    """``path`` as logs and reports record it: a relative path as given; an absolute one
    without its machine directories, from the first part holding a template field (else
    the file name) on: ``/home/me/data/{site}/x.csv`` -> ``…/{site}/x.csv``. A site may
    share a report; the SHA-256 beside the name identifies the file."""
    if not os.path.isabs(path):
        return path
    parts = path.replace(os.sep, "/").split("/")
    first = next((i for i, part in enumerate(parts) if "{" in part), len(parts) - 1)
    return "…/" + "/".join(parts[first:])


def site_names(cfg: Config) -> list[str]:
    """The name of every client's site, in client order, for reports, logs and
    ``fedmpi stats``: ``data.silos.names`` when given; else, for silo files, the part of
    ``data.silos.path`` that names the client (the file name, less its suffix, or the
    folder holding ``{client}``: ``silos/hospital_{client}.csv`` gives ``hospital_0``);
    else ``client k``. A part that is the bare number reads ``client k`` too."""
    s, K = cfg.data.silos, cfg.data.num_clients
    if s.names is not None:
        return [str(n) for n in s.names]
    if cfg.data.partition.method != "silos" or s.path is None:
        return [f"client {k}" for k in range(K)]
    parts = s.path.replace("\\", "/").split("/")
    last = max(i for i, p in enumerate(parts) if "{client}" in p)
    part = os.path.splitext(parts[last])[0] if last == len(parts) - 1 else parts[last]
    names = [part.format(client=k) for k in range(K)]
    return [f"client {k}" if n == str(k) else n for k, n in enumerate(names)]


def agree_on_errors(comm: Any, error: Optional[Exception | str],
                    kind: type[Exception] = DataError,
                    what: str = "silo read agreement Allreduce") -> None:
    """Collective: raise ``kind`` with the first rank's error (``rank r: <error>``, the
    same text on every rank) if any rank failed: one ``Allreduce`` of one line per rank."""
    buf = np.zeros((comm.size, ERR_BYTES), dtype=np.uint8)
    if error is not None:
        raw = f"rank {comm.rank}: {error}".encode()[: ERR_BYTES - 1]
        buf[comm.rank, : len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    out = np.zeros_like(buf)
    comm.allreduce_sum(buf, out, what=what)
    for row in out:
        if row.any():
            raise kind(bytes(row).rstrip(b"\0").decode(errors="replace"))


def agree_on_shape(comm: Any, shape: Optional[tuple[int, ...]], classes: int
                   ) -> tuple[tuple[int, ...], int]:
    """Collective: the input shape every rank holding data has (``shape``; None on a
    rank without data) and the number of classes (the largest ``classes`` of the
    ranks): one ``Allreduce(MAX)`` of ``(d, BIG − d)``, so the maximum and minimum of
    every dimension arrive together; ranks that disagree raise the same
    :class:`~fedmpi.errors.DataError` on every rank."""
    big = np.int64(1) << 40
    head = np.zeros(2 * (MAX_DIMS + 1) + 1, dtype=np.int64)
    if shape is not None:
        dims = np.zeros(MAX_DIMS + 1, dtype=np.int64)
        dims[0], dims[1:1 + len(shape)] = len(shape), shape
        head[: MAX_DIMS + 1], head[MAX_DIMS + 1: -1] = dims, big - dims
    head[-1] = classes
    agreed = np.zeros_like(head)
    comm.allreduce_max(head, agreed, what="silo shape Allreduce")
    hi, lo = agreed[: MAX_DIMS + 1], big - agreed[MAX_DIMS + 1: -1]
    if not np.array_equal(hi, lo):
        raise DataError(f"silos disagree on the input shape: between "
                        f"{tuple(lo[1:1 + lo[0]])} and {tuple(hi[1:1 + hi[0]])} per sample")
    return tuple(int(d) for d in hi[1:1 + hi[0]]), int(agreed[-1])


def _silos(cfg: Config, comm: Any, hosted: list[int], is_server: bool,
           needs: DataNeeds) -> LocalData:
    from fedmpi import imports

    s, K, label = cfg.data.silos, cfg.data.num_clients, cfg.data.tabular.label
    parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    held: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    silo: dict[int, Table] = {}
    own_test: dict[int, Table] = {}
    test_table: Optional[Table] = None
    val_table: Optional[Table] = None
    error: Optional[UserError] = None
    try:
        loader = imports.silo_loader(s.loader) if s.loader is not None else None
        for k in hosted:
            silo[k] = silo_table(cfg, k, loader)
            if clients_evaluate(cfg) and s.client_test is not None:
                own_test[k] = read_named_table(silo_path(s.client_test, cfg, k), label)
        if is_server and cfg.eval.where != "clients":
            test_table = read_named_table(s.test, label)
        if is_server and _server_reads_validation(cfg, needs):
            val_table = read_named_table(s.validation, label)
    except UserError as exc:
        error = exc
    comm.roll_call("reading its silos")   # a slow silo is named (runtime.setup_timeout)
    agree_on_errors(comm, error)
    tables = [*silo.values(), *own_test.values(),
              *(t for t in (test_table, val_table) if t is not None)]
    try:
        ref = _reference(comm, silo.get(0))
        if ref is not None:
            _match_reference(tables, ref)
        deep = [t for t in tables if len(t.x.shape[1:]) > MAX_DIMS or t.x.ndim < 2]
        if deep:
            raise DataError(f"{deep[0].path}: rows of shape {tuple(deep[0].x.shape[1:])}; silo "
                            f"inputs must be [n, ...] with at most {MAX_DIMS} dimensions")
    except UserError as exc:
        error = exc
    agree_on_errors(comm, error)
    for k in hosted:
        parts[k] = (silo[k].x, silo[k].y)
        if clients_evaluate(cfg):
            parts[k], held[k] = _held_out(cfg, k, silo[k], own_test.get(k))
    test = (test_table.x, test_table.y) if test_table is not None else None
    val = (val_table.x, val_table.y) if val_table is not None else None
    del silo, own_test, tables, test_table, val_table
    arrays = [*parts.values(), *held.values(), *(a for a in (test, val) if a is not None)]

    # 1. input shape and class count
    shape, C = agree_on_shape(comm, next(iter({x.shape[1:] for x, _ in arrays}), None),
                              max((int(y.max()) + 1 for _, y in arrays if len(y)), default=0))
    F = shape[0]

    # 2. per-client class counts and channel sums (one row per client + validation)
    rows = np.zeros((K + 1, C + 2 * F + 1), dtype=np.float64)
    x = y = None
    for r, (x, y) in [*parts.items(), *([(K, val)] if val is not None else [])]:
        rows[r, :C] = np.bincount(y, minlength=C)
        if len(y):
            total, total_sq, count = channel_sums(torch.from_numpy(x))
            rows[r, C:C + F], rows[r, C + F:C + 2 * F], rows[r, -1] = total, total_sq, count
    summed = np.zeros_like(rows)
    comm.allreduce_sum(rows, summed, what="silo metadata Allreduce")
    class_counts = np.rint(summed[:K, :C]).astype(np.int64)
    num_samples = class_counts.sum(1)
    empty = np.flatnonzero(num_samples == 0)
    if empty.size:
        raise DataError(f"silo of client {int(empty[0])} has no samples "
                        f"({s.path or s.loader})")
    check_batch_floor(num_samples, needs.min_batches, cfg.train.batch_size, needs.min_batches_key,
                      "data.partition.method=silos", "lower train.batch_size, raise "
                      "train.local_epochs or set train.local_steps")
    tot = summed.sum(0)   # same rows in the same order on every rank
    mean, std = stats_from_sums(torch.from_numpy(tot[C:C + F]), torch.from_numpy(tot[C + F:C + 2 * F]),
                                float(tot[-1]))

    # 3. the local pool: hosted clients back to back, then (rank 0) the validation set,
    # then the hosted clients' held-out samples, moved in one at a time so the peak is
    # the pool plus one silo, not twice the pool
    del arrays, x, y
    has_val = val is not None
    tested = [k for k in hosted if k in held]
    queue = deque([parts.pop(k) for k in hosted] + ([val] if has_val else [])
                  + [held.pop(k) for k in tested])
    val = None
    offsets = [int(o) for o in np.cumsum([0, *(len(y) for _, y in queue)])]
    span = lambda i: np.arange(offsets[i], offsets[i + 1], dtype=np.int64)  # noqa: E731
    client_indices = [np.zeros(0, dtype=np.int64)] * K
    for i, k in enumerate(hosted):
        client_indices[k] = span(i)
    validation = span(len(hosted)) if has_val else np.zeros(0, dtype=np.int64)
    client_test = [np.zeros(0, dtype=np.int64)] * K if clients_evaluate(cfg) else []
    for i, k in enumerate(tested):
        client_test[k] = span(len(hosted) + has_val + i)
    if len(queue) == 1:
        x_pool, y_pool = queue.popleft()
    else:
        x_pool = np.empty((int(offsets[-1]), *shape), dtype=np.float32)
        y_pool = np.empty(int(offsets[-1]), dtype=np.int64)
        for i in range(len(queue)):
            x, y = queue.popleft()   # the queue drops this silo's arrays
            x_pool[offsets[i]:offsets[i + 1]], y_pool[offsets[i]:offsets[i + 1]] = x, y
            x = y = None
    x_test, y_test = test if test is not None else (np.zeros((0, *shape), np.float32),
                                                    np.zeros(0, np.int64))
    data = Dataset("silos", torch.from_numpy(x_pool), torch.from_numpy(y_pool),
                   torch.from_numpy(x_test), torch.from_numpy(y_test), num_classes=C,
                   mean=mean, std=std, scale=1.0)
    return LocalData(data, Partition(client_indices, validation, class_counts, client_test),
                     num_samples, _digests(cfg, comm, hosted, is_server, needs))


def _digests(cfg: Config, comm: Any, hosted: list[int], is_server: bool,
             needs: DataNeeds) -> list[tuple[str, str, str]]:
    """Collective: ``(role, path, SHA-256)`` of every silo file — client ``k``'s hashed on
    the rank that read it, the test and validation files on rank 0 — gathered as one
    ``Allreduce(SUM)`` of 32-byte rows, each non-zero on one rank only (the file's bytes
    never leave its rank; the paths follow from the config). Empty for a loader."""
    s, K = cfg.data.silos, cfg.data.num_clients
    if s.path is None:
        return []
    # the test and validation files only where rank 0 reads them (eval.where, DataNeeds)
    test = s.test if cfg.eval.where != "clients" else None
    validation = s.validation if _server_reads_validation(cfg, needs) else None
    paths = [silo_path(s.path, cfg, k) for k in range(K)] + [test, validation]
    from fedmpi.job.outputs import sha256_file

    rows = np.zeros((K + 2, 32), dtype=np.int64)
    mine = hosted + [r for r in (K, K + 1) if paths[r] is not None] if is_server else hosted
    for r in mine:
        rows[r] = np.frombuffer(bytes.fromhex(sha256_file(paths[r])), dtype=np.uint8)
    summed = np.zeros_like(rows)
    comm.allreduce_sum(rows, summed, what="silo digest Allreduce")
    roles = [f"client {k}" for k in range(K)] + ["test", "validation"]
    return [(roles[r], shown_path(str(paths[r])),
             bytes(summed[r].astype(np.uint8)).hex()) for r in range(K + 2) if paths[r] is not None]
