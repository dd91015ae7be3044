"""The driver of a run on one rank: set-up agreement, resume, progress, exit codes, final files.

:func:`run` builds the rank (:class:`~fedmpi.runtime.federation.Federation`),
opens the log on rank 0, restores a checkpoint when resuming, runs rounds
until the broadcast command is not ``ROUND``, and writes ``model.pt`` and the
log's final status. Exit codes: 0 completed, 1 a failure (a client raised, a
collective timed out), 2 bad input (:class:`~fedmpi.errors.UserError`, the
same on every rank), 75 interrupted by a signal (resume with ``--resume``).
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Optional

import numpy as np

from .. import checkpoint, metrics, rundir, signals
from ..comm import Comm, CommTimeout
from ..errors import UserError
from ..imports import UserCode
from ..outputs import OutputError, write_model
from . import guard
from .federation import CMD_ABORT, CMD_ROUND, Federation


def _finish_pending_quietly(fed: Federation) -> None:
    """After a failure: log the round whose evaluation was still pending, if possible.

    The run is failing already, so a second error here is reported, not raised:
    the first one is the one the job exits with."""
    t = fed.recorder.pending[0] if fed.recorder.pending is not None else -1
    try:
        fed.finish_pending_row()
    except Exception as exc:  # noqa: BLE001 - reported; the original failure propagates
        message = f"round {t} not logged: its evaluation failed too ({type(exc).__name__}: {exc})"
        print(f"fedmpi: error: {message}", file=sys.stderr, flush=True)
        if fed.writer is not None:
            fed.writer.event(t, fed.rank, -1, message)


def run(cfg, out_dir: Optional[str | Path] = None, comm: Optional[Comm] = None,
        resume: bool = False, overwrite: bool = False,
        code: Optional[UserCode] = None) -> Optional[dict[str, float]]:
    """Run a whole experiment on this rank; returns on rank 0 the final metrics
    (``test_accuracy`` and the other ``eval.metrics`` of the last evaluated round),
    None elsewhere. ``code``: objects replacing the config's names (:func:`fedmpi.run`).

    Raises :class:`UserError` (same on every rank) for bad input, and exits the
    whole job non-zero when a rank fails or a collective times out. ``resume``
    continues from ``<out>/checkpoint.pt`` and the log (:mod:`fedmpi.checkpoint`).
    SIGTERM/SIGUSR1/SIGINT on any rank: checkpoint after the current round,
    log status ``interrupted``, every rank exits with
    :data:`fedmpi.signals.EXIT_INTERRUPTED` (75). ``overwrite`` replaces a previous
    run in the output directory (:mod:`fedmpi.rundir`: lock, fingerprint, conventions).
    """
    signals.install()
    try:
        return _run(cfg, out_dir, comm, resume, overwrite, code)
    finally:
        signals.restore()
        rundir.release()


def _run(cfg, out_dir: Optional[str | Path], comm: Optional[Comm], resume: bool,
         overwrite: bool = False, code: Optional[UserCode] = None) -> Optional[dict[str, float]]:
    comm = comm or Comm(timeout=cfg.runtime.round_timeout)
    if comm.rank == 0:
        for old, new in getattr(cfg, "renamed", ()):
            print(f"fedmpi: note: config key {old!r} is now {new!r}", file=sys.stderr, flush=True)
    out = Path(out_dir) if out_dir else Path(cfg.runtime.out_dir) / cfg.name
    error: Optional[BaseException] = None
    fed = None
    restored: Optional[checkpoint.Restored] = None
    try:
        fed = Federation(cfg, comm, out, code)
        if comm.rank == 0:   # lock, fingerprint and resume checks, the log (guard, rundir)
            restored = guard.open_run(fed, out, resume, overwrite)
    except (UserError, OutputError) as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - any setup failure must stop every rank
        error = exc
        traceback.print_exc()
    guard.agree_on_setup(comm, error)   # the error line once, every rank stops
    assert fed is not None
    start = checkpoint.resume(fed, restored) if resume else 0
    fed.checkpoint_round = start

    progress = None
    if comm.rank == 0 and cfg.runtime.progress:
        from tqdm import tqdm

        progress = tqdm(total=cfg.train.rounds, initial=min(start, cfg.train.rounds), desc=cfg.name,
                        unit="round", file=sys.stderr, dynamic_ncols=True)
    status = "completed"
    try:
        t = start
        while True:
            cmd = fed.round(t)
            if cmd != CMD_ROUND:
                break
            if progress is not None:
                if fed.history:   # with eval.overlap the newest row lags one round behind
                    h = fed.history[-1]
                    progress.set_postfix(acc=f"{h['test_accuracy']:.4f}",
                                         loss=f"{h['train_loss']:.4f}", refresh=False)
                progress.update(1)
            t += 1
        if cmd == CMD_ABORT:
            status = "failed"
        elif fed.stop_reason is not None and t < cfg.train.rounds:
            status = "interrupted"
    except OutputError as exc:   # disk full: one line naming the file, exit 1
        guard.write_failed(fed, comm, exc, t)
    except CommTimeout as exc:
        print(f"fedmpi: error: {exc}", file=sys.stderr, flush=True)
        _finish_pending_quietly(fed)
        if fed.writer is not None:
            fed.writer.event(t, comm.rank, -1, str(exc))
            fed.writer.set_status("failed")
            fed.writer.close()
        comm.abort(1)
    except Exception as exc:  # noqa: BLE001 - a rank outside local training failed
        print(f"fedmpi: error: rank {comm.rank}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        traceback.print_exc()
        _finish_pending_quietly(fed)
        if fed.writer is not None:
            fed.writer.event(t, comm.rank, -1, f"{type(exc).__name__}: {exc}")
            fed.writer.set_status("failed")
            fed.writer.close()
        comm.abort(1)
    finally:
        if progress is not None:
            progress.close()

    if comm.rank != 0:
        if status == "failed":
            raise SystemExit(1)
        if status == "interrupted":
            raise SystemExit(signals.EXIT_INTERRUPTED)
        return None
    if status != "failed":   # a failed run has no final model
        fed.flat.load(fed.global_state)
        write_model(fed.flat.model, out / "model.pt")
    fed.writer.set_status(status)
    fed.writer.close()
    if status == "failed":
        print(f"fedmpi: error: {fed.failure}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if status == "interrupted":
        print(guard.interrupted_message(fed, t, out), file=sys.stderr, flush=True)
        raise SystemExit(signals.EXIT_INTERRUPTED)
    names = ("test_accuracy", *metrics.extra_names(cfg.eval.metrics))
    final: dict = next((h for h in reversed(fed.history) if not np.isnan(h["test_accuracy"])), {})
    out = {n: float(final.get(n, float("nan"))) for n in names}
    if fed.budget is not None:   # ε at privacy.dp.delta after the last round run
        out["epsilon"] = fed.budget.accountant.epsilon
    return out
