"""``fedmpi stats CONFIG``: federated statistics of what every site holds, before
training (NVFlare's FedStats recipe), in one collective pass.

Every rank summarises the sites it hosts (the run's placement: client k on rank
1 + k mod (W − 1), or rank 0 alone) — a silo config's ``data.silos.path`` file or
``data.silos.loader``, read only on that rank; a pooled config's partition of the
training pool — into one fixed-size float64 row per site
(:mod:`fedmpi.consortium.summaries`): sample count, label histogram, and per feature
(tabular) or channel (images) the missing values, sums, sums of squares, minimum and
maximum. With ``privacy`` each site adds Gaussian noise to its row before it leaves
(:mod:`fedmpi.consortium.noise`). Only these rows travel, through :mod:`fedmpi.comm`'s
buffer collectives:

1. ``Allreduce`` of one error line per rank (a missing file anywhere stops every rank
   with the same line; :func:`fedmpi.data.silos.agree_on_errors`);
2. ``Allreduce(MAX)`` of the input shape and the number of classes
   (:func:`fedmpi.data.silos.agree_on_shape`);
3. tabular data: ``Allreduce(MAX)`` of the feature names (CSV/Parquet column headers,
   64 bytes each) and of their complement, so every rank learns whether the sites agree
   on the columns and their order;
4. ``Reduce`` (sum) of the ``[K, width]`` table to rank 0: row k is non-zero on the
   rank hosting site k only, so the sum is every site's row, exactly.

No sample and no per-sample value leaves its rank. Rank 0 turns the table into
:class:`StatsReport` (per site and all sites together: mean, sample standard deviation,
minimum, maximum, missing values; class counts), written as ``stats.md`` and
``stats.json`` (:mod:`fedmpi.consortium.stats_files`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from fedmpi.config.core import Config
from fedmpi.errors import UserError

from fedmpi.consortium.noise import StatsPrivacy
from fedmpi.consortium.summaries import (RowLayout, SiteStats, combine, describe,
    round_counts, summarise, widen)

__all__ = ["NAME_BYTES", "StatsReport", "collect_stats"]

NAME_BYTES = 64          # a feature name in the names agreement (longer names are cut)
MAX_NAMED = 4096         # features beyond this many are named x<i> without an agreement


@dataclass
class StatsReport:
    """Rank 0's result of :func:`collect_stats`."""

    name: str
    kind: str                            # "tabular" or "images"
    sample_shape: list[int]
    num_classes: int
    feature_label: str                   # "feature" or "channel"
    sites: list[SiteStats]
    total: SiteStats
    privacy: Optional[dict[str, Any]] = None
    notes: list[str] = field(default_factory=list)


def _column_names(path: str, label: str) -> Optional[list[str]]:
    """The feature columns of a CSV/Parquet file in file order (None for other files)."""
    lower = path.lower()
    if lower.endswith(".csv"):
        import pandas as pd

        columns = list(pd.read_csv(path, nrows=0).columns)
    elif lower.endswith((".parquet", ".pq")):
        import pyarrow.parquet as pq

        columns = list(pq.read_schema(path).names)
    else:
        return None
    return [str(c) for c in columns if str(c) != label]


class _Sites:
    """This rank's sites, read one at a time: ``(x, y, feature names or None)``."""

    def __init__(self, cfg: Config, hosted: list[int]) -> None:
        self.cfg, self.hosted = cfg, hosted
        self.silos = cfg.data.partition.method == "silos"
        self.loader: Optional[Callable[[int], Any]] = None
        self.pool: Any = None
        self.partition: Any = None
        if self.silos and cfg.data.silos.loader is not None:
            from fedmpi import imports

            self.loader = imports.silo_loader(cfg.data.silos.loader)
        elif not self.silos and hosted:
            from fedmpi.data.build import build_partition, load_pool
            from fedmpi.usercode import UserCode

            self.pool = load_pool(cfg)
            self.partition = build_partition(cfg, self.pool, UserCode().data_needs(cfg))

    def read(self, k: int) -> tuple[Any, np.ndarray, Optional[list[str]]]:
        if self.silos:
            from fedmpi.data.silos import read_silo, silo_path

            x, y = read_silo(self.cfg, k, self.loader, finite=False)   # missing values counted
            path = self.cfg.data.silos.path
            names = _column_names(silo_path(path, self.cfg, k), self.cfg.data.tabular.label) \
                if path is not None and x.ndim == 2 else None
            return x, y, names
        idx = self.partition.client_indices[k]
        return _Indexed(self.pool.x_train, idx), self.pool.y_train[idx].cpu().numpy(), None


class _Indexed:
    """Rows ``idx`` of a pooled tensor, gathered a slice at a time (no copy of the site)."""

    def __init__(self, x: Any, idx: np.ndarray) -> None:
        self.x, self.idx = x, idx
        self.shape = (len(idx), *x.shape[1:])
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, s: slice) -> Any:
        import torch

        return self.x[torch.as_tensor(self.idx[s], dtype=torch.long)]


def _agree_on_names(comm: Any, names: list[Optional[list[str]]], channels: int
                    ) -> tuple[Optional[list[str]], Optional[str]]:
    """Collective: the feature names if every site has the same, in the same order (else
    None and a note naming the first column that differs). ``names``: this rank's sites'
    column names (None: a file without a header). Byte by byte, the maximum and the
    minimum over the sites travel in one ``Allreduce(MAX)`` (the minimum as 255 − byte):
    they agree exactly where every site has the same name."""
    def encode(cols: Optional[list[str]]) -> np.ndarray:
        raw = np.zeros((channels, NAME_BYTES), dtype=np.uint8)
        for i, n in enumerate((cols or [])[:channels]):
            b = n.encode()[:NAME_BYTES]
            raw[i, :len(b)] = np.frombuffer(b, dtype=np.uint8)
        return raw

    both = np.zeros((2 * channels, NAME_BYTES), dtype=np.uint8)
    if names:
        raws = np.stack([encode(cols) for cols in names])
        both[:channels], both[channels:] = raws.max(axis=0), 255 - raws.min(axis=0)
    agreed = np.zeros_like(both)
    comm.allreduce_max(both, agreed, what="feature names Allreduce")
    hi, lo = agreed[:channels], 255 - agreed[channels:]
    differ = np.flatnonzero((hi != lo).any(axis=1))
    if differ.size:
        return None, (f"the sites' feature columns differ (first at column {int(differ[0])}: "
                      "another name, another order, or a file without a header); features "
                      "are named x<i> by position")
    shown = [bytes(hi[i]).rstrip(b"\0").decode(errors="replace") for i in range(channels)]
    return (shown if any(shown) else None), None


def collect_stats(cfg: Config, comm: Any, privacy: Optional[StatsPrivacy] = None,
                  before: Optional[Callable[[], None]] = None,
                  rng: Optional[np.random.Generator] = None) -> Optional[StatsReport]:
    """The collective pass of the module docstring, on every rank; returns the
    :class:`StatsReport` on rank 0 and None elsewhere.

    ``before``: called on rank 0 before any data is read (e.g. refusing to replace
    existing output files); its UserError, like any rank's read error, stops every rank
    with the same one line. ``rng``: the noise generator, for tests only.

    Raises
    ------
    UserError
        On every rank, for a file or loader any rank could not read, or sites that
        disagree on the input shape.
    """
    from fedmpi.data.silos import agree_on_errors, agree_on_shape, site_names
    from fedmpi.runtime.build import client_hosts
    from fedmpi.runtime.guard import agree_on_setup

    K = cfg.data.num_clients
    host = client_hosts(K, comm.size)
    hosted = [k for k in range(K) if host[k] == comm.rank]
    failed: Optional[UserError] = None
    if comm.rank == 0 and before is not None:
        try:
            before()
        except UserError as exc:
            failed = exc
    agree_on_setup(comm, failed)   # rank 0 says why; the others stop quietly

    center = privacy.center if privacy is not None else 0.0
    clip = privacy.clip if privacy is not None else None
    local: dict[int, tuple[np.ndarray, RowLayout]] = {}   # exact rows, in each site's layout
    shapes: set[tuple[int, ...]] = set()
    names: list[Optional[list[str]]] = []   # each hosted site's feature columns
    error: Optional[UserError] = None
    try:
        sites = _Sites(cfg, hosted)
        for k in hosted:
            x, y, cols = sites.read(k)
            shapes.add(tuple(x.shape[1:]))
            if len(shapes) > 1:
                raise UserError(f"the sites of rank {comm.rank} hold samples of different "
                                f"shapes {sorted(shapes)}")
            names.append(cols)
            own = RowLayout(int(y.max()) + 1 if len(y) else 0, int(x.shape[1]))
            local[k] = summarise(x, y, own, center, clip), own
            del x, y
    except UserError as exc:
        error = exc
    agree_on_errors(comm, error)
    shape, C = agree_on_shape(comm, next(iter(shapes), None),
                              max((lay.classes for _, lay in local.values()), default=0))
    if len(shape) == 0:
        raise UserError("fedmpi stats: no site holds any sample")
    layout = RowLayout(C, shape[0])
    per_sample = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    tabular = len(shape) == 1
    agreed_names, note = (_agree_on_names(comm, names, shape[0])
                          if tabular and shape[0] <= MAX_NAMED else (None, None))

    rows = np.zeros((K, layout.width), dtype=np.float64)
    for k, (row, own) in local.items():
        rows[k] = widen(row, own, C)[0]
        if privacy is not None:   # noise before the row leaves the site
            rows[k] = privacy.add_noise(rows[k], layout, per_sample, rng)
    table = np.zeros_like(rows) if comm.rank == 0 else None
    comm.reduce_sum(rows, table, what="site statistics Reduce")
    if table is None:
        return None

    if privacy is not None:   # whole counts per site, so the all-sites row is their sum
        table = round_counts(table, layout, per_sample)
    label = "feature" if tabular else "channel"
    fnames = agreed_names or [f"{'x' if tabular else 'channel '}{i}" for i in range(shape[0])]
    labels = site_names(cfg)
    per_site = [describe(table[k], layout, labels[k], k, fnames, per_sample, center, clip)
                for k in range(K)]
    total = describe(combine(table, layout), layout, "all sites", -1, fnames, per_sample,
                     center, clip)
    return StatsReport(
        name=str(cfg.name), kind="tabular" if tabular else "images",
        sample_shape=[int(d) for d in shape], num_classes=C, feature_label=label,
        sites=per_site, total=total,
        privacy=privacy.record(shape[0], per_sample) if privacy is not None else None,
        notes=[note] if note else [])
