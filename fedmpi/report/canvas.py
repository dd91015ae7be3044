"""Matplotlib plumbing of the report's plots: lazy import (the ``plot`` extra),
figures, saving, and the axis helpers every plot shares.

Matplotlib is imported lazily and used through :class:`matplotlib.figure.Figure`
with the Agg canvas only, so the report never touches pyplot's global backend
(safe inside notebooks and on headless nodes).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from fedmpi.errors import UserError
from fedmpi.job.safefile import replacing

__all__ = ["PLOT_HINT", "have_matplotlib"]

_DPI = 120

#: What to do when matplotlib is missing (plots skipped, summary.md still written).
PLOT_HINT = ("plots need matplotlib, which is not installed: pip install -e '.[plot]' "
             "(or pip install matplotlib), then run fedmpi report again")


def mpl() -> Any:
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
    """Whether :func:`fedmpi.report.write_report` can draw the plots."""
    try:
        mpl()
    except UserError:
        return False
    return True


def figure(w: float, h: float):
    return mpl().figure.Figure(figsize=(w, h), dpi=_DPI, layout="constrained")


def save(fig, path: Path) -> Path:
    with replacing(path) as f:   # fedmpi.job.safefile: never through a planted link
        fig.savefig(f, format=path.suffix.lstrip(".") or "png")   # the Agg canvas, no pyplot
    return path


def client_ticks(ax, k: int, names: list[str] | None = None, axis: str = "y") -> None:
    """Ticks on the client axis (at most 25), labelled with the sites' names if given."""
    step = max(1, math.ceil(k / 25))
    ticks = np.arange(0, k, step)
    (ax.set_yticks if axis == "y" else ax.set_xticks)(
        ticks, [names[i] for i in ticks] if names is not None else None,
        fontsize=8 if names is not None else None)


def round_axis(ax) -> None:
    """Integer ticks on the round (x) axis."""
    ax.xaxis.set_major_locator(mpl().ticker.MaxNLocator(integer=True))


def masked(a: np.ndarray) -> np.ma.MaskedArray:
    return np.ma.masked_invalid(np.asarray(a, dtype=np.float64))


def colormap(name: str):
    return mpl().colormaps[name].with_extremes(bad="#d9d9d9")
