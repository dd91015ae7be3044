"""``fedmpi runs [DIR]``: every run directory under ``DIR`` at a glance.

A *run directory* is a directory holding a run's files (``log.h5``,
``checkpoint.pt``, ``model.pt``) or its lock (``.fedmpi.lock``); the walk does not
descend into one (its ``report/`` is not another run). For each, read without
writing anything and without taking its lock:

- **status**: the log's (``completed``, ``failed``, ``interrupted``); ``running``
  while a live process holds the lock (:func:`fedmpi.job.lock.lock_holder`; then
  **lock** says who, with its last heartbeat); ``ended`` for a log still marked
  running whose writer is gone and whose lock is free or stale
  (:func:`fedmpi.log.reader.ended_without_status` says why);
- **rounds**: complete rounds in the log of ``train.rounds`` planned;
- **metric**: the metric the run follows (``checkpoint.keep_best.metric``, else
  ``train.early_stopping.metric``, with their ``mode``), else ``test_accuracy``
  (``max``): its last finite value and its best, with their rounds;
- **resume**: what ``fedmpi run --resume`` would do, by the rules it applies
  (:mod:`fedmpi.job.rundir`): ``no`` while the run is alive or without a checkpoint;
  the checkpoint is read and checked as ``--resume`` reads it
  (:func:`fedmpi.job.checkpoint_file.read_checkpoint`: format, checksum, finite state),
  must belong to the log's run (its fingerprint) and the log must hold every round it
  covers; then ``yes`` (from its round), or ``extend`` for a completed run
  (``--resume --set train.rounds=N`` continues it).

Logs and checkpoints are untrusted input, read by the checking readers
(:func:`fedmpi.log.reader.read`, :func:`~fedmpi.job.checkpoint_file.read_checkpoint`):
a corrupt or foreign directory is listed with its problem, never a traceback.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from fedmpi.errors import UserError
from fedmpi.job.lock import LOCK_NAME, LockHolder, lock_holder
from fedmpi.job.rundir import RUN_FILES
from fedmpi.log.reader import RunLog, ended_without_status, read

from fedmpi.compare.runs import config_value

__all__ = ["RunEntry", "entries_json", "entries_table", "followed_metric", "list_runs",
           "run_entry"]


@dataclass
class RunEntry:
    """One run directory as ``fedmpi runs`` lists it (module docstring); ``problem``
    names what could not be read (then the other fields say what could)."""

    path: str
    status: str
    rounds_done: Optional[int] = None
    rounds_planned: Optional[int] = None
    metric: Optional[str] = None
    mode: Optional[str] = None
    last: Optional[float] = None
    last_round: Optional[int] = None
    best: Optional[float] = None
    best_round: Optional[int] = None
    resume: str = "no"
    resume_note: str = ""
    lock: Optional[dict[str, Any]] = None
    note: Optional[str] = None
    problem: Optional[str] = None


def followed_metric(log: RunLog) -> tuple[str, str]:
    """``(metric, mode)`` the run follows: ``checkpoint.keep_best``, else
    ``train.early_stopping``, else ``("test_accuracy", "max")``."""
    for block in ("checkpoint.keep_best", "train.early_stopping"):
        metric = config_value(log.config, f"{block}.metric")
        if isinstance(metric, str) and metric:
            mode = config_value(log.config, f"{block}.mode", "max")
            return metric, "min" if mode == "min" else "max"
    return "test_accuracy", "max"


def _metric_values(entry: RunEntry, log: RunLog) -> None:
    entry.metric, entry.mode = followed_metric(log)
    values = log.rounds.get(entry.metric)
    rounds = log.rounds.get("round")
    if values is None or rounds is None:
        return
    values = np.asarray(values, dtype=np.float64)
    good = np.flatnonzero(np.isfinite(values))
    if not good.size:
        return
    best = good[int(np.argmin(values[good]) if entry.mode == "min" else np.argmax(values[good]))]
    entry.last, entry.last_round = float(values[good[-1]]), int(rounds[good[-1]])
    entry.best, entry.best_round = float(values[best]), int(rounds[best])


def _holder_json(holder: LockHolder) -> dict[str, Any]:
    return {"host": holder.host, "pid": holder.pid, "since": holder.since,
            "heartbeat": holder.heartbeat, "text": holder.describe()}


def _resume(entry: RunEntry, path: Path, log: Optional[RunLog]) -> None:
    """``entry.resume``/``resume_note`` by the rules ``--resume`` applies."""
    if entry.status == "running":
        entry.resume_note = "the run is alive (it holds the lock)"
        return
    ckpt_path = path / "checkpoint.pt"
    if not ckpt_path.is_file():
        entry.resume_note = ("no checkpoint: it stopped before its first one (start it again "
                             "with --overwrite)" if log is not None else "no checkpoint")
        return
    if log is None:
        entry.resume_note = "no readable log.h5 beside the checkpoint"
        return
    from fedmpi.job.checkpoint_file import read_checkpoint

    try:
        ckpt = read_checkpoint(ckpt_path)
    except UserError as exc:
        entry.resume_note = str(exc)
        return
    stored = log.attrs.get("fingerprint")
    if stored is not None and ckpt["fingerprint"] != stored:
        entry.resume_note = f"{ckpt_path} belongs to another run than log.h5 (fingerprints differ)"
        return
    done = int(ckpt["round"])
    logged = [int(r) for r in log.rounds.get("round", []) if r < done]
    if logged != list(range(done)):
        entry.resume_note = (f"checkpoint of rounds 0..{done - 1}, but log.h5 holds "
                             f"{len(logged)} of them")
        return
    if entry.status == "completed":
        entry.resume = "extend"
        entry.resume_note = (f"complete; --resume --set train.rounds=N (N > {done}) continues it "
                             f"from round {done}")
        return
    entry.resume = "yes"
    entry.resume_note = f"from round {done}"


def run_entry(path: str | os.PathLike) -> RunEntry:
    """One run directory's :class:`RunEntry` (never raises for what the directory
    holds: problems are in ``problem`` and ``resume_note``)."""
    path = Path(path)
    entry = RunEntry(path=str(path), status="?")
    holder = lock_holder(path)
    alive = holder is not None and not holder.stale()
    if alive:
        assert holder is not None
        entry.lock = _holder_json(holder)
    elif holder is not None:
        entry.note = f"stale lock ({holder.describe()}): taken over by the next start"
    log: Optional[RunLog] = None
    if (path / "log.h5").exists():
        try:
            log = read(path / "log.h5")
        except (UserError, OSError) as exc:
            entry.problem = str(exc)
    else:
        entry.problem = "no log.h5 (" + ", ".join(
            n for n in (*RUN_FILES, LOCK_NAME) if (path / n).exists()) + ")"
    if log is not None:
        entry.status = str(log.status)
        entry.rounds_done = log.num_rounds
        planned = config_value(log.config, "train.rounds")
        entry.rounds_planned = int(planned) if isinstance(planned, (int, float)) else None
        _metric_values(entry, log)
        stop = log.attrs.get("stop_reason")
        if stop:
            entry.note = str(stop)
        if entry.status == "running" and not alive:
            entry.status = "ended"
            entry.note = ended_without_status(log) or ("ended without a final status: its "
                                                       "lock is gone")
    if alive:
        entry.status = "running"
    elif log is None and entry.status == "?":
        entry.status = "unreadable" if (path / "log.h5").exists() else "no log"
    _resume(entry, path, log)
    return entry


def _is_run_dir(path: Path) -> bool:
    return any((path / name).exists() or (path / name).is_symlink()
               for name in (*RUN_FILES, LOCK_NAME))


def list_runs(root: str | os.PathLike = "runs") -> list[RunEntry]:
    """Every run directory under ``root`` (``root`` itself included), sorted by path.
    A directory that cannot be listed is an entry with its problem.

    Raises
    ------
    UserError
        ``root`` is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"fedmpi runs: {root}: no such directory (give the directory holding "
                        "the run directories, e.g. runs/)")
    entries: list[RunEntry] = []

    def unreadable(exc: OSError) -> None:
        entries.append(RunEntry(path=str(exc.filename), status="unreadable",
                                problem=f"cannot list the directory ({exc.strerror})"))

    for folder, subdirs, _ in os.walk(root, onerror=unreadable, followlinks=False):
        here = Path(folder)
        if _is_run_dir(here):
            entries.append(run_entry(here))
            subdirs[:] = []     # its report/ and stats/ are not runs
        else:
            subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
    return sorted(entries, key=lambda e: e.path)


def _number(x: Optional[float]) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.4f}"


def entries_table(entries: list[RunEntry], root: str | os.PathLike = ".") -> str:
    """The entries as an aligned text table, paths relative to ``root``; a run's lock
    holder, note or problem on an indented line below it."""
    head = ("run", "status", "rounds", "metric", "last", "best", "resume")
    rows = []
    for e in entries:
        rel = os.path.relpath(e.path, root) if e.path != str(root) else "."
        rounds = (f"{e.rounds_done}/{e.rounds_planned if e.rounds_planned is not None else '?'}"
                  if e.rounds_done is not None else "—")
        last = f"{_number(e.last)} (r{e.last_round})" if e.last is not None else "—"
        best = f"{_number(e.best)} (r{e.best_round})" if e.best is not None else "—"
        rows.append(((rel, e.status, rounds, e.metric or "—", last, best, e.resume), e))
    widths = [max([len(h), *(len(r[i]) for r, _ in rows)]) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head)]
    for cells, e in rows:
        out.append(line(cells))
        details = ([f"lock: {e.lock['text']}"] if e.lock else []) + \
            [d for d in (e.note, e.problem) if d] + \
            ([f"resume: {e.resume_note}"] if e.resume_note and not e.lock else [])
        out += [f"    {d}" for d in details]
    if not entries:
        out.append(f"(no run directories under {root})")
    return "\n".join(out) + "\n"


def entries_json(entries: list[RunEntry]) -> list[dict[str, Any]]:
    """The entries as JSON-ready dicts (NaN-free: a missing number is null)."""
    return [asdict(e) for e in entries]
