r"""What one site computes for ``fedmpi stats``, and what rank 0 makes of it.

A site's samples ``x`` ``[n, H, ...]`` (tabular: ``[n, F]``, one *feature* per column;
images: ``[n, C, H, W]``, one *channel* per ``C``) and labels ``y`` ``[n]`` become one
fixed-size float64 row (:class:`RowLayout`):

==================  =======  =====================================================
block               size     value (per channel c; P values of c per sample)
==================  =======  =====================================================
``count``           1        n, the number of samples
``classes``         C        :math:`h_j = |\{i : y_i = j\}|`
``missing``         H        :math:`m_c`, NaN values of channel c
``sum``             H        :math:`S_c = \sum (v - a)` over the non-missing values v
``sum_sq``          H        :math:`Q_c = \sum (v - a)^2` over the same values
``min``, ``max``    H, H     smallest and largest non-missing value (NaN if none)
==================  =======  =====================================================

with :math:`a` the centre of the declared value range when the values are clipped to
it for differential privacy (:mod:`fedmpi.consortium.noise`; then ``v`` is the clipped
value), else 0. Row k is non-zero on the rank hosting site k only, so the sum of the
ranks' tables is every site's row, exactly (the layout of :mod:`fedmpi.data.silos`'s
metadata rows).

From a row (:func:`describe`): with :math:`N_c = nP - m_c` values,
mean :math:`\mu_c = a + S_c / N_c` and the sample standard deviation
:math:`s_c = \sqrt{(Q_c - S_c^2 / N_c) / (N_c - 1)}` (pandas' ``std``, ``ddof=1``).
All sites together: the sum of the rows, whose mean and standard deviation are those
of the union of the sites' values; min and max the extremes over the sites.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

__all__ = ["BLOCKS", "FeatureStats", "RowLayout", "SiteStats", "combine", "describe",
           "round_counts", "summarise", "widen"]

#: The blocks of a row, in order; the first five are sums (noised under DP), the last two
#: extremes (withheld under DP).
BLOCKS = ("count", "classes", "missing", "sum", "sum_sq", "min", "max")
_ROWS_PER_CHUNK = 4096   # samples converted to float64 at a time (memory: one chunk)


@dataclass(frozen=True)
class RowLayout:
    """Where each block of :data:`BLOCKS` lies in a row, for ``classes`` classes and
    ``channels`` channels (features)."""

    classes: int
    channels: int

    @property
    def width(self) -> int:
        return 1 + self.classes + 5 * self.channels

    def span(self, block: str) -> slice:
        sizes = {"count": 1, "classes": self.classes}
        start = 0
        for name in BLOCKS:
            size = sizes.get(name, self.channels)
            if name == block:
                return slice(start, start + size)
            start += size
        raise KeyError(block)


def summarise(x: Any, y: np.ndarray, layout: RowLayout, center: float = 0.0,
              clip: Optional[tuple[float, float]] = None) -> np.ndarray:
    """One site's row (module docstring) from samples ``x`` ``[n, H, ...]`` (a numpy
    array or torch tensor of any dtype, read ``_ROWS_PER_CHUNK`` samples at a time in
    float64) and labels ``y`` ``[n]``; values clipped to ``clip`` first when given,
    then centred at ``center``."""
    row = np.zeros(layout.width, dtype=np.float64)
    h = layout.channels
    lo = np.full(h, np.inf)
    hi = np.full(h, -np.inf)
    row[layout.span("count")] = len(y)
    row[layout.span("classes")] = np.bincount(np.asarray(y, dtype=np.int64),
                                              minlength=layout.classes)[: layout.classes]
    for start in range(0, len(y), _ROWS_PER_CHUNK):
        part = x[start:start + _ROWS_PER_CHUNK]
        v = np.asarray(part.cpu().numpy() if hasattr(part, "cpu") else part,
                       dtype=np.float64).reshape(len(part), h, -1)
        if clip is not None:
            v = np.clip(v, clip[0], clip[1])   # NaN stays NaN
        missing = np.isnan(v)
        lo = np.minimum(lo, np.where(missing, np.inf, v).min(axis=(0, 2)))
        hi = np.maximum(hi, np.where(missing, -np.inf, v).max(axis=(0, 2)))
        v = np.where(missing, 0.0, v - center)
        row[layout.span("missing")] += missing.sum(axis=(0, 2))
        row[layout.span("sum")] += v.sum(axis=(0, 2))
        row[layout.span("sum_sq")] += (v * v).sum(axis=(0, 2))
    seen = np.isfinite(lo)
    row[layout.span("min")] = np.where(seen, lo, np.nan)
    row[layout.span("max")] = np.where(seen, hi, np.nan)
    return row


@dataclass
class FeatureStats:
    """One feature (channel) of one site, or of all sites."""

    name: str
    values: float          # non-missing values N_c
    missing: float
    mean: float
    std: float             # sample standard deviation (ddof 1)
    min: float
    max: float


@dataclass
class SiteStats:
    """One site's summaries (``client`` −1: all sites together)."""

    name: str
    client: int
    samples: float
    classes: list[float]
    features: list[FeatureStats] = field(default_factory=list)


def describe(row: np.ndarray, layout: RowLayout, name: str, client: int,
             feature_names: list[str], per_sample: int, center: float = 0.0,
             clip: Optional[tuple[float, float]] = None) -> SiteStats:
    """The :class:`SiteStats` of a row (module docstring); ``per_sample``: P, the values
    of a channel in one sample (1 for tabular data). With ``clip`` (a noisy row of
    values clipped to that range) the results are post-processed into what the clipped
    values allow: counts ≥ 0, means in the range, standard deviations in [0, hi − lo]."""
    get = lambda block: row[layout.span(block)]  # noqa: E731
    floor = (lambda v: max(float(v), 0.0)) if clip is not None else float  # noqa: E731
    n = floor(get("count")[0])
    missing, total, total_sq = get("missing"), get("sum"), get("sum_sq")
    features = []
    for c, fname in enumerate(feature_names):
        values = floor(n * per_sample - floor(missing[c]))
        mean = center + total[c] / values if values > 0 else math.nan
        var = ((total_sq[c] - total[c] ** 2 / values) / (values - 1)) if values > 1 else math.nan
        std = math.sqrt(max(var, 0.0)) if math.isfinite(var) else math.nan
        if clip is not None:
            mean = min(max(mean, clip[0]), clip[1]) if math.isfinite(mean) else mean
            std = min(std, clip[1] - clip[0]) if math.isfinite(std) else std
        features.append(FeatureStats(fname, values, floor(missing[c]), float(mean), std,
                                     float(get("min")[c]), float(get("max")[c])))
    return SiteStats(name, client, n, [floor(v) for v in get("classes")], features)


def round_counts(rows: np.ndarray, layout: RowLayout, per_sample: int) -> np.ndarray:
    """Noisy rows ``[K, width]`` post-processed (no privacy cost) into whole counts: each
    site's sample, class and missing-value counts rounded to the nearest integer ≥ 0, a
    channel's missing values at most its ``count · per_sample`` values. Done per site
    before :func:`combine`, so the all-sites counts are the sum of the sites' as shown."""
    out = rows.copy()
    for block in ("count", "classes", "missing"):
        out[:, layout.span(block)] = np.maximum(np.rint(out[:, layout.span(block)]), 0.0)
    values = out[:, layout.span("count")] * per_sample
    out[:, layout.span("missing")] = np.minimum(out[:, layout.span("missing")], values)
    return out


def widen(row: np.ndarray, layout: RowLayout, classes: int) -> tuple[np.ndarray, RowLayout]:
    """``row`` (of ``layout``) in the layout of ``classes`` ≥ ``layout.classes`` classes:
    a site summarises with its own largest label before the sites agree on C."""
    wide = RowLayout(classes, layout.channels)
    out = np.zeros(wide.width, dtype=np.float64)
    for block in BLOCKS:
        src, dst = layout.span(block), wide.span(block)
        out[dst.start:dst.start + (src.stop - src.start)] = row[src]
    return out, wide


def combine(rows: np.ndarray, layout: RowLayout) -> np.ndarray:
    """The row of all sites together: sums added, extremes taken over the sites that
    have one (NaN where none has: withheld under DP, or no value at all)."""
    out = rows.sum(axis=0)
    out[layout.span("min")] = np.fmin.reduce(rows[:, layout.span("min")], axis=0)
    out[layout.span("max")] = np.fmax.reduce(rows[:, layout.span("max")], axis=0)
    return out
