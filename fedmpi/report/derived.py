"""What the report's plots and its summary both show, derived from one log: the run's
title and components, the submodel level labels, the split of a round's time, byte units.

The time split (:func:`time_split`) uses the log's ``train_seconds`` (slowest
worker), ``aggregate_seconds``, ``overhead_seconds`` and ``eval_seconds``. The
runtime logs ``overhead = wall − train − aggregate − (evaluation inside the
round)``; with ``eval.overlap`` round t is evaluated while the workers train
round t + 1, outside round t's wall time, so the evaluation inside the round is
``wall − train − aggregate − overhead`` (0 for an overlapped round) and the rest
of ``eval_seconds`` is reported apart: the in-round parts add up to 100 % of
the wall time. A log that splits the overhead (``wait_seconds``, ``comm_seconds``, …:
:data:`OVERHEAD_PARTS`) is drawn with the parts in its place (:func:`time_parts`).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fedmpi.compare.runs import config_value
from fedmpi.log.schema import PathLike
from fedmpi.log.reader import RunLog, as_run_log

__all__ = ["OVERHEAD_PARTS", "OVERLAPPED", "TIME_PARTS", "time_parts", "byte_unit", "level_labels", "logged_array",
           "METRIC_LABELS", "clean_label", "metric_names", "metric_text", "run_components",
           "run_title", "site_labels", "time_split"]


def logged_array(log: RunLog, name: str, ndim: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(log.arrays[name], /rounds/round)`` when the array has ``ndim`` axes and a finite
    entry; None when there is nothing to plot."""
    arr = log.arrays.get(name)
    rounds = log.rounds.get("round")
    if arr is None or rounds is None or arr.ndim != ndim or not np.isfinite(arr).any():
        return None
    return arr, rounds


def run_title(log: RunLog) -> str:
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


def run_components(log: RunLog) -> str:
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


#: How the plots and tables name the built-in metrics (user metrics keep their own name).
METRIC_LABELS = {"test_accuracy": "accuracy", "balanced_accuracy": "balanced accuracy",
                 "macro_f1": "macro-F1", "auroc": "AUROC", "test_loss": "test loss"}


def metric_text(x: float | None) -> str:
    """Every metric value of the summary (accuracy, AUROC, user metrics, losses) in one
    format: four decimals, as the log holds it (a fraction, not a percentage); ``—``
    where there is none."""
    return "—" if x is None or not math.isfinite(x) else f"{x:.4f}"


def metric_names(log: RunLog) -> list[str]:
    """The ``/rounds`` names of the run's ``eval.metrics`` (accuracy is ``test_accuracy``)."""
    from fedmpi.metrics import metric_name

    chosen = config_value(log.config, "eval.metrics", None) or ["accuracy"]
    return ["test_accuracy" if m == "accuracy" else metric_name(m) for m in chosen]


def site_labels(log: RunLog) -> list[str]:
    """The name of every client's site, in client order: the names the run recorded in
    its ``run_info`` (``data.silos.names``, or the client's part of the silo file names:
    :func:`fedmpi.data.silos.site_names`), else ``client k``. A log is untrusted input:
    a name is cut to 64 characters, control characters and ``|`` become spaces (a name
    goes into Markdown tables and plot labels as it is)."""
    from fedmpi.job.provenance import read_run_info

    k = log.num_clients
    info = read_run_info(log.attrs) or {}
    data = info.get("data")
    silos = data.get("silos") if isinstance(data, dict) else None
    names = silos.get("names") if isinstance(silos, dict) else None
    if not (isinstance(names, list) and len(names) == k and all(isinstance(n, str) and n
                                                                for n in names)):
        return [f"client {j}" for j in range(k)]
    return [clean_label(n) for n in names]


def clean_label(name: str) -> str:
    """A name read from a log, safe in a Markdown table cell and a plot label: cut to 64
    characters, control characters and ``|`` as spaces."""
    import re

    return re.sub(r"[\x00-\x1f\x7f|]", " ", name)[:64]


def level_labels(log: RunLog, n: int) -> list[str]:
    """``level i (size 1/4)`` from ``/submodel/levels`` (model-size ratios), else ``level i``."""
    from fractions import Fraction

    levels = log.arrays.get("submodel/levels")
    if levels is None or len(levels) != n:
        return [f"level {i}" for i in range(n)]
    return [f"level {i} (size {Fraction(float(v)).limit_denominator(4096)})"
            for i, v in enumerate(np.asarray(levels, dtype=float))]


#: The parts of a round's time in the log: ``/rounds`` name, label, plot colour.
TIME_PARTS = (("train_seconds", "local training (slowest worker)", "C0"),
              ("overhead_seconds", "communication + other", "C1"),
              ("aggregate_seconds", "aggregation", "C2"),
              ("eval_seconds", "evaluation", "C3"))
#: The parts of ``overhead_seconds`` (fedmpi.runtime.record.OVERHEAD_PARTS): name, label, colour.
OVERHEAD_PARTS = (("wait_seconds", "waiting for the slowest rank", "C1"),
                  ("comm_seconds", "moving bytes (MPI)", "C4"),
                  ("codec_seconds", "encoding / decoding", "C5"),
                  ("record_seconds", "recording the previous round", "C6"),
                  ("busy_seconds", "rank 0's own work, waited for", "C8"),
                  ("other_seconds", "other (not attributed)", "C7"))
OVERLAPPED = "evaluation overlapped with the next round's training (not in the wall time)"


def time_split(log: RunLog | PathLike) -> dict[str, np.ndarray]:
    """Per-round seconds: the :data:`TIME_PARTS` present in the log, with
    ``eval_seconds`` cut to its part inside the round's wall time, plus
    ``eval_overlapped`` (the rest) and ``wall_seconds``. NaN counts as 0.

    In-round evaluation = clip(wall − train − aggregate − overhead, 0, eval): the
    runtime computes overhead as the remainder of the wall time with the in-round
    evaluation only, so the in-round parts sum to the wall time.
    """
    log = as_run_log(log)
    parts = {name: np.nan_to_num(np.asarray(log.rounds[name], dtype=np.float64))
             for name, _, _ in TIME_PARTS + OVERHEAD_PARTS if name in log.rounds}
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


def time_parts(split: dict[str, np.ndarray], nonzero: bool = False
               ) -> list[tuple[str, str, str]]:
    """The in-round parts of a :func:`time_split` in drawing order: training, then the
    overhead's parts where the log has every one of them (else ``overhead_seconds``),
    aggregation, evaluation; ``nonzero``: only parts that are not 0 in every round."""
    split_overhead = all(name in split for name, _, _ in OVERHEAD_PARTS)
    out: list[tuple[str, str, str]] = []
    for part in TIME_PARTS:
        if part[0] == "overhead_seconds" and split_overhead:
            out.extend(OVERHEAD_PARTS)
        elif part[0] in split:
            out.append(part)
    return [p for p in out if not nonzero or np.any(split[p[0]])]


def byte_unit(x: float) -> tuple[str, float]:
    """The largest binary unit not above ``x`` bytes, and its size."""
    for unit, scale in (("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10)):
        if x >= scale:
            return unit, scale
    return "bytes", 1.0
