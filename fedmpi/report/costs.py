"""What a round costs: ``time_per_round.png`` (wall time split into training, the
overhead's measured parts — waiting for the slowest rank, moving bytes, encoding, recording,
rank 0's own work, the rest — or one "communication + other" bar in an older log,
aggregation, evaluation; :func:`~fedmpi.report.derived.time_split`)
and ``bytes_per_round.png`` (uplink and downlink bytes, and the cumulative traffic)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fedmpi.log.schema import PathLike
from fedmpi.log.reader import RunLog, as_run_log

from fedmpi.report import canvas
from fedmpi.report.derived import (OVERLAPPED, byte_unit, run_components, run_title, time_parts,
    time_split)

__all__ = ["plot_bytes", "plot_time"]


def plot_time(log: RunLog | PathLike, path: Path) -> Path | None:
    """Stacked bars: time per round split into training, each part of the overhead (the
    parts that are not 0 throughout), aggregation, evaluation (inside the round); an
    overlapped evaluation is drawn hatched on top."""
    log = as_run_log(log)
    r = log.rounds.get("round")
    if r is None or len(r) == 0:
        return None
    split = time_split(log)
    parts = time_parts(split, nonzero=True)
    wall = log.rounds.get("wall_seconds")
    if not parts and wall is None:
        return None
    # the overhead's parts make a longer legend in two columns: a wider figure holds it
    fig = canvas.figure(min(14, 6 + 0.08 * len(r)) + (3 if len(parts) > 4 else 0), 5)
    ax = fig.subplots()
    bottom = np.zeros(len(r))
    width = 0.85 if len(r) < 200 else 1.0
    for name, label, color in parts:
        v = split[name]
        ax.bar(r, v, bottom=bottom, width=width, color=color,
               label=f"{label}{' (in the round)' if name == 'eval_seconds' else ''}: "
                     f"mean {_seconds(v.mean())}")
        bottom += v
    over = split.get("eval_overlapped")
    if over is not None and over.any():
        ax.bar(r, over, bottom=bottom, width=width, color="none", edgecolor="C3", hatch="//",
               label=f"{OVERLAPPED}: mean {_seconds(over.mean())}")
    if wall is not None:
        ax.plot(r, wall, "k_" if len(r) <= 60 else "k-", ms=10, lw=0.8,
                label=f"wall time: mean {_seconds(np.nanmean(wall))}")
    ax.set(xlabel="round", ylabel="seconds", title="Time per round")
    canvas.round_axis(ax)
    ax.set_axisbelow(True)
    ax.grid(axis="y", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=8)
    fig.suptitle(run_title(log))
    return canvas.save(fig, path)


def _seconds(x: float) -> str:
    if not math.isfinite(x):
        return "—"
    return f"{x:.3g} s" if x >= 1 else f"{1e3 * x:.3g} ms"


_LINKS = {"bytes_up": ("uplink (clients → server)", "C0"),
          "bytes_down": ("downlink (server → clients)", "C1")}


def plot_bytes(log: RunLog | PathLike, path: Path) -> Path | None:
    """Bytes per round, uplink and downlink each in its own panel (one shared scale, so
    equal traffic — FedAvg sends θ down and Δ up — is two visible, equal bar rows, not one
    line hiding the other), and the cumulative traffic; equal series are drawn once and
    labelled so."""
    log = as_run_log(log)
    r = log.rounds.get("round")
    series = [(n, np.asarray(log.rounds[n], dtype=np.float64)) for n in _LINKS
              if n in log.rounds]
    if r is None or len(r) == 0 or not series:
        return None
    encoded = all(f"{n}_encoded" in log.rounds for n, _ in series)
    wire = not (encoded and all(not np.any(v) for _, v in series))
    if not wire:   # world size 1 sends nothing: draw what each participant's message holds
        series = [(n, np.asarray(log.rounds[f"{n}_encoded"], dtype=np.float64))
                  for n, _ in series]
    unit, scale = byte_unit(max(float(np.max(v)) for _, v in series))
    cum_unit, cum_scale = byte_unit(max(float(np.sum(v)) for _, v in series))
    fig = canvas.figure(11, 4.6)
    grid = fig.add_gridspec(len(series), 2)
    per = [fig.add_subplot(grid[i, 0]) for i in range(len(series))]
    for ax in per[1:]:
        ax.sharex(per[0])
        ax.sharey(per[0])
    ax_c = fig.add_subplot(grid[:, 1])
    width = 0.8 if len(r) < 200 else 1.0
    for ax, (name, v) in zip(per, series):
        label, color = _LINKS[name]
        ax.bar(r, v / scale, width=width, color=color)
        ax.set_title(f"{label}: mean {np.mean(v) / scale:.3g} {unit} per round", fontsize=9)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        canvas.round_axis(ax)
        ax.set_axisbelow(True)
        ax.grid(axis="y", alpha=0.3)
    per[-1].set_xlabel("round")
    equal = len(series) == 2 and np.array_equal(series[0][1], series[1][1])
    drawn = series[:1] if equal else series
    for i, (name, v) in enumerate(drawn):
        label, color = _LINKS[name]
        if equal:
            label = "uplink = downlink (each)"
        ax_c.plot(r, np.cumsum(v) / cum_scale, color=color, lw=2, ls="-" if i == 0 else "--",
                  marker=("o" if i == 0 else "s") if len(r) <= 40 else None, ms=3,
                  label=f"{label}: {np.sum(v) / cum_scale:.3g} {cum_unit}")
    if len(series) == 2:
        total = series[0][1] + series[1][1]
        ax_c.plot(r, np.cumsum(total) / cum_scale, color="0.35", lw=1, ls=":",
                  label=f"both directions: {np.sum(total) / cum_scale:.3g} {cum_unit}")
    ax_c.set(xlabel="round", ylabel=cum_unit, title="Cumulative bytes")
    ax_c.set_ylim(bottom=0)
    canvas.round_axis(ax_c)
    ax_c.grid(alpha=0.3)
    ax_c.legend(fontsize=8)
    what = ("bytes sent per round" if wire else
            "bytes encoded per round (world size 1: nothing was sent)")
    fig.suptitle(f"{run_title(log)}: {what}\n{run_components(log)}", fontsize=10)
    return canvas.save(fig, path)
