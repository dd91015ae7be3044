"""Per-round curves of model quality: ``accuracy.png`` (test accuracy, test/train
loss), ``metrics.png`` (every ``eval.metrics`` entry, per-site curves and their
spread) and ``level_accuracy.png`` (each submodel level, FedLAGC)."""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np

from fedmpi.compare.runs import config_value
from fedmpi.log.schema import PathLike
from fedmpi.log.reader import RunLog, as_run_log

from fedmpi.report import canvas
from fedmpi.report.derived import (METRIC_LABELS, level_labels, logged_array, metric_names,
    run_components, run_title, site_labels)

__all__ = ["MAX_SITE_CURVES", "plot_accuracy", "plot_level_accuracy", "plot_metrics"]


def plot_accuracy(log: RunLog | PathLike, path: Path,
                  target: float | None = None) -> Path | None:
    """Test accuracy and losses vs round; the best round is marked."""
    log = as_run_log(log)
    r = log.rounds.get("round")
    acc = log.rounds.get("test_accuracy")
    if r is None or acc is None or not np.isfinite(acc).any():
        return None
    fig = canvas.figure(10, 4)
    ax_acc, ax_loss = fig.subplots(1, 2)
    ok = np.isfinite(acc)
    ax_acc.plot(r[ok], 100 * acc[ok], marker="o" if ok.sum() <= 60 else None, ms=3,
                color="C0", label="test accuracy")
    best = np.flatnonzero(ok)[np.argmax(acc[ok])]
    ax_acc.plot([r[best]], [100 * acc[best]], "*", ms=12, color="C3",
                label=f"best {100 * acc[best]:.2f}% (round {r[best]})")
    if target is not None:
        ax_acc.axhline(100 * target, ls="--", color="0.4", lw=1,
                       label=f"target {100 * target:.2f}%")
    ax_acc.set(xlabel="round", ylabel="test accuracy (%)", title="Test accuracy")
    canvas.round_axis(ax_acc)
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(loc="lower right", fontsize=8)

    plotted = []
    for name, style in (("test_loss", "C0"), ("train_loss", "C1")):
        v = log.rounds.get(name)
        if v is None:
            continue
        good = np.isfinite(v)
        if good.any():
            ax_loss.plot(r[good], v[good], color=style, marker="o" if good.sum() <= 60 else None,
                         ms=3, label=name.replace("_", " "))
            plotted.append(v[good])
    if plotted:
        allv = np.concatenate(plotted)
        if (allv > 0).all() and allv.max() / allv.min() > 10:
            ax_loss.set_yscale("log")
        ax_loss.legend(fontsize=8)
    ax_loss.set(xlabel="round", ylabel="cross-entropy loss", title="Loss")
    canvas.round_axis(ax_loss)
    ax_loss.grid(alpha=0.3, which="both")
    fig.suptitle(run_title(log))
    return canvas.save(fig, path)


#: Per-site curves are drawn one by one (each in its colour, named in the legend) up to
#: this many sites; beyond it only their spread is drawn.
MAX_SITE_CURVES = 10


def plot_metrics(log: RunLog | PathLike, path: Path) -> Path | None:
    """One panel per chosen metric vs round, with the per-site curves and their spread when
    the clients evaluated (``/clients/<metric>`` [R, K]); written when there is more to show
    than ``accuracy.png`` (another metric, or per-site values). Each site's curve has its
    own colour and its site's name (:func:`~fedmpi.report.derived.site_labels`) in the
    figure's legend, shared by every panel."""
    log = as_run_log(log)
    from fedmpi.metrics import metric_name, score_metrics

    r = log.rounds.get("round")
    names = [n for n in metric_names(log) if n in log.rounds and np.isfinite(log.rounds[n]).any()
             or f"clients_{n}" in log.rounds]
    sites = {n: log.clients[n] for n in names
             if n in log.clients and np.ndim(log.clients[n]) == 2 and np.isfinite(log.clients[n]).any()}
    if r is None or not names or (len(names) == 1 and not sites):
        return None
    where = str(config_value(log.config, "eval.where", "server"))
    scored = {n for n in names if n == "auroc" or n not in METRIC_LABELS} | {
        metric_name(m) for m in score_metrics(config_value(log.config, "eval.metrics", None) or [])}
    labels = site_labels(log)
    colors = canvas.mpl().colormaps["tab10"]
    cols = min(len(names), 3)
    rows = math.ceil(len(names) / cols)
    fig = canvas.figure(4.2 * cols + 0.5, 3.4 * rows + 1.6)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False).ravel())
    legend: dict[str, object] = {}
    for ax, name in zip(axes, names):
        # pooled (exact) solid, n-weighted mean dotted, the server's test set dashed: one
        # legend serves every panel
        combined = (("sites combined: n-weighted mean", ":") if name in scored
                    else ("sites combined: pooled (exact)", "-"))
        if where == "both":
            curves = [(name, "server test set", "--"), (f"clients_{name}", *combined)]
        else:
            curves = [(name, *(("server test set", "-") if where == "server" else combined))]
        per_site = sites.get(name)
        if per_site is not None:
            k = per_site.shape[1]
            ok = np.isfinite(per_site).any(1)
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                q = np.nanpercentile(per_site[ok], [0, 25, 75, 100], axis=1)
            ax.fill_between(r[ok], q[0], q[3], color="0.55", alpha=0.15, lw=0,
                            label=f"{k} sites: min–max")
            ax.fill_between(r[ok], q[1], q[2], color="0.55", alpha=0.3, lw=0,
                            label="sites: 25–75 %")
            if k <= MAX_SITE_CURVES:
                for j in range(k):
                    good = np.isfinite(per_site[:, j])
                    ax.plot(r[good], per_site[good, j], color=colors(j), lw=1.1, alpha=0.9,
                            marker="." if good.sum() <= 40 else None, ms=3, label=labels[j])
        for key, label, style in curves:
            v = log.rounds.get(key)
            if v is None or not np.isfinite(v).any():
                continue
            good = np.isfinite(v)
            ax.plot(r[good], v[good], color="black", ls=style, lw=2.2,
                    marker="o" if good.sum() <= 40 else None, ms=3, label=label)
        ax.set(xlabel="round", ylabel=METRIC_LABELS.get(name, name),
               title=METRIC_LABELS.get(name, name))
        canvas.round_axis(ax)
        ax.grid(alpha=0.3)
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    if legend:
        fig.legend(list(legend.values()), list(legend.keys()), loc="outside lower center",
                   ncol=min(len(legend), 4), fontsize=8, frameon=False)
    fig.suptitle(f"{run_title(log)}: test metrics\n{run_components(log)}", fontsize=10)
    return canvas.save(fig, path)


def plot_level_accuracy(log: RunLog | PathLike, path: Path) -> Path | None:
    """Test accuracy of each submodel level vs round (FedLAGC)."""
    log = as_run_log(log)
    found = logged_array(log, "submodel/level_accuracy", 2)
    if found is None:
        return None
    la, r = found
    labels = level_labels(log, la.shape[1])
    fig = canvas.figure(7, 4.5)
    ax = fig.subplots()
    cmap = canvas.mpl().colormaps["viridis"]
    for v in range(la.shape[1]):
        ok = np.isfinite(la[:, v])
        ax.plot(r[ok], 100 * la[ok, v], marker="o" if ok.sum() <= 60 else None, ms=3,
                color=cmap(0.85 * v / max(1, la.shape[1] - 1)), label=labels[v])
    acc = log.rounds.get("test_accuracy")
    if acc is not None and np.isfinite(acc).any():
        ok = np.isfinite(acc)
        ax.plot(r[ok], 100 * acc[ok], ls="--", color="0.3", label="global model")
    ax.set(xlabel="round", ylabel="test accuracy (%)", title="Accuracy per submodel level")
    canvas.round_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(run_title(log))
    return canvas.save(fig, path)
