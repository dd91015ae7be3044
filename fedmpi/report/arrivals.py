"""Arrivals, staleness and participation of a deadline or buffered run (``round.mode``,
docs/rounds.md): ``arrivals.png`` and the summary's "Arrivals and staleness" section.

Such a run logs, per server step t and client k, the model version v_{t,k} the update
aggregated at step t was trained from (``/clients/version``, NaN when k's update is not
in the step), its staleness weight s(τ) (``/clients/staleness_weight``) and its arrival
time (``/clients/arrival_seconds``); the step's own time is ``/rounds/virtual_seconds``
(the simulated clock of ``round.clock: virtual``) or ``/rounds/elapsed_seconds`` (wall).
The staleness of an update is τ_{t,k} = t − v_{t,k} (0: trained from the newest model).
A synchronous run logs none of these and gets neither plot nor section.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedmpi.log.schema import PathLike
from fedmpi.log.reader import RunLog, as_run_log

from fedmpi.report import canvas
from fedmpi.report.derived import run_title, site_labels

__all__ = ["Arrivals", "arrivals", "arrival_lines", "plot_arrivals"]


@dataclass(frozen=True)
class Arrivals:
    """Per step t (row) and client k (column): ``staleness`` τ_{t,k}, ``weight`` s(τ) and
    ``arrival`` time, NaN where k's update is not in step t; ``steps`` the rounds' numbers,
    ``step_time`` each step's time and ``clock`` its name (``virtual_seconds`` or
    ``elapsed_seconds``)."""

    steps: np.ndarray
    staleness: np.ndarray
    weight: np.ndarray
    arrival: np.ndarray
    step_time: np.ndarray | None
    clock: str | None

    @property
    def took(self) -> np.ndarray:
        """[T, K]: whether client k's update is in step t."""
        return np.isfinite(self.staleness)


def arrivals(log: RunLog | PathLike) -> Arrivals | None:
    """The run's arrivals, or None for a run without them (a synchronous round)."""
    log = as_run_log(log)
    version = log.clients.get("version")
    if version is None or version.size == 0:
        return None
    steps = np.asarray(log.rounds["round"], dtype=np.float64)
    v = np.asarray(version, dtype=np.float64)
    clock = next((c for c in ("virtual_seconds", "elapsed_seconds") if c in log.rounds), None)
    nan = np.full_like(v, np.nan)
    return Arrivals(steps=steps.astype(np.int64), staleness=steps[:, None] - v,
                    weight=np.asarray(log.clients.get("staleness_weight", nan), np.float64),
                    arrival=np.asarray(log.clients.get("arrival_seconds", nan), np.float64),
                    step_time=(np.asarray(log.rounds[clock], np.float64) if clock else None),
                    clock=clock)


def arrival_lines(log: RunLog | PathLike) -> list[str]:
    """``## Arrivals and staleness``: the round mode and clock, updates per step, the
    staleness over all updates, and one row per client (updates aggregated, mean and
    max τ, mean s(τ), last arrival); empty for a run without arrivals."""
    log = as_run_log(log)
    a = arrivals(log)
    if a is None:
        return []
    from fedmpi.compare.runs import config_value

    mode = config_value(log.config, "round.mode", "?")
    clock = {"virtual_seconds": "virtual (simulated) seconds",
             "elapsed_seconds": "wall-clock seconds"}.get(a.clock or "", "?")
    took = a.took
    tau = a.staleness[took]
    per_step = took.sum(axis=1)
    lines = ["", "## Arrivals and staleness", "",
             f"round.mode **{mode}**; times in {clock}. An update's staleness τ = the step "
             "that aggregated it − the model version it was trained from; s(τ) its weight "
             "(`arrivals.png`).", "", "| | value |", "|---|---|",
             f"| server steps | {len(a.steps)} |",
             f"| updates aggregated | {int(took.sum())} ({int(per_step.min()) if per_step.size else 0}"
             f"–{int(per_step.max()) if per_step.size else 0} per step) |"]
    if tau.size:
        lines.append(f"| staleness τ: mean / max | {tau.mean():.2f} / {int(tau.max())} |")
        lines.append(f"| updates with τ > 0 | {int((tau > 0).sum())} "
                     f"({100 * (tau > 0).mean():.1f} %) |")
    if a.step_time is not None and a.step_time.size:
        lines.append(f"| time of the last step | {a.step_time[-1]:.4g} |")
    dropped = _dropped(log)
    names = site_labels(log)
    lines += ["", "Participation per client (updates aggregated; a dropped update is one "
              "that missed its round under `round.late: drop` or was older than "
              "`round.max_staleness`):", "",
              "| site | updates | dropped | mean τ | max τ | mean s(τ) | last arrival |",
              "|---|---|---|---|---|---|---|"]
    for k, name in enumerate(names):
        col = took[:, k]
        t_k, w_k, arr = a.staleness[col, k], a.weight[col, k], a.arrival[col, k]
        cells = ([f"{t_k.mean():.2f}", str(int(t_k.max())),
                  f"{np.nanmean(w_k):.3f}" if np.isfinite(w_k).any() else "—",
                  f"{np.nanmax(arr):.4g}" if np.isfinite(arr).any() else "—"]
                 if col.any() else ["—"] * 4)
        lines.append(f"| {name} | {int(col.sum())} | {dropped.get(k, 0)} | "
                     + " | ".join(cells) + " |")
    return lines


def _dropped(log: RunLog) -> dict[int, int]:
    """Dropped updates per client, from the run's events."""
    ev = log.events
    out: dict[int, int] = {}
    for client, msg in zip(ev.get("client", []), ev.get("message", [])):
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        if int(client) >= 0 and text.startswith("update of client") and "dropped" in text:
            out[int(client)] = out.get(int(client), 0) + 1
    return out


def plot_arrivals(log: RunLog | PathLike, path: Path) -> Path | None:
    """Two panels over the server steps: the staleness τ of every aggregated update,
    clients × steps (grey: not in the step), and each update's arrival time after the
    previous step, with the step's own time after it (the round's length)."""
    log = as_run_log(log)
    a = arrivals(log)
    if a is None or not a.took.any():
        return None
    T, K = a.staleness.shape
    fig = canvas.figure(min(14, 6.5 + 0.08 * T), min(10, 4.5 + 0.3 * K))
    top, bottom = fig.subplots(2, 1, sharex=True)
    extent = (a.steps[0] - 0.5, a.steps[-1] + 0.5, K - 0.5, -0.5)
    im = top.imshow(canvas.masked(a.staleness.T), aspect="auto", interpolation="nearest",
                    cmap=canvas.colormap("magma_r"), extent=extent, vmin=0.0)
    fig.colorbar(im, ax=top, label="staleness τ (steps)")
    canvas.client_ticks(top, K, site_labels(log))
    top.set(ylabel="site")
    top.set_title(f"{run_title(log)}: staleness of each aggregated update\n"
                  "grey = no update of this site in the step", fontsize=10)
    label = {"virtual_seconds": "virtual (simulated) s", "elapsed_seconds": "wall s"}.get(
        a.clock or "", "s")
    rr, kk = np.nonzero(a.took)
    # time since the previous step: when in its round an update came in (< 0: before the
    # previous step, i.e. it waited — carried or buffered)
    prev = (np.concatenate([[0.0], a.step_time[:-1]]) if a.step_time is not None
            else np.zeros(T))
    sc = bottom.scatter(a.steps[rr], a.arrival[rr, kk] - prev[rr], c=kk, s=10,
                        cmap=canvas.mpl().colormaps["tab10" if K <= 10 else "viridis"])
    if a.step_time is not None:
        bottom.step(a.steps, a.step_time - prev, where="mid", color="black", lw=1,
                    label="step applied")
        bottom.legend(loc="upper right", fontsize=8)
    bottom.axhline(0.0, color="grey", lw=0.5)
    fig.colorbar(sc, ax=bottom, label="site")
    bottom.set(xlabel="server step", ylabel=f"arrival − previous step ({label})")
    canvas.round_axis(bottom)
    return canvas.save(fig, path)
