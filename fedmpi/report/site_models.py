"""The per-site table of a run (``/site_models``, :mod:`fedmpi.consortium.site_models`) in
``summary.md``: for each site, its held-out accuracy (and every other logged metric) under
the local-only model, the global model, its personal model and the fine-tuned global
model, and Δ = the best of the personal and fine-tuned models minus the best of the other
two (local only, global): the number a site's reviewer signs.

A log is untrusted input: used only when ``/site_models/sites`` names K rows,
``/site_models/models`` the four columns and a metric's array is [K, 4].
"""
from __future__ import annotations

import math

import numpy as np

from fedmpi.compare.runs import SITE_MODEL_COLUMNS, site_delta, site_model_arrays
from fedmpi.log.reader import RunLog
from fedmpi.report.derived import METRIC_LABELS, clean_label, metric_names, metric_text

__all__ = ["site_model_lines", "site_model_tables"]


def site_model_tables(log: RunLog) -> tuple[list[str], dict[str, np.ndarray]] | None:
    """(site names, {metric: [K, 4]}) of ``log``, the run's metrics first; None without a
    consistent table (:func:`fedmpi.compare.runs.site_model_arrays`)."""
    got = site_model_arrays(log)
    if got is None:
        return None
    sites, found = got
    order = [m for m in (*metric_names(log), "test_loss") if m in found]
    order += sorted(m for m in found if m not in order)
    return [clean_label(str(s)) for s in sites], {m: found[m] for m in order}


def site_model_lines(log: RunLog) -> list[str]:
    """``## Per-site models`` of ``summary.md``; nothing without ``/site_models``."""
    found = site_model_tables(log)
    if found is None:
        return []
    sites, tables = found
    n = log.arrays.get("site_models/test_samples")
    out = ["", "## Per-site models", "",
           "Each site's held-out data scores the model it trained alone (local only, "
           "`eval.local_only`), the final global model, its personal model (a personalised "
           "method) and the global model fine-tuned at the site (`eval.finetune_epochs`); "
           "Δ = best of personal and fine-tuned − best of local only and global (for a "
           "loss, lowest; Δ < 0 is better). — : not computed."]
    for name, a in tables.items():
        loss = name.endswith("loss")
        deltas = [site_delta(r, loss) for r in a]
        out += ["", f"**{METRIC_LABELS.get(name, name)}**", "",
                "| site | " + " | ".join(SITE_MODEL_COLUMNS) + " | Δ |", "|" + "---|" * 6]
        for i, site in enumerate(sites):
            count = f" ({int(n[i])})" if n is not None and n.shape == (len(sites),) else ""
            cells = [metric_text(v) if math.isfinite(v) else "—" for v in a[i]]
            d = deltas[i]
            out.append(f"| {site}{count} | " + " | ".join(cells) + " | "
                       + (f"{d:+.3f}" if math.isfinite(d) else "—") + " |")
        with np.errstate(all="ignore"):
            means = [np.nanmean(a[:, c]) if np.isfinite(a[:, c]).any() else math.nan
                     for c in range(4)]
        fin = [d for d in deltas if math.isfinite(d)]
        out.append("| mean over sites | " + " | ".join(
            metric_text(v) if math.isfinite(v) else "—" for v in means) + " | "
            + (f"{np.mean(fin):+.3f}" if fin else "—") + " |")
    return out
