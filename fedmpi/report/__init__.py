r"""``fedmpi report``: PNG plots and ``summary.md`` from one run log.

Plots (each written only when the log holds the data it needs; rounds on the
x axis are the round numbers of the log, counted from 0):

=========================  =====================================================
``accuracy.png``           test accuracy (%) and test/train loss vs round
``metrics.png``            one panel per ``eval.metrics`` entry (accuracy,
                           balanced accuracy, macro-F1, AUROC, user metrics) vs
                           round; with per-site evaluation (``eval.where``) also
                           each site's curve (up to 10 sites, named in the
                           legend), the spread across
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
``cross_site.png``         the cross-site validation (``eval.cross_site``): per
                           metric, the sites' held-out data down, the global
                           model and each site's local model across
``arrivals.png``           a deadline or buffered run (``round.mode``): the
                           staleness of every aggregated update, sites x
                           server steps, and each update's arrival time with
                           the step's (virtual or wall clock)
=========================  =====================================================

One module per job; every name is importable from ``fedmpi.report``:

- :mod:`~fedmpi.report.summary` — ``summary.md`` (:func:`summary_markdown`);
- :mod:`~fedmpi.report.curves` — accuracy, metrics and level-accuracy curves;
- :mod:`~fedmpi.report.heatmaps` — client weights, gradient norms, partition;
- :mod:`~fedmpi.report.costs` — time and bytes per round;
- :mod:`~fedmpi.report.cross_site` — the cross-site validation's heatmaps and tables;
- :mod:`~fedmpi.report.arrivals` — arrivals, staleness and participation of a deadline or
  buffered run;
- :mod:`~fedmpi.report.derived` — what plots and summary both show (the round's
  time split :func:`time_split`, titles, level labels);
- :mod:`~fedmpi.report.canvas` — matplotlib (the ``plot`` extra, Agg canvas only);
- :mod:`~fedmpi.report.preview` — ``fedmpi partition`` (:func:`partition_preview`).

This module writes a report directory (:func:`write_report`).
"""
from __future__ import annotations

import os
from pathlib import Path

from fedmpi.errors import UserError
from fedmpi.log.schema import PathLike
from fedmpi.log.reader import RunLog, as_run_log
from fedmpi.job.safefile import refuse_links, write_text

from fedmpi.report.arrivals import plot_arrivals
from fedmpi.report.canvas import PLOT_HINT, have_matplotlib
from fedmpi.report.costs import plot_bytes, plot_time
from fedmpi.report.cross_site import plot_cross_site
from fedmpi.report.curves import plot_accuracy, plot_level_accuracy, plot_metrics
from fedmpi.report.derived import run_title, site_labels
from fedmpi.report.heatmaps import plot_client_weights, plot_grad_norm, plot_partition
from fedmpi.report.summary import summary_markdown


#: File names of the plots, in the order the summary lists them.
PLOTS: tuple[str, ...] = ("accuracy.png", "metrics.png", "client_weights.png", "fedvg_grad_norm.png",
                          "partition.png", "level_accuracy.png", "time_per_round.png",
                          "bytes_per_round.png", "cross_site.png", "arrivals.png")


def write_report(log: RunLog | PathLike, out_dir: str | os.PathLike | None = None,
                 target: float | None = None, overwrite: bool = False) -> list[Path]:
    """Write every applicable plot and ``summary.md`` into ``out_dir``.

    ``out_dir`` defaults to ``<log directory>/report``. Returns the files
    written (``summary.md`` last). Works on a log that is still being written
    or whose run failed (what is in the log up to its last complete round).
    Without matplotlib only ``summary.md`` is written, saying how to get the
    plots (:data:`PLOT_HINT`; ``fedmpi report`` prints it too). An earlier report's
    files that nobody changed since (``.fedmpi-report.json``,
    :func:`fedmpi.job.outputs.own_files`) are derived output and are regenerated; any
    other file there is replaced only with ``overwrite`` (:func:`fedmpi.job.outputs.claim`).

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
    from fedmpi.job.rundir import output_dir

    out = output_dir(Path(out_dir) if out_dir is not None
                     else Path(log.path).resolve().parent / "report")
    from fedmpi.job.outputs import claim, own_files, record_written

    refuse_links(out, (*PLOTS, "summary.md", ".fedmpi-report.json"), "a report directory")
    own = own_files(out, "report")   # an earlier report's files, unchanged: derived, replaced
    claim([out / name for name in (*PLOTS, "summary.md") if name not in own], overwrite,
          "fedmpi report")
    draw = have_matplotlib()
    written: list[Path] = []
    makers = {
        "accuracy.png": lambda p: plot_accuracy(log, p, target),
        "metrics.png": lambda p: plot_metrics(log, p),
        "client_weights.png": lambda p: plot_client_weights(log, p),
        "fedvg_grad_norm.png": lambda p: plot_grad_norm(log, p),
        "partition.png": lambda p: (plot_partition(log.arrays["partition/class_counts"], p,
                                                   f"{run_title(log)}: partition",
                                                   site_names=site_labels(log))
                                    if "partition/class_counts" in log.arrays else None),
        "level_accuracy.png": lambda p: plot_level_accuracy(log, p),
        "time_per_round.png": lambda p: plot_time(log, p),
        "bytes_per_round.png": lambda p: plot_bytes(log, p),
        "cross_site.png": lambda p: plot_cross_site(log, p),
        "arrivals.png": lambda p: plot_arrivals(log, p),
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
    record_written(out, "report", written)
    return written
