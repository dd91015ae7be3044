r"""``fedmpi compare``: a paper-style table across runs (FedGPS Table 1 columns).

Per run (one HDF5 log, read with :func:`fedmpi.log.read`), from the test
accuracies :math:`a_t` of the evaluated rounds :math:`t` (rounds are numbered
from 0 as in the log; rounds without evaluation hold NaN and are skipped):

- **final accuracy**: :math:`a_{t_{last}}`, the last evaluated round;
- **best accuracy**: :math:`\max_t a_t` ("ACC" of FedGPS Table 1), and the
  round :math:`t^\star` where it is first reached;
- **rounds to target** :math:`\tau`: :math:`\min\{t + 1 : a_t \ge
  \text{target}\}`, the number of communication rounds completed when the
  target is first met ("ROUND"); NaN when never reached.

Per group (runs sharing the values of the grouping keys, e.g. several seeds
or several partition scenarios of one method), over its :math:`n` runs:

- mean and standard deviation of final and best accuracy, with the
  *population* standard deviation :math:`\sqrt{\frac1n\sum_i (x_i-\bar x)^2}`
  (``numpy.std``, ddof=0; 0 for a single run);
- rounds to target: mean ± std of :math:`\tau_i` **only if every run of the
  group reached the target** (otherwise NaN, shown as "not reached", and the
  ``reached`` column says how many did): averaging only the runs that got
  there would flatter a method that often fails;
- **speed-up** ("SpeedUp") :math:`\bar\tau_{\text{baseline}} / \bar\tau_{\text{group}}`;
- the further test metrics of ``eval.metrics`` that the logs hold
  (``/rounds/balanced_accuracy``, ``macro_f1``, ``auroc``): mean ± std of their
  value at each run's final evaluated round, one column each.

Target accuracy: ``--target-accuracy`` if given. Otherwise, with a baseline
group, FedGPS's rule ("the target accuracy set as the best performance of
FedAvg", FedGPS Sec. 5.1) generalised to several seeds: the *lowest* best
accuracy among the baseline's runs, so that every baseline run reaches it
(with one baseline run this is exactly FedGPS's rule). Without either, the
rounds and speed-up columns are left out.

Grouping: ``--group-by KEY`` (repeatable; dotted config keys such as
``algorithm.name`` or the aliases of :data:`ALIASES`). By default the runs
are grouped by every config key whose value differs between the logs, except
those in :data:`IGNORED_KEYS` (seeds, names, paths and runtime settings), so
seeds and partition scenarios of one setting fall into one group.

Longer than ~350 lines: loading, grouping, statistics and the table writers of one command, used nowhere else.
"""
from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedmpi.config import METRIC_NAMES
from fedmpi.errors import UserError
from fedmpi.log import PathLike, RunLog, as_run_log, ended_without_status, read

#: ``/rounds/<metric>`` series beyond test_accuracy that the table and report show.
EXTRA_METRICS: tuple[str, ...] = tuple(m for m in METRIC_NAMES if m != "accuracy")

__all__ = ["ALIASES", "IGNORED_KEYS", "GroupRow", "RunMetrics", "Table", "compare",
           "compare_logs", "config_value", "flatten_config", "rounds_to_target",
           "run_config", "run_metrics"]

#: A grouping key's value in a group whose runs did not use it (e.g. another method's
#: parameter, :func:`run_config`).
UNUSED = "—"

#: Short names accepted by ``--group-by``.
ALIASES: dict[str, str] = {
    "algorithm": "algorithm.name",
    "weighting": "aggregation.weighting",
    "alpha": "data.partition.alpha",
    "partition": "data.partition.method",
    "dataset": "data.dataset",
    "model": "model.name",
    "clients": "data.num_clients",
    "ecgr": "ecgr.enabled",
}

#: Config keys (or prefixes ending in ".") never used for default grouping.
IGNORED_KEYS: tuple[str, ...] = ("name", "seed", "data.partition.seed", "data.partition.file",
                                 "data.root", "data.download", "data.silos.path",
                                 "data.silos.test", "data.silos.validation", "data.tabular.train",
                                 "data.tabular.test", "runtime.")


# -- per run ---------------------------------------------------------------------

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
    eps = log.rounds.get("epsilon")
    if eps is not None and len(eps):
        m.epsilon = float(eps[-1])
    if target is not None:
        m.rounds_to_target = rounds_to_target(rounds, acc, target)
    return m


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
    less the keys that took no part (:func:`fedmpi.provenance.unused_keys`: no
    ``data.dataset`` for a silo run, no ``model.norm`` for a user model)."""
    log = as_run_log(log)
    from fedmpi.provenance import read_run_info, unused_keys

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


def _fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_fmt_value(v) for v in value) + "]"
    return "none" if value is None else str(value)


def _ignored(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in IGNORED_KEYS)


def _group_keys(flat_configs: Sequence[Mapping[str, Any]], group_by: Sequence[str]) -> list[str]:
    if group_by:
        keys = [ALIASES.get(k, k) for k in group_by]
        for k, given in zip(keys, group_by):
            if not any(k in c for c in flat_configs):
                raise UserError(f"--group-by {given}: no log has config key {k!r} "
                                f"(aliases: {', '.join(sorted(ALIASES))})")
        return keys
    # A key that some logs lack (added to the schema later) varies only if the
    # logs that have it disagree; but where the methods differ, each method's own
    # parameters (algorithm.<block>.<field>, present only in its runs: run_config)
    # label its groups.
    union = sorted({k for c in flat_configs for k in c})
    methods = len({_fmt_value(c.get("algorithm.name")) for c in flat_configs}) > 1

    # Likewise an update transform's parameters (ecgr.beta) label the runs it ran in.
    from fedmpi.algorithms.transforms import TRANSFORMS

    transform_blocks = {b for cls in TRANSFORMS.values() for b in (getattr(cls, "params", None) or ())}

    def own_param(k: str) -> bool:
        if all(k in c for c in flat_configs):
            return False
        return (methods and k.startswith("algorithm.") and k.count(".") >= 2) or \
            k.split(".")[0] in transform_blocks

    varying = [k for k in union if not _ignored(k)
               and len({_fmt_value(c[k]) for c in flat_configs if k in c}) > 1]
    return varying + [k for k in union if k not in varying and own_param(k)]


# -- per group -------------------------------------------------------------------

def _mean_std(values: Iterable[float]) -> tuple[float, float]:
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0 or not np.all(np.isfinite(a)):
        return math.nan, math.nan
    return float(a.mean()), float(a.std())


@dataclass
class GroupRow:
    """One row of the table: a group of runs and its statistics."""

    label: str
    values: dict[str, str]
    runs: list[RunMetrics]
    final: tuple[float, float]
    best: tuple[float, float]
    rounds: tuple[float, float] = (math.nan, math.nan)
    reached: int = 0
    speedup: float = math.nan
    baseline: bool = False
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def epsilon(self) -> float | None:
        """The largest final ε of the group's DP runs (None: no run is a DP run)."""
        values = [r.epsilon for r in self.runs if r.epsilon is not None]
        return max(values) if values else None

    @property
    def incomplete(self) -> int:
        """Runs whose log status is not ``completed``."""
        return sum(r.status != "completed" for r in self.runs)


@dataclass
class Table:
    """Result of :func:`compare`: rows, and the settings that produced them."""

    keys: list[str]
    rows: list[GroupRow]
    target: float | None
    target_source: str = ""
    baseline: str | None = None
    runs: list[RunMetrics] = field(default_factory=list)

    @property
    def metric_names(self) -> list[str]:
        """The further metrics some run of the table logged (:data:`EXTRA_METRICS` order)."""
        seen = dict.fromkeys(n for r in self.runs for n in r.final_metrics)
        return [*(n for n in EXTRA_METRICS if n in seen), *(n for n in seen if not is_percent(n))]

    def markdown(self) -> str:
        """The table in GitHub markdown (accuracies in percent)."""
        with_rounds = self.target is not None
        with_speedup = with_rounds and self.baseline is not None
        extra = self.metric_names
        head = ["group", "runs", "final acc (%)", "best acc (%)",
                *(f"final {n}{' (%)' if is_percent(n) else ''}" for n in extra)]
        with_eps = any(row.epsilon is not None for row in self.rows)
        if with_eps:
            head += ["ε"]
        if with_rounds:
            head += ["rounds to target", "reached"]
        if with_speedup:
            head += ["speed-up"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in self.rows:
            label = row.label + (" (baseline)" if row.baseline else "")
            runs = f"{len(row.runs)}" + (f" ({row.incomplete} incomplete)" if row.incomplete else "")
            cells = [label, runs, _pm(row.final, 100, 2), _pm(row.best, 100, 2),
                     *(_pm(row.metrics.get(n, (math.nan, math.nan)), 100 if is_percent(n) else 1,
                           2 if is_percent(n) else 4) for n in extra)]
            if with_eps:
                cells += ["—" if row.epsilon is None else f"{row.epsilon:.3g}"]
            if with_rounds:
                cells += [_pm(row.rounds, 1, 1) if row.reached == len(row.runs) else "not reached",
                          f"{row.reached}/{len(row.runs)}"]
            if with_speedup:
                cells += ["—" if math.isnan(row.speedup) else f"{row.speedup:.2f}×"]
            lines.append("| " + " | ".join(cells) + " |")
        notes = ["", "Mean ± std (population std, ddof=0) over the runs of each group; "
                     "final = last evaluated round, best = maximum over evaluated rounds."]
        if with_eps:
            notes.append("ε = privacy.dp.delta's ε after each run's last logged round "
                         "(/rounds/epsilon), the largest over the group's runs; — = no DP.")
        if with_rounds:
            notes.append(f"Target accuracy {100 * self.target:.2f}% ({self.target_source}); "
                         "rounds to target = rounds completed when a run first reaches it, "
                         "averaged only when every run of the group reaches it.")
        if with_speedup:
            notes.append(f"Speed-up = mean rounds of the baseline ({self.baseline}) ÷ "
                         "mean rounds of the group.")
        notes += [f"Run {m.path}: status {m.status}, {m.note}." for row in self.rows
                  for m in row.runs if m.note]
        return "\n".join(lines + notes) + "\n"

    def csv(self) -> str:
        """One row per group; raw numbers (accuracies as fractions, NaN when undefined)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["group", *self.keys, "runs", "incomplete", "final_mean", "final_std",
                    "best_mean", "best_std", "target", "rounds_mean", "rounds_std", "reached",
                    "speedup", "baseline", *(f"{n}_{s}" for n in self.metric_names
                                             for s in ("mean", "std"))])
        for row in self.rows:
            w.writerow([row.label, *(row.values.get(k, "") for k in self.keys), len(row.runs),
                        row.incomplete, *map(_num, (*row.final, *row.best)),
                        _num(self.target), *map(_num, row.rounds), row.reached,
                        _num(row.speedup), int(row.baseline),
                        *(_num(v) for n in self.metric_names
                          for v in row.metrics.get(n, (math.nan, math.nan)))])
        return buf.getvalue()

    def runs_csv(self) -> str:
        """One row per run (log path, status, final/best accuracy, rounds to target)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["path", "group", "status", "rounds_logged", "rounds_configured",
                    "final_accuracy", "final_round", "best_accuracy", "best_round",
                    "rounds_to_target", *(f"final_{n}" for n in self.metric_names)])
        for row in self.rows:
            for m in row.runs:
                w.writerow([m.path, row.label, m.status, m.rounds_logged,
                            "" if m.rounds_configured is None else m.rounds_configured,
                            _num(m.final_accuracy), "" if m.final_round is None else m.final_round,
                            _num(m.best_accuracy), "" if m.best_round is None else m.best_round,
                            _num(m.rounds_to_target),
                            *(_num(m.final_metrics.get(n, math.nan)) for n in self.metric_names)])
        return buf.getvalue()


def _num(x: float | None) -> str:
    return "" if x is None else repr(float(x))


def _pm(ms: tuple[float, float], scale: float, digits: int) -> str:
    mean, std = ms
    if math.isnan(mean):
        return "—"
    return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f}"


def compare_logs(logs: Sequence[RunLog | PathLike], *, target: float | None = None,
                 group_by: Sequence[str] = (), baseline: str | None = None) -> Table:
    """Group ``logs`` and compute the table (see the module docstring for the math).

    Parameters
    ----------
    logs
        Run logs (:class:`~fedmpi.log.RunLog`, e.g. from :func:`fedmpi.log.read`) or
        their paths.
    target
        Target accuracy as a fraction in (0, 1]; ``None`` derives it from the
        baseline (lowest best accuracy among its runs) if there is one.
    group_by
        Dotted config keys or :data:`ALIASES`; empty: the keys that differ.
    baseline
        Group for the speed-up: its label, or one of its grouping values
        (e.g. ``fedavg``). ``None``: the group whose runs all have
        ``algorithm.name: fedavg`` if exactly one group does and there are
        several groups.

    Raises
    ------
    UserError
        Unknown grouping key, no or ambiguous baseline match, target out of range.
    """
    if not logs:
        raise UserError("compare: no logs given")
    if target is not None and not 0.0 < target <= 1.0:
        raise UserError(f"--target-accuracy {target}: expected a fraction in (0, 1], "
                        "e.g. 0.8 for 80%")
    logs = [as_run_log(log) for log in logs]
    flats = [run_config(log) for log in logs]
    keys = _group_keys(flats, group_by)

    groups: dict[tuple[str, ...], list[int]] = {}
    for i, flat in enumerate(flats):
        groups.setdefault(tuple(_fmt_value(flat[k]) if k in flat else UNUSED for k in keys),
                          []).append(i)

    def label(values: tuple[str, ...]) -> str:
        if not keys:
            return "all"
        if len(keys) == 1:
            return values[0]
        # a key the group's runs did not use (another method's parameter) is left out
        present = [(k, v) for k, v in zip(keys, values) if v != UNUSED]
        return ", ".join(f"{_short(k, [p for p, _ in present])}={v}" for k, v in present)

    members = list(groups.items())
    base_idx = _find_baseline(members, keys, flats, baseline, label)

    source = "--target-accuracy"
    if target is None and base_idx is not None:
        bests = [run_metrics(logs[i]).best_accuracy for i in members[base_idx][1]]
        if all(math.isfinite(b) for b in bests):
            target = min(bests)
            source = ("lowest best accuracy among the baseline's runs" if len(bests) > 1
                      else "best accuracy of the baseline")

    rows: list[GroupRow] = []
    all_runs: list[RunMetrics] = []
    for values, idx in members:
        ms = [run_metrics(logs[i], target) for i in idx]
        all_runs += ms
        row = GroupRow(label=label(values), values=dict(zip(keys, values)), runs=ms,
                       final=_mean_std(m.final_accuracy for m in ms),
                       best=_mean_std(m.best_accuracy for m in ms),
                       metrics={n: _mean_std(m.final_metrics[n] for m in ms if n in m.final_metrics)
                                for n in dict.fromkeys(k for m in ms for k in m.final_metrics)})
        if target is not None:
            taus = [m.rounds_to_target for m in ms]
            row.reached = sum(math.isfinite(t) for t in taus)
            row.rounds = _mean_std(taus)
        rows.append(row)

    base_label = None
    if base_idx is not None:
        base = rows[base_idx]
        base.baseline = True
        base_label = base.label
        for row in rows:
            if target is not None and row.rounds[0] > 0 and math.isfinite(base.rounds[0]):
                row.speedup = base.rounds[0] / row.rounds[0]
    return Table(keys=keys, rows=rows, target=target, target_source=source,
                 baseline=base_label, runs=all_runs)


def _short(key: str, keys: Sequence[str]) -> str:
    """Column name in a label: the alias of ``key``, else its last part if no other
    grouping key ends the same way, else the whole dotted key."""
    for alias, target in ALIASES.items():
        if target == key:
            return alias
    leaf = key.rsplit(".", 1)[-1]
    return leaf if sum(k.rsplit(".", 1)[-1] == leaf for k in keys) == 1 else key


def _find_baseline(members, keys, flats, baseline, label) -> int | None:
    if baseline is not None:
        exact = [i for i, (values, _) in enumerate(members) if label(values) == baseline]
        if len(exact) == 1:
            return exact[0]
        loose = [i for i, (values, _) in enumerate(members) if baseline in values]
        if len(loose) == 1:
            return loose[0]
        known = "; ".join(label(v) for v, _ in members)
        what = "matches no group" if not loose else "matches several groups"
        raise UserError(f"--baseline {baseline!r} {what}; groups: {known}")
    if len(members) < 2:
        return None
    fedavg = [i for i, (_, idx) in enumerate(members)
              if all(flats[j].get("algorithm.name") == "fedavg" for j in idx)]
    return fedavg[0] if len(fedavg) == 1 else None


def compare(paths: Sequence[str | os.PathLike], *, target: float | None = None,
            group_by: Sequence[str] = (), baseline: str | None = None) -> Table:
    """Read the logs at ``paths`` and :func:`compare_logs` them.

    Raises :class:`~fedmpi.errors.LogFormatError` naming the first unreadable file.
    """
    return compare_logs([read(p) for p in paths], target=target, group_by=group_by,
                        baseline=baseline)
