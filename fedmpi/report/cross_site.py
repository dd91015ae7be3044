"""The cross-site validation of a run (``eval.cross_site``, :mod:`fedmpi.consortium.cross_site`)
in the report: ``cross_site.png`` (one heatmap per metric, rows = the site whose held-out
data evaluates, columns = the global model and each site's local model) and the
``## Cross-site validation`` tables of ``summary.md``.

A personalised method's log has K more columns, each site's personal model (the
site's own personal model on its own data is the cell its reviewer signs).

A log is untrusted input: the matrices are used only when ``/cross_site/sites`` and
``/cross_site/models`` name K rows and K + 1 (or 2K + 1) columns and a metric's matrix has
that shape;
names are cut and cleaned as :func:`~fedmpi.report.derived.clean_label` does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedmpi.log.schema import PathLike
from fedmpi.log.reader import RunLog, as_run_log

from fedmpi.report import canvas
from fedmpi.report.derived import METRIC_LABELS, clean_label, metric_names, metric_text, run_title

__all__ = ["CrossSiteMatrices", "cross_site_lines", "cross_site_matrices", "plot_cross_site"]

_NAMES = ("sites", "models", "test_samples")


@dataclass
class CrossSiteMatrices:
    """The log's ``/cross_site``: ``matrices[metric]`` [K, K + 1] (row i = site i's data,
    column 0 the global model, column j + 1 site j's local model) or, personalised,
    [K, 2K + 1] (column K + 1 + j: site j's personal model)."""

    sites: list[str]
    models: list[str]
    matrices: dict[str, np.ndarray]
    test_samples: np.ndarray | None
    rounds: int | None


def cross_site_matrices(log: RunLog) -> CrossSiteMatrices | None:
    """The cross-site matrices of ``log``, metrics in the run's order (``test_loss``
    last); None when the log holds none (or none of a consistent shape)."""
    sites, models = log.arrays.get("cross_site/sites"), log.arrays.get("cross_site/models")
    if sites is None or models is None or sites.ndim != 1 or models.shape not in (
            (len(sites) + 1,), (2 * len(sites) + 1,)):
        return None
    k = len(sites)
    found = {key.split("/", 1)[1]: a for key, a in log.arrays.items()
             if key.startswith("cross_site/") and key.split("/", 1)[1] not in _NAMES
             and a.shape == (k, len(models)) and a.dtype.kind in "biuf"}
    order = [m for m in (*metric_names(log), "test_loss") if m in found]
    order += sorted(m for m in found if m not in order)
    if not order:
        return None
    n = log.arrays.get("cross_site/test_samples")
    rounds = log.attrs.get("cross_site_rounds")
    return CrossSiteMatrices(sites=[clean_label(str(s)) for s in sites],
                             models=[clean_label(str(m)) for m in models],
                             matrices={m: np.asarray(found[m], dtype=np.float64) for m in order},
                             test_samples=n if n is not None and n.shape == (k,) else None,
                             rounds=int(rounds) if isinstance(rounds, (int, np.integer)) else None)


def _mean(v: np.ndarray) -> float:
    """The mean of the finite values; NaN when none is."""
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else math.nan


def _means(a: np.ndarray) -> list[tuple[float, float]]:
    """For each block of site models (the local ones, then the personal ones if any): the
    mean over the sites (finite cells) of a site's model on its own data (the block's
    diagonal) and on the other sites' data."""
    k = len(a)
    own = np.eye(k, dtype=bool)
    return [(_mean(b[own]), _mean(b[~own]))
            for b in (a[:, 1 + s:1 + s + k] for s in range(0, a.shape[1] - 1, k))]


def _own_columns(k: int, columns: int) -> list[list[int]]:
    """Row i's own-model columns: site i's local model and, personalised, its personal one."""
    return [list(range(1 + i, columns, k)) for i in range(k)]


def cross_site_lines(log: RunLog) -> list[str]:
    """``## Cross-site validation`` of ``summary.md``: one table per metric (rows = the
    evaluating site with its held-out samples, columns = the models; the site's own
    local model on its own data in bold) and the means over sites; nothing without
    ``/cross_site``."""
    cs = cross_site_matrices(log)
    if cs is None:
        return []
    after = f" after {cs.rounds} rounds" if cs.rounds is not None else ""
    k = len(cs.sites)
    personal = len(cs.models) > k + 1
    out = ["", "## Cross-site validation", "",
           f"The global model{after} and each site's local model (one local training from "
           "it)" + (", then each site's personal model," if personal else "") +
           " evaluated on each site's held-out samples (`/cross_site/<metric>`): a row is "
           "the site whose data evaluates (held-out samples in brackets), a column the model; "
           "**bold**: a site's own model on its own data."]
    head = ["data \\ model", *cs.models]
    for name, a in cs.matrices.items():
        blocks = _means(a)
        kinds = ["each site's local model", "each site's personal model"]
        means = "; ".join(f"{kind} on its own data {metric_text(own)}, on the other sites' "
                          f"{metric_text(other)}" for kind, (own, other) in zip(kinds, blocks))
        out += ["", f"**{METRIC_LABELS.get(name, name)}** — mean over sites: global model "
                    f"{metric_text(_mean(a[:, 0]))}; {means}", "",
                "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for i, site in enumerate(cs.sites):
            n = f" ({int(cs.test_samples[i])})" if cs.test_samples is not None else ""
            cells = [metric_text(v) for v in a[i]]
            for c in _own_columns(k, len(cs.models))[i]:
                cells[c] = f"**{cells[c]}**"
            out.append("| " + " | ".join([site + n, *cells]) + " |")
    return out


def plot_cross_site(log: RunLog | PathLike, path: Path) -> Path | None:
    """``cross_site.png``: one heatmap per metric, the evaluating sites down, the global
    model, the sites' local models and (personalised) their personal models across
    (lines part them), each cell's value
    written in it, a site's own model on its own data framed; grey = undefined (AUROC of
    a site holding one class). The colour scale runs from the matrix's smallest to its
    largest value. Losses: the reversed scale (brighter = better)."""
    log = as_run_log(log)
    cs = cross_site_matrices(log)
    if cs is None:
        return None
    k, names, c = len(cs.sites), list(cs.matrices), len(cs.models)
    cols = 1 if len(names) == 1 else 2
    rows = math.ceil(len(names) / cols)
    cell = 0.55 if k <= 12 else 0.25
    fig = canvas.figure(min(22, cols * (2.8 + cell * c)), min(30, rows * (2.2 + cell * k)))
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for ax, name in zip(axes, names):
        a = cs.matrices[name]
        loss = name.endswith("loss")
        # the colours span the matrix's own range: a fixed 0-1 scale paints 0.90-1.00 one colour
        finite = a[np.isfinite(a)]
        im = ax.imshow(canvas.masked(a), aspect="auto", interpolation="nearest",
                       cmap=canvas.colormap("viridis_r" if loss else "viridis"),
                       **({"vmin": float(finite.min()), "vmax": float(finite.max())}
                          if finite.size else {}))
        if k <= 12:
            lo, hi = im.get_clim()
            for (i, j), v in np.ndenumerate(a):
                if math.isfinite(v):
                    light = (v - lo) / (hi - lo) if hi > lo else 0.5
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="black" if (light > 0.6) != loss else "white")
        for i, own in enumerate(_own_columns(k, c)):   # a site's own models on its own data
            for j in own:
                ax.add_patch(canvas.mpl().patches.Rectangle((j - 0.5, i - 0.5), 1, 1,
                                                            fill=False, edgecolor="red", lw=1.5))
        for x in range(0, c - 1, k):
            ax.axvline(x + 0.5, color="white", lw=3)
        canvas.client_ticks(ax, k, cs.sites)
        step = max(1, math.ceil(c / 25))
        ax.set_xticks(np.arange(0, c, step), [cs.models[j] for j in range(0, c, step)],
                      rotation=45, ha="right", fontsize=8)
        ax.set(xlabel="model", title=METRIC_LABELS.get(name, name)
               + (" (lower is better)" if loss else ""))
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel("held-out data of site")
        fig.colorbar(im, ax=ax, shrink=0.8)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    after = f" after {cs.rounds} rounds" if cs.rounds is not None else ""
    fig.suptitle(f"{run_title(log)}: cross-site validation{after}\n"
                 "red frame = a site's own model on its own data; grey = undefined")
    return canvas.save(fig, path)
