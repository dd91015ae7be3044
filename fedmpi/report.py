r"""``fedmpi report``: PNG plots and ``summary.md`` from one run log.

Plots (each written only when the log holds the data it needs; rounds on the
x axis are the round numbers of the log, counted from 0):

=========================  =====================================================
``accuracy.png``           test accuracy (%) and test/train loss vs round
``metrics.png``            one panel per ``eval.metrics`` entry (accuracy,
                           balanced accuracy, macro-F1, AUROC, user metrics) vs
                           round; with per-site evaluation (``eval.where``) also
                           each site's curve (up to 10 sites), the spread across
                           sites (min–max band, interquartile band) and, with
                           ``both``, the server's and the sites' combined value
``client_weights.png``     aggregation weight :math:`s_k` of every client in every
                           round (FedVG paper Fig. 8); grey = not selected,
                           red x = update excluded
``fedvg_grad_norm.png``    per-client, per-layer validation-gradient norms
                           :math:`\|g_{k,l}\|` at the first and the last round
                           logged (FedVG paper Fig. A.1), log colour scale;
                           needs ``/fedvg/grad_norm`` [R, K, L]
``partition.png``          class counts per client and client sizes
                           (FedVG paper Fig. A.2); also ``fedmpi partition``
``level_accuracy.png``     test accuracy of every submodel level vs round
                           (FedLAGC); needs ``/submodel/level_accuracy`` [R, V]
``time_per_round.png``     wall time per round split into local training,
                           communication + other, aggregation, evaluation
``bytes_per_round.png``    bytes sent per round, uplink and downlink in separate
                           panels on one scale, and the cumulative traffic
=========================  =====================================================

The time split (:func:`time_split`) uses the log's ``train_seconds`` (slowest
worker), ``aggregate_seconds``, ``overhead_seconds`` and ``eval_seconds``. The
runtime logs ``overhead = wall − train − aggregate − (evaluation inside the
round)``; with ``eval.overlap`` round t is evaluated while the workers train
round t + 1, outside round t's wall time, so the evaluation inside the round is
``wall − train − aggregate − overhead`` (0 for an overlapped round) and the rest
of ``eval_seconds`` is reported apart: the in-round parts add up to 100 % of
the wall time.

Rounds: "round t" is always the log's ``/rounds/round`` index, counted from 0
(as in ``fedmpi compare``, the events and the plots' x axes); counts of rounds
("rounds to target", the progress bar) are numbers of completed rounds, so a
target first met in round t took t + 1 rounds.

Matplotlib is imported lazily (the ``plot`` extra) and used through
:class:`matplotlib.figure.Figure` with the Agg canvas only, so the module never
touches pyplot's global backend (safe inside notebooks and on headless nodes).

Longer than ~350 lines: one command's summary and plots; the plotting helpers are used nowhere else.
"""
from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedmpi.compare import config_value, flatten_config, is_percent, run_config, run_metrics
from fedmpi.errors import UserError
from fedmpi.log import PathLike, RunLog, as_run_log, read
from fedmpi.safefile import refuse_links, replacing, write_text

__all__ = ["PLOTS", "partition_preview", "plot_partition", "summary_markdown", "write_report"]

#: File names of the plots, in the order the summary lists them.
PLOTS: tuple[str, ...] = ("accuracy.png", "metrics.png", "client_weights.png", "fedvg_grad_norm.png",
                          "partition.png", "level_accuracy.png", "time_per_round.png",
                          "bytes_per_round.png")

_DPI = 120
_MAX_EVENTS = 50


#: What to do when matplotlib is missing (plots skipped, summary.md still written).
PLOT_HINT = ("plots need matplotlib, which is not installed: pip install -e '.[plot]' "
             "(or pip install matplotlib), then run fedmpi report again")


def _mpl() -> Any:
    """``matplotlib`` (for ``Figure``, ``colors``), or a UserError saying how to install it."""
    try:
        import matplotlib
        import matplotlib.colors  # noqa: F401
        import matplotlib.figure  # noqa: F401
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        raise UserError(PLOT_HINT) from None
    return matplotlib


def have_matplotlib() -> bool:
    """Whether :func:`write_report` can draw the plots."""
    try:
        _mpl()
    except UserError:
        return False
    return True


def _figure(w: float, h: float):
    return _mpl().figure.Figure(figsize=(w, h), dpi=_DPI, layout="constrained")


def _save(fig, path: Path) -> Path:
    with replacing(path) as f:   # fedmpi.safefile: never through a planted link
        fig.savefig(f, format=path.suffix.lstrip(".") or "png")   # the Agg canvas, no pyplot
    return path


def _title(log: RunLog) -> str:
    """``name · algorithm[ + weighting] (log directory) [status]``."""
    name = config_value(log.config, "name", "") or ""
    algo = config_value(log.config, "algorithm.name")
    weighting = config_value(log.config, "aggregation.weighting", "samples")
    parts = [p for p in (name, algo) if p]
    text = " · ".join(parts) + (f" + {weighting}" if weighting not in (None, "samples") else "")
    folder = Path(log.path).resolve().parent.name
    if folder and folder != name:
        text += f" ({folder})"
    return text + ("" if log.status == "completed" else f" [{log.status}]")


def _client_ticks(ax, k: int, axis: str = "y") -> None:
    step = max(1, math.ceil(k / 25))
    ticks = np.arange(0, k, step)
    (ax.set_yticks if axis == "y" else ax.set_xticks)(ticks)


def _round_axis(ax) -> None:
    """Integer ticks on the round (x) axis."""
    ax.xaxis.set_major_locator(_mpl().ticker.MaxNLocator(integer=True))


def _masked(a: np.ndarray) -> np.ma.MaskedArray:
    return np.ma.masked_invalid(np.asarray(a, dtype=np.float64))


def _cmap(name: str):
    return _mpl().colormaps[name].with_extremes(bad="#d9d9d9")


# -- individual plots ---------------------------------------------------------------

def plot_accuracy(log: RunLog | PathLike, path: Path,
                  target: float | None = None) -> Path | None:
    """Test accuracy and losses vs round; the best round is marked."""
    log = as_run_log(log)
    r = log.rounds.get("round")
    acc = log.rounds.get("test_accuracy")
    if r is None or acc is None or not np.isfinite(acc).any():
        return None
    fig = _figure(10, 4)
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
    _round_axis(ax_acc)
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
    _round_axis(ax_loss)
    ax_loss.grid(alpha=0.3, which="both")
    fig.suptitle(_title(log))
    return _save(fig, path)


_METRIC_LABELS = {"test_accuracy": "accuracy", "balanced_accuracy": "balanced accuracy",
                  "macro_f1": "macro-F1", "auroc": "AUROC"}


def _components(log: RunLog) -> str:
    """What the run is made of, for plot subtitles: data, model, method, optimizer,
    partition, clients and where it was evaluated."""
    c = log.config
    get = lambda key, default=None: config_value(c, key, default)  # noqa: E731
    method = str(get("algorithm.name", "?"))
    weighting = get("aggregation.weighting", "samples")
    part = str(get("data.partition.method", "?"))
    if part == "dirichlet":
        part += f" α={get('data.partition.alpha')}"
    opt = str(get("train.optimizer", "sgd"))
    where = {"server": "server test set", "clients": "clients' held-out data",
             "both": "server test set + clients' held-out data"}[str(get("eval.where", "server"))]
    data = (f"silos {get('data.silos.path') or get('data.silos.loader')}" if part == "silos"
            else get("data.dataset", "?"))   # a silo run's data.dataset is an unused default
    return (f"{data} · {get('model.name', '?')} · {method}"
            f"{f' + {weighting}' if weighting not in (None, 'samples') else ''} · "
            f"{opt} lr {get('train.lr')} · {part}, {get('data.num_clients')} clients · "
            f"evaluated on the {where}")


def _metric_names(log: RunLog) -> list[str]:
    """The ``/rounds`` names of the run's ``eval.metrics`` (accuracy is ``test_accuracy``)."""
    from .metrics import metric_name

    chosen = config_value(log.config, "eval.metrics", None) or ["accuracy"]
    return ["test_accuracy" if m == "accuracy" else metric_name(m) for m in chosen]


def plot_metrics(log: RunLog | PathLike, path: Path) -> Path | None:
    """One panel per chosen metric vs round, with the per-site curves and their spread when
    the clients evaluated (``/clients/<metric>`` [R, K]); written when there is more to show
    than ``accuracy.png`` (another metric, or per-site values)."""
    log = as_run_log(log)
    from .metrics import is_user_metric

    r = log.rounds.get("round")
    names = [n for n in _metric_names(log) if n in log.rounds and np.isfinite(log.rounds[n]).any()
             or f"clients_{n}" in log.rounds]
    sites = {n: log.clients[n] for n in names
             if n in log.clients and np.ndim(log.clients[n]) == 2 and np.isfinite(log.clients[n]).any()}
    if r is None or not names or (len(names) == 1 and not sites):
        return None
    where = str(config_value(log.config, "eval.where", "server"))
    scored = {n for n in names if n == "auroc" or n not in _METRIC_LABELS} | {
        m.rsplit(":", 1)[-1] for m in (config_value(log.config, "eval.metrics", None) or [])
        if is_user_metric(m)}
    cols = min(len(names), 3)
    rows = math.ceil(len(names) / cols)
    fig = _figure(4.2 * cols + 0.5, 3.4 * rows + 0.9)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax, name in zip(axes, names):
        combined = ("sites: n-weighted mean" if name in scored else "sites pooled (exact)")
        curves = []
        if where == "both":
            curves = [(name, "server test set", "C0"), (f"clients_{name}", combined, "C3")]
        else:
            curves = [(name, "server test set" if where == "server" else combined,
                       "C0" if where == "server" else "C3")]
        per_site = sites.get(name)
        if per_site is not None:
            k = per_site.shape[1]
            ok = np.isfinite(per_site).any(1)
            with np.errstate(all="ignore"), __import__("warnings").catch_warnings():
                __import__("warnings").simplefilter("ignore", RuntimeWarning)
                q = np.nanpercentile(per_site[ok], [0, 25, 75, 100], axis=1)
            ax.fill_between(r[ok], q[0], q[3], color="C3", alpha=0.12,
                            label=f"{k} sites: min–max")
            ax.fill_between(r[ok], q[1], q[2], color="C3", alpha=0.25, label="sites: 25–75 %")
            if k <= 10:
                for j in range(k):
                    good = np.isfinite(per_site[:, j])
                    ax.plot(r[good], per_site[good, j], color="C3", lw=0.6, alpha=0.5,
                            label="each site" if j == 0 else None)
        for key, label, color in curves:
            v = log.rounds.get(key)
            if v is None or not np.isfinite(v).any():
                continue
            good = np.isfinite(v)
            ax.plot(r[good], v[good], color=color, lw=2, marker="o" if good.sum() <= 40 else None,
                    ms=3, label=label)
        ax.set(xlabel="round", ylabel=_METRIC_LABELS.get(name, name),
               title=_METRIC_LABELS.get(name, name))
        _round_axis(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    fig.suptitle(f"{_title(log)}: test metrics\n{_components(log)}", fontsize=10)
    return _save(fig, path)


def plot_client_weights(log: RunLog | PathLike, path: Path) -> Path | None:
    """Heatmap of the aggregation weights, clients x rounds (FedVG Fig. 8)."""
    log = as_run_log(log)
    w = log.clients.get("weight")
    r = log.rounds.get("round")
    if w is None or r is None or w.size == 0 or not np.isfinite(w).any():
        return None
    k = w.shape[1]
    fig = _figure(min(14, 6.5 + 0.12 * len(r)), min(10, 2.5 + 0.3 * k))
    ax = fig.subplots()
    extent = (r[0] - 0.5, r[-1] + 0.5, k - 0.5, -0.5)
    im = ax.imshow(_masked(w.T), aspect="auto", interpolation="nearest", cmap=_cmap("viridis"),
                   extent=extent, vmin=0.0)
    fig.colorbar(im, ax=ax, label="aggregation weight $s_k$")
    exc = log.clients.get("excluded")
    if exc is not None and exc.any():
        rr, kk = np.nonzero(exc)
        ax.plot(r[rr], kk, "x", color="red", ms=6, mew=1.5, label="update excluded")
        ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
    _client_ticks(ax, k)
    ax.set(xlabel="round", ylabel="client")
    _round_axis(ax)
    ax.set_title(f"{_title(log)}: aggregation weights ({_weighting(log)} weighting)\n"
                 "grey = client not selected", fontsize=10)
    return _save(fig, path)


def _weighting(log: RunLog) -> str:
    return str(config_value(log.config, "aggregation.weighting", "samples"))


def plot_grad_norm(log: RunLog | PathLike, path: Path) -> Path | None:
    """Per-client, per-layer validation-gradient norms at two rounds (FedVG Fig. A.1)."""
    log = as_run_log(log)
    g = log.arrays.get("fedvg/grad_norm")
    r = log.rounds.get("round")
    if g is None or r is None or g.ndim != 3 or not np.isfinite(g).any():
        return None
    n_layers = g.shape[2]
    stored = log.arrays.get("fedvg/layer_names")
    names = ([str(s) for s in stored] if stored is not None and len(stored) == n_layers
             else [f"layer {i}" for i in range(n_layers)])
    rows = [i for i in range(g.shape[0]) if np.isfinite(g[i]).any()]
    shown = sorted({rows[0], rows[-1]})
    finite = g[shown][np.isfinite(g[shown])]
    mcolors = _mpl().colors
    norm = (mcolors.LogNorm(vmin=finite.min(), vmax=finite.max())
            if (finite > 0).all() and finite.max() > finite.min() else None)
    k = g.shape[1]
    fig = _figure(min(16, 3 + 0.35 * n_layers * len(shown) + 1.5), min(10, 2.5 + 0.3 * k))
    axes = np.atleast_1d(fig.subplots(1, len(shown), sharey=True, squeeze=False)[0])
    im = None
    for ax, i in zip(axes, shown):
        im = ax.imshow(_masked(g[i]), aspect="auto", interpolation="nearest",
                       cmap=_cmap("magma"), norm=norm)
        step = max(1, math.ceil(n_layers / 30))
        ax.set_xticks(np.arange(0, n_layers, step))
        ax.set_xticklabels(names[::step], rotation=90, fontsize=7)
        _client_ticks(ax, k)
        ax.set(title=f"round {r[i]}", xlabel="layer")
    axes[0].set_ylabel("client")
    fig.colorbar(im, ax=list(axes), label="validation-gradient norm" + (" (log)" if norm else ""))
    fig.suptitle(f"{_title(log)}: per-layer gradient norms (grey = not selected)")
    return _save(fig, path)


def plot_partition(class_counts: np.ndarray, path: str | os.PathLike, title: str = "",
                   class_names: Sequence[str] | None = None) -> Path:
    """Class counts of every client (heatmap, FedVG Fig. A.2) and client sizes (bars).

    Used by ``fedmpi report`` (from ``/partition/class_counts``) and by
    ``fedmpi partition`` (from the config, without training).
    """
    counts = np.asarray(class_counts, dtype=np.int64)
    k, c = counts.shape
    fig = _figure(min(14, 5 + 0.35 * c), min(12, 2 + 0.28 * k))
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
    _client_ticks(ax_h, k)
    ax_h.set(xlabel="class", ylabel="client", title="Samples per class")
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
    return _save(fig, Path(path))


def plot_level_accuracy(log: RunLog | PathLike, path: Path) -> Path | None:
    """Test accuracy of each submodel level vs round (FedLAGC)."""
    log = as_run_log(log)
    la = log.arrays.get("submodel/level_accuracy")
    r = log.rounds.get("round")
    if la is None or r is None or la.ndim != 2 or not np.isfinite(la).any():
        return None
    labels = _level_labels(log, la.shape[1])
    fig = _figure(7, 4.5)
    ax = fig.subplots()
    cmap = _mpl().colormaps["viridis"]
    for v in range(la.shape[1]):
        ok = np.isfinite(la[:, v])
        ax.plot(r[ok], 100 * la[ok, v], marker="o" if ok.sum() <= 60 else None, ms=3,
                color=cmap(0.85 * v / max(1, la.shape[1] - 1)), label=labels[v])
    acc = log.rounds.get("test_accuracy")
    if acc is not None and np.isfinite(acc).any():
        ok = np.isfinite(acc)
        ax.plot(r[ok], 100 * acc[ok], ls="--", color="0.3", label="global model")
    ax.set(xlabel="round", ylabel="test accuracy (%)", title="Accuracy per submodel level")
    _round_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(_title(log))
    return _save(fig, path)


def _level_labels(log: RunLog, n: int) -> list[str]:
    """``level i (size 1/4)`` from ``/submodel/levels`` (model-size ratios), else ``level i``."""
    from fractions import Fraction

    levels = log.arrays.get("submodel/levels")
    if levels is None or len(levels) != n:
        return [f"level {i}" for i in range(n)]
    return [f"level {i} (size {Fraction(float(v)).limit_denominator(4096)})"
            for i, v in enumerate(np.asarray(levels, dtype=float))]


_TIME_PARTS = (("train_seconds", "local training (slowest worker)", "C0"),
               ("overhead_seconds", "communication + other", "C1"),
               ("aggregate_seconds", "aggregation", "C2"),
               ("eval_seconds", "evaluation", "C3"))
_OVERLAPPED = "evaluation overlapped with the next round's training (not in the wall time)"


def time_split(log: RunLog | PathLike) -> dict[str, np.ndarray]:
    """Per-round seconds: the :data:`_TIME_PARTS` present in the log, with
    ``eval_seconds`` cut to its part inside the round's wall time, plus
    ``eval_overlapped`` (the rest) and ``wall_seconds``. NaN counts as 0.

    In-round evaluation = clip(wall − train − aggregate − overhead, 0, eval): the
    runtime computes overhead as the remainder of the wall time with the in-round
    evaluation only, so the in-round parts sum to the wall time.
    """
    log = as_run_log(log)
    parts = {name: np.nan_to_num(np.asarray(log.rounds[name], dtype=np.float64))
             for name, _, _ in _TIME_PARTS if name in log.rounds}
    if "wall_seconds" in log.rounds:
        wall = np.nan_to_num(np.asarray(log.rounds["wall_seconds"], dtype=np.float64))
        parts["wall_seconds"] = wall
        if "eval_seconds" in parts and {"train_seconds", "aggregate_seconds",
                                        "overhead_seconds"} <= parts.keys():
            rest = wall - parts["train_seconds"] - parts["aggregate_seconds"] \
                - parts["overhead_seconds"]
            inside = np.clip(rest, 0.0, parts["eval_seconds"])
            parts["eval_overlapped"] = parts["eval_seconds"] - inside
            parts["eval_seconds"] = inside
    return parts


def plot_time(log: RunLog | PathLike, path: Path) -> Path | None:
    """Stacked bars: time per round split into training/communication/aggregation/evaluation
    (inside the round); an overlapped evaluation is drawn hatched on top."""
    log = as_run_log(log)
    r = log.rounds.get("round")
    if r is None or len(r) == 0:
        return None
    split = time_split(log)
    parts = [(name, label, color) for name, label, color in _TIME_PARTS if name in split]
    wall = log.rounds.get("wall_seconds")
    if not parts and wall is None:
        return None
    fig = _figure(min(14, 6 + 0.08 * len(r)), 5)
    ax = fig.subplots()
    bottom = np.zeros(len(r))
    width = 0.85 if len(r) < 200 else 1.0
    for name, label, color in parts:
        v = split[name]
        ax.bar(r, v, bottom=bottom, width=width, color=color,
               label=f"{label}{' (in the round)' if name == 'eval_seconds' else ''}: "
                     f"mean {_seconds(v.mean())}")
        bottom += v
    over = split.get("eval_overlapped")
    if over is not None and over.any():
        ax.bar(r, over, bottom=bottom, width=width, color="none", edgecolor="C3", hatch="//",
               label=f"{_OVERLAPPED}: mean {_seconds(over.mean())}")
    if wall is not None:
        ax.plot(r, wall, "k_" if len(r) <= 60 else "k-", ms=10, lw=0.8,
                label=f"wall time: mean {_seconds(np.nanmean(wall))}")
    ax.set(xlabel="round", ylabel="seconds", title="Time per round")
    _round_axis(ax)
    ax.set_axisbelow(True)
    ax.grid(axis="y", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=8)
    fig.suptitle(_title(log))
    return _save(fig, path)


def _seconds(x: float) -> str:
    if not math.isfinite(x):
        return "—"
    return f"{x:.3g} s" if x >= 1 else f"{1e3 * x:.3g} ms"


_LINKS = {"bytes_up": ("uplink (clients → server)", "C0"),
          "bytes_down": ("downlink (server → clients)", "C1")}


def plot_bytes(log: RunLog | PathLike, path: Path) -> Path | None:
    """Bytes per round, uplink and downlink each in its own panel (one shared scale, so
    equal traffic — FedAvg sends θ down and Δ up — is two visible, equal bar rows, not one
    line hiding the other), and the cumulative traffic; equal series are drawn once and
    labelled so."""
    log = as_run_log(log)
    r = log.rounds.get("round")
    series = [(n, np.asarray(log.rounds[n], dtype=np.float64)) for n in _LINKS
              if n in log.rounds]
    if r is None or len(r) == 0 or not series:
        return None
    unit, scale = _byte_unit(max(float(np.max(v)) for _, v in series))
    cum_unit, cum_scale = _byte_unit(max(float(np.sum(v)) for _, v in series))
    fig = _figure(11, 4.6)
    grid = fig.add_gridspec(len(series), 2)
    per = [fig.add_subplot(grid[i, 0]) for i in range(len(series))]
    for ax in per[1:]:
        ax.sharex(per[0])
        ax.sharey(per[0])
    ax_c = fig.add_subplot(grid[:, 1])
    width = 0.8 if len(r) < 200 else 1.0
    for ax, (name, v) in zip(per, series):
        label, color = _LINKS[name]
        ax.bar(r, v / scale, width=width, color=color)
        ax.set_title(f"{label}: mean {np.mean(v) / scale:.3g} {unit} per round", fontsize=9)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        _round_axis(ax)
        ax.set_axisbelow(True)
        ax.grid(axis="y", alpha=0.3)
    per[-1].set_xlabel("round")
    equal = len(series) == 2 and np.array_equal(series[0][1], series[1][1])
    drawn = series[:1] if equal else series
    for i, (name, v) in enumerate(drawn):
        label, color = _LINKS[name]
        if equal:
            label = "uplink = downlink (each)"
        ax_c.plot(r, np.cumsum(v) / cum_scale, color=color, lw=2, ls="-" if i == 0 else "--",
                  marker=("o" if i == 0 else "s") if len(r) <= 40 else None, ms=3,
                  label=f"{label}: {np.sum(v) / cum_scale:.3g} {cum_unit}")
    if len(series) == 2:
        total = series[0][1] + series[1][1]
        ax_c.plot(r, np.cumsum(total) / cum_scale, color="0.35", lw=1, ls=":",
                  label=f"both directions: {np.sum(total) / cum_scale:.3g} {cum_unit}")
    ax_c.set(xlabel="round", ylabel=cum_unit, title="Cumulative bytes")
    ax_c.set_ylim(bottom=0)
    _round_axis(ax_c)
    ax_c.grid(alpha=0.3)
    ax_c.legend(fontsize=8)
    fig.suptitle(f"{_title(log)}: bytes sent per round\n{_components(log)}", fontsize=10)
    return _save(fig, path)


def _byte_unit(x: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10)):
        if x >= scale:
            return unit, scale
    return "bytes", 1.0


# -- summary --------------------------------------------------------------------------

#: Config keys listed in the summary of every run (when present in the log's config).
DIGEST_KEYS: tuple[str, ...] = (
    "seed", "data.dataset", "data.num_clients", "data.partition.method", "data.partition.alpha",
    "data.partition.classes_per_client", "data.silos.path", "data.silos.loader", "data.silos.test",
    "data.silos.validation", "data.validation.fraction", "model.name", "model.mlp.hidden",
    "model.norm",
    "algorithm.name", "aggregation.weighting", "ecgr.enabled", "train.rounds",
    "train.clients_per_round", "train.local_epochs", "train.local_steps", "train.batch_size",
    "train.lr", "train.momentum", "train.weight_decay", "train.grad_clip", "eval.every")

def relevant_keys(flat: dict[str, Any]) -> list[str]:
    """The config keys that matter for this run, in summary order: :data:`DIGEST_KEYS`,
    ``algorithm.server_lr``, the parameter blocks the method declares
    (``Algorithm.params``: ``algorithm.<group>.*``, e.g. ``algorithm.fedprox.*``) or that
    carry its name, in logs of earlier versions the flat keys that became them (e.g.
    ``algorithm.mu``), the resource levels (``system.*``, with ``algorithm.submodel.*``);
    then FedVG's keys with FedVG weighting, ECGR's when
    enabled, the lr schedule when it decays, the adversary when there is one. Unset
    (None) values and partition parameters of other partition methods are left out."""
    from fedmpi.algorithms import ALGORITHMS
    from fedmpi.config import renamed_to

    def under(*prefixes: str) -> list[str]:
        return [k for k in flat if any(k == p or (p.endswith(".") and k.startswith(p))
                                       for p in prefixes)]

    algo = str(flat.get("algorithm.name", ""))
    cls = ALGORITHMS.get(algo)
    # declared blocks, and the block named after the method (keys not yet declared as params)
    groups = tuple(f"algorithm.{g}."
                   for g in dict.fromkeys([*(cls.params if cls is not None else ()), algo,
                                           "params"]))
    if flat.get("system.levels"):      # a resource-level (submodel) run
        groups += ("algorithm.submodel.",)
    legacy = [k for k in flat if any(new.startswith(groups) for new in renamed_to(k))]
    method = flat.get("data.partition.method")
    skip = {"data.partition.alpha": method not in (None, "dirichlet"),
            "data.partition.classes_per_client": method not in (None, "shards")}
    keys = [k for k in DIGEST_KEYS if k in flat]
    keys += [*under("algorithm.server_lr", *groups), *legacy, *under("system.")]
    if flat.get("aggregation.weighting") in ("fedvg", "fedvg_avg"):
        keys += under("aggregation.fedvg.", "data.validation.")
    if flat.get("ecgr.enabled"):
        keys += under("ecgr.")
    if flat.get("train.lr_decay_every"):
        keys += under("train.lr_decay", "train.lr_decay_every")
    if flat.get("adversary.clients"):
        keys += under("adversary.")
    rule = str(flat.get("aggregation.rule", "mean"))
    if rule != "mean":
        keys += under("aggregation.rule", f"aggregation.{rule}.", "aggregation.params.")
    if flat.get("privacy.dp.level", "none") != "none":
        keys += under("privacy.")
    out: list[str] = []
    for k in keys:
        if k not in out and flat.get(k) is not None and not skip.get(k, False):
            out.append(k)
    return out


def _pct(x: float) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{100 * x:.2f}%"


def summary_markdown(log: RunLog | PathLike, target: float | None = None,
                     plots: Sequence[str] = (), plots_note: str | None = None) -> str:
    """``summary.md``: config digest, accuracies, rounds to target, timing, exclusions, events.
    ``plots_note``: why no plots were drawn (shown under "Plots")."""
    log = as_run_log(log)
    m = run_metrics(log, target)
    flat = run_config(log)   # only keys the run used: no data.dataset for a silo run
    digest = hashlib.sha256(str(log.attrs.get("config_yaml", "")).encode()).hexdigest()[:12]
    name = flat.get("name", Path(log.path).parent.name)
    out = [f"# Run report: {name}", "",
           f"- log: `{log.path}`",
           f"- status: **{log.status}**{f' ({m.note})' if m.note else ''}, {m.rounds_logged} of "
           f"{m.rounds_configured if m.rounds_configured is not None else '?'} rounds logged",
           f"- fedmpi {log.attrs.get('fedmpi_version', '?')}, world size "
           f"{log.attrs.get('world_size', '?')}"
           + (f" (resumed with world sizes {log.attrs['resumed_world_sizes']})"
              if "resumed_world_sizes" in log.attrs else ""),
           "- rounds are numbered from 0 as in the log (`/rounds/round`); \"N rounds\" "
           "counts completed rounds",
           "", "## Configuration", "",
           f"Config digest `sha256:{digest}` (of the resolved YAML stored in the log); the keys "
           "that matter for this run's method (all: `config.yaml`, or `config_yaml` in the log).",
           "", "| key | value |", "|---|---|"]
    for key in relevant_keys(flat):
        out.append(f"| {key} | {flat[key]} |")
    out += _ran_lines(log)

    out += ["", "## Results", "", "| metric | value |", "|---|---|"]
    out.append(f"| final test accuracy | {_pct(m.final_accuracy)}"
               + (f" (round {m.final_round})" if m.final_round is not None else "") + " |")
    out.append(f"| best test accuracy | {_pct(m.best_accuracy)}"
               + (f" (round {m.best_round})" if m.best_round is not None else "") + " |")
    for name, value in m.final_metrics.items():   # further eval.metrics of the log
        out.append(f"| final {name} | {_pct(value) if is_percent(name) else f'{value:.6g}'} |")
    if target is not None:
        tau = m.rounds_to_target
        out.append(f"| rounds to {_pct(target)} | "
                   + (f"{int(tau)} (first reached in round {int(tau) - 1})" if math.isfinite(tau)
                      else "not reached") + " |")
    if m.epsilon is not None:
        stop = log.attrs.get("stop_reason")
        out.append(f"| privacy: ε at δ={flat.get('privacy.dp.delta')} "
                   f"({flat.get('privacy.dp.level')} level) | {m.epsilon:.4g} after round "
                   f"{int(log.rounds['round'][-1])}" + (f"; {stop}" if stop else "") + " |")
    loss = log.rounds.get("test_loss")
    if loss is not None and np.isfinite(loss).any():
        out.append(f"| final test loss | {loss[np.isfinite(loss)][-1]:.4f} |")
    la = log.arrays.get("submodel/level_accuracy")
    if la is not None and la.ndim == 2 and np.isfinite(la).any():
        last = [np.flatnonzero(np.isfinite(la[:, v])) for v in range(la.shape[1])]
        cells = [f"{name}: {_pct(la[idx[-1], v])}" if idx.size else f"{name}: —"
                 for v, (name, idx) in enumerate(zip(_level_labels(log, la.shape[1]), last))]
        out.append(f"| final accuracy per submodel level | {'; '.join(cells)} |")
    out += _time_lines(log)
    for key, label in (("bytes_up", "uplink"), ("bytes_down", "downlink")):
        if key in log.rounds and len(log.rounds[key]):
            total = float(np.sum(log.rounds[key]))
            unit, scale = _byte_unit(total)
            out.append(f"| {label} bytes (total) | {total / scale:.3g} {unit} |")

    out += ["", "## Clients", ""]
    out += _client_lines(log)
    out += _rule_lines(log)
    out += ["", "## Events", ""]
    out += _event_lines(log)
    if plots or plots_note:
        out += ["", "## Plots", ""]
        out += [f"![{p}]({p})" for p in plots]
        out += [f"Not drawn: {plots_note}."] if plots_note else []
    if m.rounds_logged == 0:
        out.insert(5, "- **no complete round in the log** (the run stopped or is still in its "
                      "first round)")
    return "\n".join(out) + "\n"


def _params_text(blocks: Any) -> str:
    """``{block: {field: value}}`` as ``block: field=value, ...; block: ...``."""
    if not isinstance(blocks, dict):
        return ""
    return "; ".join(f"{g}: " + ", ".join(f"{k}={v}" for k, v in fields.items())
                     for g, fields in blocks.items() if isinstance(fields, dict))


def _ran_lines(log: RunLog) -> list[str]:
    """"What ran": the log's ``run_info`` (:mod:`fedmpi.provenance`) — the objects by
    built-in name or import path, the method's parameters, the silo files with SHA-256."""
    from .provenance import read_run_info

    info = read_run_info(log.attrs)
    if info is None:
        return []
    out = ["", "## What ran", "", "| part | as run |", "|---|---|"]
    model = info.get("model", {})
    out.append("| model | `{}`{} |".format(model.get("name"), "".join(
        f", {k} {v}" for k, v in model.items() if k != "name")))
    data = info.get("data", {})
    source = (f"silos `{data['silos'].get('path') or data['silos'].get('loader')}`"
              if isinstance(data.get("silos"), dict) else f"`{data.get('dataset')}`")
    out.append(f"| data | {source}, {data.get('num_clients')} clients, partition "
               f"{data.get('partition')} |")
    method = info.get("method", {})
    params = _params_text(method.get("params"))
    out.append(f"| method | `{method.get('name')}` (server_lr {method.get('server_lr')}"
               f"{'; ' + params if params else ''}) |")
    wparams = _params_text(info.get("weighting_params"))
    out.append(f"| weighting | `{info.get('weighting')}`{f' ({wparams})' if wparams else ''} |")
    rule = info.get("rule") or {}
    if rule:
        rparams = _params_text(rule.get("params"))
        out.append(f"| server rule | `{rule.get('name')}`{f' ({rparams})' if rparams else ''} |")
    tparams = info.get("transform_params") or {}
    shown = []
    for t in info.get("transforms", []):
        text = _params_text(tparams.get(t) if isinstance(tparams, dict) else None)
        shown.append(f"`{t}`{f' ({text})' if text else ''}")
    out.append(f"| transforms | {', '.join(shown) or 'none'} |")
    files = data.get("silos", {}).get("files", []) if isinstance(data.get("silos"), dict) else []
    if files:
        out += ["", "| silo file | path | SHA-256 |", "|---|---|---|"]
        out += [f"| {f.get('role')} | `{f.get('path')}` | `{f.get('sha256')}` |" for f in files]
    return out


def _time_lines(log: RunLog) -> list[str]:
    """Mean time per round and its split (:func:`time_split`); the in-round parts are
    shares of the wall time and add up to 100 %."""
    split = time_split(log) if len(log.rounds.get("round", ())) else {}
    wall = split.get("wall_seconds")
    if wall is None:
        return []
    mean_wall = float(wall.mean())
    lines = [f"| mean time per round | {mean_wall:.3f} s (total {wall.sum():.1f} s) |"]
    for key, label, _ in _TIME_PARTS:
        if key in split:
            v = float(split[key].mean())
            share = f"{100 * v / mean_wall:.1f}%" if mean_wall > 0 else "—"
            label += " (in the round)" if key == "eval_seconds" else ""
            lines.append(f"| &nbsp;&nbsp;{label} | {v:.3f} s ({share}) |")
    over = split.get("eval_overlapped")
    if over is not None and over.any():
        lines.append(f"| {_OVERLAPPED} | {over.mean():.3f} s per round |")
    return lines


def _client_lines(log: RunLog) -> list[str]:
    lines = []
    sel = log.clients.get("selected")
    exc = log.clients.get("excluded")
    n = log.clients["num_samples"]
    lines.append(f"{len(n)} clients, {int(n.sum())} training samples "
                 f"(min {int(n.min()) if len(n) else 0}, max {int(n.max()) if len(n) else 0}).")
    if sel is not None and sel.size:
        never = np.flatnonzero(~sel.any(axis=0))
        counts = sel.sum(axis=0)
        lines.append(f"Selected {counts.min()}–{counts.max()} times per client"
                     + (f"; never selected: {never.tolist()}." if never.size else "."))
    if exc is not None and exc.any():
        lines += ["", "Excluded updates (non-finite or rejected):", "",
                  "| client | times excluded | rounds |", "|---|---|---|"]
        r = log.rounds["round"]
        for k in np.flatnonzero(exc.any(axis=0)):
            rounds = r[exc[:, k]].tolist()
            shown = ", ".join(map(str, rounds[:20])) + (" …" if len(rounds) > 20 else "")
            lines.append(f"| {k} | {len(rounds)} | {shown} |")
    else:
        lines.append("No client update was excluded.")
    return lines


#: Per-client columns a server rule logs (fedmpi.algorithms.robust): what the value is, and
#: the name of a value of 0 when that means the client's update was left out.
RULE_COLUMNS: dict[str, tuple[str, str | None]] = {
    "rule/selected": ("selected (share of rounds)", "dropped"),
    "rule/trust": ("mean FLTrust trust score", "zero trust"),
    "rule/clip": ("mean clip factor", None),
    "rule/trimmed": ("mean share of coordinates trimmed", None),
    "rule/weight": ("mean geometric-median coefficient", None),
}


def _rule_lines(log: RunLog) -> list[str]:
    """``## Server rule``: per client the mean of the rule's column, and per round the
    clients a selecting rule left out (Krum's dropped clients, FLTrust's zero trust)."""
    lines: list[str] = []
    r = log.rounds.get("round", np.arange(0))
    for path, (label, zero) in RULE_COLUMNS.items():
        a = log.arrays.get(path)
        if a is None or a.ndim != 2 or not np.isfinite(a).any():
            continue
        if not lines:
            rule = config_value(log.config, "aggregation.rule", "mean")
            lines += ["", f"## Server rule ({rule})", ""]
        seen = np.isfinite(a)
        mean = np.where(seen.any(0), np.nansum(a, 0) / np.maximum(seen.sum(0), 1), np.nan)
        lines += [f"| client | rounds seen | {label} |", "|---|---|---|"]
        lines += [f"| {k} | {int(seen[:, k].sum())} | {mean[k]:.3g} |"
                  for k in range(a.shape[1]) if seen[:, k].any()]
        if zero is None:
            continue
        left_out = [(int(r[i]) if i < len(r) else i, np.flatnonzero(seen[i] & (a[i] == 0)))
                    for i in range(a.shape[0])]
        left_out = [(t, ks) for t, ks in left_out if ks.size]
        lines += ["", f"Clients {zero} per round:", "", f"| round | {zero} |", "|---|---|"]
        lines += [f"| {t} | {', '.join(map(str, ks.tolist()))} |" for t, ks in left_out[:_MAX_EVENTS]]
        if not left_out:
            lines.append("| — | none |")
        elif len(left_out) > _MAX_EVENTS:
            lines.append(f"\n… {len(left_out) - _MAX_EVENTS} more rounds (`{path}` in the log).")
    return lines


def _event_lines(log: RunLog) -> list[str]:
    ev = log.events
    n = len(ev.get("round", []))
    if n == 0:
        return ["No events."]
    lines = ["| round | rank | client | message |", "|---|---|---|---|"]
    for i in range(min(n, _MAX_EVENTS)):
        client = int(ev["client"][i])
        msg = str(ev["message"][i]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {int(ev['round'][i])} | {int(ev['rank'][i])} | "
                     f"{client if client >= 0 else '—'} | {msg} |")
    if n > _MAX_EVENTS:
        lines.append(f"\n… {n - _MAX_EVENTS} more events (`fedmpi.log.read(path).events`).")
    return lines


def partition_preview(partition: Any, out_dir: str | os.PathLike, name: str = "",
                      overwrite: bool = False) -> list[str]:
    """``fedmpi partition``: write ``partition.png`` and ``partition.csv`` into
    ``out_dir`` and return the lines to print (per-client sizes, hold-out, files).

    ``partition`` is a :class:`fedmpi.data.Partition` (from
    :func:`fedmpi.data.build_partition`, the function a run uses).
    ``partition.csv`` has one row per client: ``client, size, class_0, ...``.
    """
    from .outputs import claim

    _mpl()
    out = Path(out_dir)
    claim([out / "partition.png", out / "partition.csv"], overwrite, "fedmpi partition")
    out.mkdir(parents=True, exist_ok=True)
    counts = np.asarray(partition.class_counts, dtype=np.int64)
    sizes = counts.sum(axis=1)
    k, c = counts.shape
    png = plot_partition(counts, out / "partition.png",
                         f"{name + ': ' if name else ''}partition of {int(sizes.sum())} samples "
                         f"into {k} clients ({len(partition.validation_indices)} held out)")
    csv_path = out / "partition.csv"
    rows = ["client,size," + ",".join(f"class_{j}" for j in range(c))]
    rows += [f"{i},{sizes[i]}," + ",".join(map(str, counts[i])) for i in range(k)]
    write_text(csv_path, "\n".join(rows) + "\n")
    present = (counts > 0).sum(axis=1)
    lines = ["client  size  classes  largest class share"]
    for i in range(k):
        share = counts[i].max() / sizes[i] if sizes[i] else math.nan
        lines.append(f"{i:6d}  {sizes[i]:4d}  {present[i]:7d}  {share:.2f}")
    lines += [f"clients: {k}, samples: {int(sizes.sum())} (min {sizes.min()}, max {sizes.max()}, "
              f"mean {sizes.mean():.1f}), server hold-out: {len(partition.validation_indices)}",
              str(png), str(csv_path)]
    return lines


# -- entry point ------------------------------------------------------------------------

def write_report(log: RunLog | PathLike, out_dir: str | os.PathLike | None = None,
                 target: float | None = None, overwrite: bool = False) -> list[Path]:
    """Write every applicable plot and ``summary.md`` into ``out_dir``.

    ``out_dir`` defaults to ``<log directory>/report``. Returns the files
    written (``summary.md`` last). Works on a log that is still being written
    or whose run failed (what is in the log up to its last complete round).
    Without matplotlib only ``summary.md`` is written, saying how to get the
    plots (:data:`PLOT_HINT`; ``fedmpi report`` prints it too). Files of an
    earlier report in ``out_dir`` are replaced only with ``overwrite``
    (:func:`fedmpi.outputs.claim`).

    Raises
    ------
    LogFormatError
        The file is not a readable fedmpi log.
    UserError
        ``target`` out of (0, 1].
    """
    log = as_run_log(log)
    if target is not None and not 0.0 < target <= 1.0:
        raise UserError(f"--target-accuracy {target}: expected a fraction in (0, 1], "
                        "e.g. 0.8 for 80%")
    from .rundir import output_dir

    out = output_dir(Path(out_dir) if out_dir is not None
                     else Path(log.path).resolve().parent / "report")
    from .outputs import claim

    refuse_links(out, (*PLOTS, "summary.md"), "a report directory")
    claim([out / name for name in (*PLOTS, "summary.md")], overwrite, "fedmpi report")
    draw = have_matplotlib()
    written: list[Path] = []
    makers = {
        "accuracy.png": lambda p: plot_accuracy(log, p, target),
        "metrics.png": lambda p: plot_metrics(log, p),
        "client_weights.png": lambda p: plot_client_weights(log, p),
        "fedvg_grad_norm.png": lambda p: plot_grad_norm(log, p),
        "partition.png": lambda p: (plot_partition(log.arrays["partition/class_counts"], p,
                                                   f"{_title(log)}: partition")
                                    if "partition/class_counts" in log.arrays else None),
        "level_accuracy.png": lambda p: plot_level_accuracy(log, p),
        "time_per_round.png": lambda p: plot_time(log, p),
        "bytes_per_round.png": lambda p: plot_bytes(log, p),
    }
    for name in PLOTS:
        path = out / name
        made = makers[name](path) if draw else None
        if made is not None:
            written.append(made)
        elif draw and path.exists():
            path.unlink()   # stale plot from an earlier report of this directory
    summary = out / "summary.md"
    write_text(summary, summary_markdown(log, target, [p.name for p in written],
                                         None if draw else PLOT_HINT))
    written.append(summary)
    return written
