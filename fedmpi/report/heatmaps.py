"""Clients × something heatmaps: ``client_weights.png`` (aggregation weights, FedVG
Fig. 8), ``fedvg_grad_norm.png`` (per-layer validation-gradient norms, FedVG
Fig. A.1) and ``partition.png`` (class counts and client sizes, FedVG Fig. A.2)."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from fedmpi.compare.runs import config_value
from fedmpi.log.schema import PathLike
from fedmpi.log.reader import RunLog, as_run_log

from fedmpi.report import canvas
from fedmpi.report.derived import logged_array, run_title, site_labels

__all__ = ["plot_client_weights", "plot_grad_norm", "plot_partition"]


def plot_client_weights(log: RunLog | PathLike, path: Path) -> Path | None:
    """Heatmap of the aggregation weights, clients x rounds (FedVG Fig. 8)."""
    log = as_run_log(log)
    w = log.clients.get("weight")
    r = log.rounds.get("round")
    if w is None or r is None or w.size == 0 or not np.isfinite(w).any():
        return None
    k = w.shape[1]
    fig = canvas.figure(min(14, 6.5 + 0.12 * len(r)), min(10, 2.5 + 0.3 * k))
    ax = fig.subplots()
    extent = (r[0] - 0.5, r[-1] + 0.5, k - 0.5, -0.5)
    im = ax.imshow(canvas.masked(w.T), aspect="auto", interpolation="nearest",
                   cmap=canvas.colormap("viridis"), extent=extent, vmin=0.0)
    fig.colorbar(im, ax=ax, label="aggregation weight $s_k$")
    exc = log.clients.get("excluded")
    if exc is not None and exc.any():
        rr, kk = np.nonzero(exc)
        ax.plot(r[rr], kk, "x", color="red", ms=6, mew=1.5, label="update excluded")
        ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
    canvas.client_ticks(ax, k, site_labels(log))
    ax.set(xlabel="round", ylabel="site")
    canvas.round_axis(ax)
    ax.set_title(f"{run_title(log)}: aggregation weights ({_weighting(log)} weighting)\n"
                 "grey = client not selected", fontsize=10)
    return canvas.save(fig, path)


def _weighting(log: RunLog) -> str:
    return str(config_value(log.config, "aggregation.weighting", "samples"))


def plot_grad_norm(log: RunLog | PathLike, path: Path) -> Path | None:
    """Per-client, per-layer validation-gradient norms at two rounds (FedVG Fig. A.1)."""
    log = as_run_log(log)
    found = logged_array(log, "fedvg/grad_norm", 3)
    if found is None:
        return None
    g, r = found
    n_layers = g.shape[2]
    stored = log.arrays.get("fedvg/layer_names")
    names = ([str(s) for s in stored] if stored is not None and len(stored) == n_layers
             else [f"layer {i}" for i in range(n_layers)])
    rows = [i for i in range(g.shape[0]) if np.isfinite(g[i]).any()]
    shown = sorted({rows[0], rows[-1]})
    finite = g[shown][np.isfinite(g[shown])]
    mcolors = canvas.mpl().colors
    norm = (mcolors.LogNorm(vmin=finite.min(), vmax=finite.max())
            if (finite > 0).all() and finite.max() > finite.min() else None)
    k = g.shape[1]
    fig = canvas.figure(min(16, 3 + 0.35 * n_layers * len(shown) + 1.5),
                        min(10, 2.5 + 0.3 * k))
    axes = np.atleast_1d(fig.subplots(1, len(shown), sharey=True, squeeze=False)[0])
    im = None
    for ax, i in zip(axes, shown):
        im = ax.imshow(canvas.masked(g[i]), aspect="auto", interpolation="nearest",
                       cmap=canvas.colormap("magma"), norm=norm)
        step = max(1, math.ceil(n_layers / 30))
        ax.set_xticks(np.arange(0, n_layers, step))
        ax.set_xticklabels(names[::step], rotation=90, fontsize=7)
        canvas.client_ticks(ax, k, site_labels(log))
        ax.set(title=f"round {r[i]}", xlabel="layer")
    axes[0].set_ylabel("site")
    fig.colorbar(im, ax=list(axes), label="validation-gradient norm" + (" (log)" if norm else ""))
    fig.suptitle(f"{run_title(log)}: per-layer gradient norms (grey = not selected)")
    return canvas.save(fig, path)


def plot_partition(class_counts: np.ndarray, path: str | os.PathLike, title: str = "",
                   class_names: Sequence[str] | None = None,
                   site_names: Sequence[str] | None = None) -> Path:
    """Class counts of every client (heatmap, FedVG Fig. A.2) and client sizes (bars);
    the client axis labelled with ``site_names`` where given.

    Used by ``fedmpi report`` (from ``/partition/class_counts``) and by
    ``fedmpi partition`` (from the config, without training).
    """
    counts = np.asarray(class_counts, dtype=np.int64)
    k, c = counts.shape
    fig = canvas.figure(min(14, 5 + 0.35 * c), min(12, 2 + 0.28 * k))
    ax_h, ax_b = fig.subplots(1, 2, sharey=True, width_ratios=(max(c, 3), 3))
    im = ax_h.imshow(counts, aspect="auto", interpolation="nearest", cmap="Blues")
    if k * c <= 400:
        vmax = counts.max() if counts.size else 0
        for (i, j), v in np.ndenumerate(counts):
            if v:
                ax_h.text(j, i, str(v), ha="center", va="center", fontsize=7,
                          color="white" if v > 0.6 * vmax else "black")
    step = max(1, math.ceil(c / 40))
    ax_h.set_xticks(np.arange(0, c, step))
    if class_names is not None:
        ax_h.set_xticklabels(list(class_names)[::step], rotation=90, fontsize=7)
    canvas.client_ticks(ax_h, k, list(site_names) if site_names is not None else None)
    ax_h.set(xlabel="class", ylabel="site" if site_names is not None else "client",
             title="Samples per class")
    fig.colorbar(im, ax=ax_h, label="samples of the class", location="bottom", shrink=0.6,
                 aspect=40)
    sizes = counts.sum(axis=1)
    ax_b.barh(np.arange(k), sizes, color="C0")
    if k <= 40:
        for i, v in enumerate(sizes):
            ax_b.text(v, i, f" {v}", va="center", fontsize=7)
    ax_b.set_xlim(0, 1.25 * max(int(sizes.max()) if k else 1, 1))
    ax_b.set(xlabel="samples", title="Client size")
    ax_b.set_axisbelow(True)
    ax_b.grid(axis="x", alpha=0.3)
    ax_b.set_ylim(k - 0.5, -0.5)
    fig.suptitle(title or f"Partition: {k} clients, {c} classes, {int(sizes.sum())} samples")
    return canvas.save(fig, Path(path))
