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

One module per job, every name importable from ``fedmpi.compare``:
:mod:`~fedmpi.compare.runs` (one run's numbers and config, also used by
``fedmpi report``), :mod:`~fedmpi.compare.grouping` (grouping keys, labels,
baseline), :mod:`~fedmpi.compare.table` (the table and its Markdown/CSV writers);
this module groups the runs and computes the rows (:func:`compare_logs`).
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

from fedmpi.errors import UserError
from fedmpi.log.schema import PathLike
from fedmpi.log.reader import RunLog, as_run_log, read

from fedmpi.compare.grouping import (UNUSED, find_baseline, format_value, group_keys, mean_std, short_key)
from fedmpi.compare.runs import RunMetrics, run_config, run_metrics
from fedmpi.compare.table import GroupRow, Table



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
    keys = group_keys(flats, group_by)

    groups: dict[tuple[str, ...], list[int]] = {}
    for i, flat in enumerate(flats):
        groups.setdefault(tuple(format_value(flat[k]) if k in flat else UNUSED for k in keys),
                          []).append(i)

    def label(values: tuple[str, ...]) -> str:
        if not keys:
            return "all"
        if len(keys) == 1:
            return values[0]
        # a key the group's runs did not use (another method's parameter) is left out
        present = [(k, v) for k, v in zip(keys, values) if v != UNUSED]
        return ", ".join(f"{short_key(k, [p for p, _ in present])}={v}" for k, v in present)

    members = list(groups.items())
    base_idx = find_baseline(members, keys, flats, baseline, label)

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
                       final=mean_std(m.final_accuracy for m in ms),
                       best=mean_std(m.best_accuracy for m in ms),
                       metrics={n: mean_std(m.final_metrics[n] for m in ms if n in m.final_metrics)
                                for n in dict.fromkeys(k for m in ms for k in m.final_metrics)})
        if target is not None:
            taus = [m.rounds_to_target for m in ms]
            row.reached = sum(math.isfinite(t) for t in taus)
            row.rounds = mean_std(taus)
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


def compare(paths: Sequence[str | os.PathLike], *, target: float | None = None,
            group_by: Sequence[str] = (), baseline: str | None = None) -> Table:
    """Read the logs at ``paths`` and :func:`compare_logs` them.

    Raises :class:`~fedmpi.errors.LogFormatError` naming the first unreadable file.
    """
    return compare_logs([read(p) for p in paths], target=target, group_by=group_by,
                        baseline=baseline)
