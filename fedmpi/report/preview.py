"""``fedmpi partition``: preview a data split without training — ``partition.png``,
``partition.csv`` and the per-client lines to print."""
from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedmpi.job.safefile import write_text

from fedmpi.report import canvas
from fedmpi.report.heatmaps import plot_partition

__all__ = ["partition_preview"]


def partition_preview(partition: Any, out_dir: str | os.PathLike, name: str = "",
                      overwrite: bool = False, site_names: Sequence[str] | None = None
                      ) -> list[str]:
    """``fedmpi partition``: write ``partition.png`` and ``partition.csv`` into
    ``out_dir`` and return the lines to print (per-client sizes, hold-out, files).

    ``partition`` is a :class:`fedmpi.data.Partition` (from
    :func:`fedmpi.data.build_partition`, the function a run uses); ``site_names``: the
    sites' names (:func:`fedmpi.data.silos.site_names`), else ``client k``.
    ``partition.csv`` has one row per client: ``client, size, class_0, ...`` and, with
    ``site_names``, ``site``.
    """
    from fedmpi.job.outputs import claim

    canvas.mpl()
    out = Path(out_dir)
    claim([out / "partition.png", out / "partition.csv"], overwrite, "fedmpi partition")
    out.mkdir(parents=True, exist_ok=True)
    counts = np.asarray(partition.class_counts, dtype=np.int64)
    sizes = counts.sum(axis=1)
    k, c = counts.shape
    names = list(site_names) if site_names is not None else [f"client {i}" for i in range(k)]
    png = plot_partition(counts, out / "partition.png",
                         f"{name + ': ' if name else ''}partition of {int(sizes.sum())} samples "
                         f"into {k} clients ({len(partition.validation_indices)} held out)",
                         site_names=names)
    csv_path = out / "partition.csv"
    text = io.StringIO()
    table = csv.writer(text, lineterminator="\n")
    site = ["site"] if site_names is not None else []
    table.writerow(["client", "size", *(f"class_{j}" for j in range(c)), *site])
    table.writerows([i, sizes[i], *counts[i], *([names[i]] if site else [])] for i in range(k))
    write_text(csv_path, text.getvalue())
    present = (counts > 0).sum(axis=1)
    width = max(4, *(len(n) for n in names)) if site else 0
    label = (lambda text: f"{text:<{width}}  ") if site else (lambda text: "")  # noqa: E731
    lines = [f"{label('site')}client  size  classes  largest class share"]
    for i in range(k):
        share = counts[i].max() / sizes[i] if sizes[i] else math.nan
        lines.append(f"{label(names[i])}{i:6d}  {sizes[i]:4d}  {present[i]:7d}  {share:.2f}")
    lines += [f"clients: {k}, samples: {int(sizes.sum())} (min {sizes.min()}, max {sizes.max()}, "
              f"mean {sizes.mean():.1f}), server hold-out: {len(partition.validation_indices)}",
              str(png), str(csv_path)]
    return lines
