r"""One run's numbers and config, read from its log: final and best accuracy,
rounds to a target, the further ``eval.metrics``, ε of a DP run
(:func:`run_metrics`), and the flat config of what the run used (:func:`run_config`).
Used by ``fedmpi compare`` (per group) and ``fedmpi report`` (one run); the
definitions are in :mod:`fedmpi.compare`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedmpi.config.framework import METRIC_NAMES
from fedmpi.log.schema import PathLike
from fedmpi.log.reader import RunLog, as_run_log, ended_without_status

__all__ = ["EXTRA_METRICS", "RunMetrics", "SITE_MODEL_COLUMNS", "config_value", "flatten_config",
           "is_percent", "logged_metrics", "rounds_to_target", "run_config", "run_metrics",
           "site_delta", "site_means", "site_model_arrays"]

#: ``/rounds/<metric>`` series beyond test_accuracy that the table and report show.
EXTRA_METRICS: tuple[str, ...] = tuple(m for m in METRIC_NAMES if m != "accuracy")


def rounds_to_target(rounds: np.ndarray, accuracy: np.ndarray, target: float) -> float:
    r"""Rounds completed when ``accuracy`` first reaches ``target``: :math:`t + 1` of the
    first logged round :math:`t` with :math:`a_t \ge` target; NaN if never (NaN
    accuracies, i.e. rounds without evaluation, never count)."""
    acc = np.asarray(accuracy, dtype=np.float64)
    hit = np.flatnonzero(np.nan_to_num(acc, nan=-np.inf) >= target)
    return float(rounds[hit[0]] + 1) if hit.size else math.nan


@dataclass
class RunMetrics:
    """Summary numbers of one run (accuracies are fractions in [0, 1])."""

    path: str
    status: str
    rounds_logged: int
    rounds_configured: int | None
    final_accuracy: float
    final_round: int | None
    best_accuracy: float
    best_round: int | None
    rounds_to_target: float = math.nan
    note: str | None = None   # a "running" log whose writer is gone (log.ended_without_status)
    final_metrics: dict[str, float] = field(default_factory=dict)   # EXTRA_METRICS in the log
    epsilon: float | None = None   # ε at privacy.dp.delta after the last logged round (DP runs)


def logged_metrics(log: RunLog) -> list[str]:
    """The further metrics of a log: :data:`EXTRA_METRICS`, then the user metrics its
    ``eval.metrics`` names by import path (:mod:`fedmpi.metrics`)."""
    from fedmpi.metrics import extra_names

    chosen = config_value(log.config, "eval.metrics", None) or []
    return [*EXTRA_METRICS, *(n for n in extra_names(chosen) if n not in EXTRA_METRICS)]


def is_percent(metric: str) -> bool:
    """Built-in metrics are fractions shown in percent; user metrics keep their own scale."""
    return metric in EXTRA_METRICS


def run_metrics(log: RunLog | PathLike, target: float | None = None) -> RunMetrics:
    """Final/best accuracy, round of best and rounds to ``target`` of one log."""
    log = as_run_log(log)
    rounds = np.asarray(log.rounds.get("round", np.empty(0, dtype=np.int64)))
    acc = np.asarray(log.rounds.get("test_accuracy", np.full(len(rounds), np.nan)), dtype=np.float64)
    evaluated = np.flatnonzero(np.isfinite(acc))
    configured = config_value(log.config, "train.rounds")
    m = RunMetrics(path=log.path, status=str(log.status), rounds_logged=len(rounds),
                   rounds_configured=int(configured) if configured is not None else None,
                   final_accuracy=math.nan, final_round=None, best_accuracy=math.nan,
                   best_round=None, note=ended_without_status(log))
    if evaluated.size:
        last = evaluated[-1]
        best = evaluated[int(np.argmax(acc[evaluated]))]
        m.final_accuracy, m.final_round = float(acc[last]), int(rounds[last])
        m.best_accuracy, m.best_round = float(acc[best]), int(rounds[best])
    for name in logged_metrics(log):
        if name in log.rounds:
            m.final_metrics[name] = float(log.rounds[name][evaluated[-1]]) if evaluated.size \
                else math.nan
    m.final_metrics.update(site_means(log))
    eps = log.rounds.get("epsilon")
    if eps is not None and len(eps):
        m.epsilon = float(eps[-1])
    if target is not None:
        m.rounds_to_target = rounds_to_target(rounds, acc, target)
    return m


#: the columns of ``/site_models/<metric>`` (:mod:`fedmpi.consortium.site_models`)
SITE_MODEL_COLUMNS = ("local only", "global", "personal", "fine-tuned")
_SITE_MODEL_NAMES = ("sites", "models", "test_samples")


def site_model_arrays(log: RunLog) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """(site names as logged, {metric: [K, 4]}) of ``/site_models``; None unless
    ``/site_models/sites`` names K rows, ``/site_models/models`` the four columns and a
    numeric metric array is [K, 4] (a log is untrusted input)."""
    sites, models = log.arrays.get("site_models/sites"), log.arrays.get("site_models/models")
    if sites is None or models is None or sites.ndim != 1 or \
            [str(m) for m in models] != list(SITE_MODEL_COLUMNS):
        return None
    k = len(sites)
    found = {key.split("/", 1)[1]: np.asarray(a, dtype=np.float64)
             for key, a in log.arrays.items()
             if key.startswith("site_models/")
             and key.split("/", 1)[1] not in _SITE_MODEL_NAMES
             and a.shape == (k, 4) and a.dtype.kind in "biuf"}
    return (sites, found) if found else None


def site_delta(row: np.ndarray, lower_is_better: bool = False) -> float:
    """Best of (personal, fine-tuned) minus best of (local only, global); NaN where either
    side has no finite value. For a loss, "best" is the lowest and Δ < 0 is a gain."""
    pick = np.nanmin if lower_is_better else np.nanmax
    mine, others = row[2:], row[:2]
    if not np.isfinite(mine).any() or not np.isfinite(others).any():
        return math.nan
    return float(pick(mine) - pick(others))


def site_means(log: RunLog) -> dict[str, float]:
    """The per-site table's accuracy (``/site_models``, docs/personalisation.md) as the mean
    over sites of each model — ``sites <model>`` — and of Δ (best of personal and
    fine-tuned − best of local only and global); {} without it. Fractions, so that
    ``fedmpi compare`` prints them with their spread over the seeds of a group."""
    found = site_model_arrays(log)
    acc = found[1].get("test_accuracy") if found is not None else None
    if acc is None:
        return {}
    out = {}
    for c, name in enumerate(SITE_MODEL_COLUMNS):
        if np.isfinite(acc[:, c]).any():
            out[f"sites {name}"] = float(np.nanmean(acc[:, c]))
    deltas = [site_delta(row) for row in acc]
    finite = [d for d in deltas if math.isfinite(d)]
    if finite:
        out["sites Δ"] = float(np.mean(finite))
    return out


# -- config helpers ----------------------------------------------------------------

def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config mapping -> ``{"dotted.key": value}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_config(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def run_config(log: RunLog | PathLike) -> dict[str, Any]:
    """The flat config of what ``log``'s run used: :func:`flatten_config` of its config,
    the method's own parameters as it ran them (``run_info``, e.g.
    ``algorithm.params.mu`` of a user method, also where the config left the default),
    less the keys that took no part (:func:`fedmpi.job.provenance.unused_keys`: no
    ``data.dataset`` for a silo run, no ``model.norm`` for a user model)."""
    log = as_run_log(log)
    from fedmpi.job.provenance import read_run_info, unused_keys

    flat = flatten_config(log.config)
    info = read_run_info(log.attrs)
    method = info.get("method") if info is not None else None
    if isinstance(method, Mapping) and isinstance(method.get("params"), Mapping):
        for group, fields in method["params"].items():
            if isinstance(fields, Mapping):
                flat.update({f"algorithm.{group}.{k}": v for k, v in fields.items()})
    for key in unused_keys(flat, info):
        flat.pop(key, None)
    return flat


def config_value(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """Value at ``dotted`` (e.g. ``"train.rounds"``) of a nested config, or ``default``."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node
