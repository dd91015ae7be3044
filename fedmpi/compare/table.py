"""The comparison table: :class:`GroupRow` (a group and its statistics) and
:class:`Table` with its writers — GitHub Markdown (accuracies in percent, mean ± std),
a per-group CSV and a per-run CSV (raw numbers, NaN as empty)."""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field

from fedmpi.compare.runs import EXTRA_METRICS, RunMetrics, is_percent

__all__ = ["GroupRow", "Table"]


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
