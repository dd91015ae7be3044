"""``stats.md`` and ``stats.json`` of ``fedmpi stats``
(:class:`~fedmpi.consortium.stats.StatsReport`), and writing them without replacing what
is there (``--overwrite``)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from fedmpi.consortium.stats import StatsReport

__all__ = ["FILES", "claim_outputs", "stats_json", "stats_markdown", "write_stats"]

#: The files ``fedmpi stats`` writes into its output directory.
FILES = ("stats.md", "stats.json")


def _finite(x: Any) -> Any:
    """JSON has no NaN: a missing number is null (recursively)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def stats_json(report: StatsReport) -> str:
    """The report as JSON: every site, all sites together, the privacy record."""
    return json.dumps(_finite(dataclasses.asdict(report)), indent=1) + "\n"


def _count(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{round(x):d}"


def _num(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{x:.6g}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def stats_markdown(report: StatsReport, config: str = "") -> str:
    """``stats.md``: what was summarised and how, a table of the sites (samples, class
    counts, missing values) and one of every feature (channel) per site."""
    p = report.privacy
    out = [f"# Federated statistics: {report.name}", ""]
    if config:
        out.append(f"- config: `{config}`")
    out += [f"- {len(report.sites)} sites, {report.kind}: {report.num_classes} classes, samples "
            f"of shape {tuple(report.sample_shape)} (one row per {report.feature_label})",
            "- computed on each site; only these summaries left it (`fedmpi stats`)"]
    if p is None:
        out.append("- privacy: none, the summaries are exact")
    else:
        out.append(f"- privacy: Gaussian noise on each site's sums, (ε = {p['epsilon']:.4g}, "
                   f"δ = {p['delta']:g})-DP per record (add or remove one record; "
                   "`dp_accounting.get_epsilon_gaussian`); values clipped to "
                   f"[{p['clip'][0]:g}, {p['clip'][1]:g}] first, so means and standard "
                   "deviations are those of the clipped values; minimum and maximum withheld "
                   "(the declared range instead); noise std per block: "
                   + ", ".join(f"{b} {v:.4g}" for b, v in p["noise_std"].items())
                   + "; counts are rounded per site, so the all-sites row is the sum of the "
                   "sites' rows, but a site's class counts are noised apart from its "
                   "samples and need not add up to them")
    out += [f"- note: {n}" for n in report.notes]
    classes = range(report.num_classes)
    head = ["site", "client", "samples", *(f"class {j}" for j in classes), "missing values"]
    out += ["", "## Sites", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in [*report.sites, report.total]:
        missing = sum(f.missing for f in s.features)
        out.append("| " + " | ".join([
            _cell(s.name) if s.client >= 0 else "**all sites**",
            str(s.client) if s.client >= 0 else "—", _count(s.samples),
            *(_count(v) for v in s.classes), _count(missing)]) + " |")
    label = report.feature_label
    out += ["", f"## Per {label}", "",
            f"Per {label} and site: values present, missing values, mean, sample standard "
            "deviation (n − 1), minimum and maximum"
            + (" (of all the image's values in that channel)" if label == "channel" else "")
            + ".", "",
            f"| {label} | site | values | missing | mean | std | min | max |",
            "|---|---|---|---|---|---|---|---|"]
    lo, hi = (p["clip"] if p is not None else (math.nan, math.nan))
    for i, f in enumerate(report.total.features):
        for s in [report.total, *report.sites]:
            g = s.features[i]
            low, high = (f"≥ {lo:g}", f"≤ {hi:g}") if p is not None else (_num(g.min),
                                                                          _num(g.max))
            out.append(f"| {_cell(f.name)} | "
                       f"{'**all sites**' if s.client < 0 else _cell(s.name)} | "
                       f"{_count(g.values)} | {_count(g.missing)} | {_num(g.mean)} | "
                       f"{_num(g.std)} | {low} | {high} |")
    return "\n".join(out) + "\n"


def claim_outputs(out: Path, overwrite: bool) -> None:
    """Refuse (exit 2, naming them) existing ``stats.md``/``stats.json`` in ``out``
    without ``overwrite``; refuse links there (:mod:`fedmpi.job.safefile`)."""
    from fedmpi.job.outputs import claim
    from fedmpi.job.rundir import output_dir
    from fedmpi.job.safefile import refuse_links

    output_dir(out)
    refuse_links(out, FILES, "a stats directory")
    claim([out / name for name in FILES], overwrite, "fedmpi stats")


def write_stats(report: StatsReport, out: str | os.PathLike, config: str = "",
                overwrite: bool = False) -> list[Path]:
    """Write ``stats.md`` and ``stats.json`` into ``out``; returns their paths."""
    from fedmpi.job.safefile import write_text

    out = Path(out)
    claim_outputs(out, overwrite)
    md, js = out / "stats.md", out / "stats.json"
    write_text(md, stats_markdown(report, config))
    write_text(js, stats_json(report))
    from fedmpi.job.outputs import record_written

    record_written(out, "stats", [md, js])   # run --overwrite removes them with the run
    return [md, js]
