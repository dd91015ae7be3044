"""The driver of a run on one rank: set-up agreement, resume, progress, exit codes, final files.

:func:`run` builds the rank (:class:`~fedmpi.runtime.federation.Federation`),
opens the log on rank 0, restores a checkpoint when resuming, runs rounds
until the broadcast command is not ``ROUND``, and writes ``model.pt`` and the
log's final status. Exit codes: 0 completed, 1 a failure (a client raised, a
collective timed out; :class:`~fedmpi.errors.RunFailed`), 2 bad input
(:class:`~fedmpi.errors.UserError`, the same on every rank), 75 interrupted by a
signal (:class:`~fedmpi.errors.RunInterrupted`; resume with ``--resume``). Every
rank raises (never ``SystemExit``); the one error line comes from rank 0.
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from fedmpi.job import checkpoint, signals
from fedmpi import metrics
from fedmpi.runtime.callbacks import AfterRound, Callback
from fedmpi.log.trackers import check_trackers, open_trackers
from fedmpi.comm.endpoint import CommTimeout
from fedmpi.comm.world import Comm
from fedmpi.errors import RunFailed, RunInterrupted, UserError, show_traceback
from fedmpi.imports import run_objects, runtime_error_line
from fedmpi.usercode import UserCode
from fedmpi.job.outputs import OutputError, write_model
from fedmpi.runtime import guard, silo
from fedmpi.runtime.evaluation import FinalEvaluation
from fedmpi.runtime.federation import CMD_ABORT, CMD_ROUND, Federation
from fedmpi.runtime.probe import dry_run
from fedmpi.job.lock import heartbeat, release

if TYPE_CHECKING:
    from fedmpi.config.core import Config


#: How long a worker whose round raised waits before it reports and aborts the job
#: (rank 0, failing the same way, aborts first: one error line per job).
ABORT_GRACE_SECONDS = 2.0


def _finish_pending_quietly(fed: Federation) -> None:
    """After a failure: log the round whose evaluation was still pending, if possible.

    The run is failing already, so a second error here is reported, not raised:
    the first one is the one the job exits with."""
    t = fed.log.pending.round if fed.log.pending is not None else -1
    try:
        fed.log.finish_pending()
    except Exception as exc:  # noqa: BLE001 - reported; the original failure propagates
        message = f"round {t} not logged: its evaluation failed too ({type(exc).__name__}: {exc})"
        print(f"fedmpi: error: {message}", file=sys.stderr, flush=True)
        if fed.log.writer is not None:
            fed.log.writer.event(t, fed.built.rank, -1, message)


def _writer(fed: Optional[Federation]):
    """The log of ``fed`` (None before the build or rank 0's log)."""
    return fed.log.writer if fed is not None else None


def _best_model(fed: Federation, out: Path) -> Callable[[int, float], None]:
    """``checkpoint.keep_best``'s save: the global model of round ``t`` to ``best.pt``,
    its round in the log's root attributes (:mod:`fedmpi.runtime.callbacks`)."""
    def save(t: int, value: float) -> None:
        b, writer = fed.built, fed.log.writer
        assert writer is not None, "rank 0 of a run with a log"
        b.flat.load(fed.global_state)
        write_model(b.flat.model, out / "best.pt")
        for name, v in (("best_round", t), ("best_metric", b.cfg.checkpoint.keep_best.metric),
                        ("best_value", value)):
            writer.set_attr("/", name, v)
    return save


def _close_quietly(after: Optional[AfterRound], status: str) -> None:
    """After a failure: end the trackers' runs; an error there is reported, not raised."""
    try:
        if after is not None:
            after.close(status)
    except Exception as exc:  # noqa: BLE001 - the run's own failure is the one that counts
        print(f"fedmpi: error: closing the trackers failed too: {exc}", file=sys.stderr, flush=True)


def run_comm(cfg: Config) -> Comm:
    """The world communicator of a run: start-up collectives wait up to
    ``runtime.setup_timeout`` (data loading), rounds ``runtime.round_timeout`` (the
    driver switches after the start-up)."""
    comm = Comm(timeout=cfg.runtime.setup_timeout, max_message_bytes=cfg.runtime.max_message_bytes)
    comm.timeout_key = "runtime.setup_timeout"
    return silo.split(comm, cfg)   # runtime.ranks_per_silo: ranks that act as one


def run(cfg: Config, out_dir: Optional[str | Path] = None, comm: Optional[Comm] = None,
        resume: bool = False, overwrite: bool = False,
        code: Optional[UserCode] = None,
        callbacks: Sequence[Callback] = (),
        final: Sequence[FinalEvaluation] = ()) -> Optional[dict[str, float]]:
    """Run a whole experiment on this rank; returns on rank 0 the final metrics
    (``test_accuracy`` and the other ``eval.metrics`` of the last evaluated round),
    None elsewhere. ``code``: objects replacing the config's names (:func:`fedmpi.run`).

    Raises :class:`UserError` (same on every rank) for bad input, and exits the
    whole job non-zero when a rank fails or a collective times out. ``resume``
    continues from ``<out>/checkpoint.pt`` and the log (:mod:`fedmpi.job.checkpoint`).
    SIGTERM/SIGUSR1/SIGINT on any rank: checkpoint after the current round,
    log status ``interrupted``, every rank exits with
    :data:`fedmpi.job.signals.EXIT_INTERRUPTED` (75). ``overwrite`` replaces a previous
    run in the output directory (:mod:`fedmpi.job.rundir`: lock, fingerprint, conventions).
    ``callbacks``: called on rank 0 after each logged round (:mod:`fedmpi.runtime.callbacks`).
    ``final``: evaluations of the completed run, on every rank (:func:`fedmpi.run` passes
    the config's: :func:`fedmpi.consortium.cross_site.final_evaluations`).
    """
    signals.install()
    try:
        comm = silo.split(comm or run_comm(cfg), cfg)
        with comm.answering_pings():   # a timeout names the ranks that do not answer
            return _run(cfg, out_dir, comm, resume, overwrite, code, callbacks, final)
    except KeyboardInterrupt:   # a second Ctrl-C: stop now, without a checkpoint
        if comm is None or comm.size == 1:
            raise
        print(f"fedmpi: error: rank {comm.rank}: interrupted twice (SIGINT); stopping every "
              "rank now, without a checkpoint", file=sys.stderr, flush=True)
        release()
        guard.abort_job(comm, 130)   # the other ranks would otherwise wait in a collective
        raise
    finally:
        signals.restore()
        release()


def set_up(cfg: Config, comm: Comm, out: Optional[Path] = None, code: Optional[UserCode] = None,
           open_dir: Optional[Callable[[Federation], Optional[checkpoint.Restored]]] = None,
           dry: bool = True) -> tuple[Federation, Optional[checkpoint.Restored]]:
    """Collective: build this rank, run the dry run (``dry``; :mod:`.probe`) and, on
    rank 0, ``open_dir`` (lock, resume checks, the log: :func:`guard.open_run`) — in this
    order, so an error in the build or the dry run leaves no run directory. Any rank's
    error stops every rank, reported once (:func:`guard.agree_on_setup`)."""
    error: Optional[BaseException] = None
    fed = None
    restored: Optional[checkpoint.Restored] = None
    try:
        fed = Federation(cfg, comm, out, code)
        if dry:
            dry_run(fed.built, code.model if code is not None else None)
        if comm.rank == 0 and open_dir is not None:
            restored = open_dir(fed)
    except (UserError, OutputError) as exc:
        error = exc
    except CommTimeout as exc:   # a rank slower than runtime.setup_timeout: one line
        guard.setup_timed_out(comm, exc, _writer(fed))
    except Exception as exc:  # noqa: BLE001 - any setup failure must stop every rank
        error = exc
        if comm.rank != 0 or show_traceback():   # rank 0 raises it: its traceback is printed
            traceback.print_exc()
    try:
        guard.agree_on_setup(comm, error)   # the error line once, every rank stops
    except CommTimeout as exc:
        guard.setup_timed_out(comm, exc, _writer(fed))
    assert fed is not None
    return fed, restored


def check(cfg: Config, comm: Optional[Comm] = None) -> str:
    """``fedmpi check --dry-run``: :func:`set_up` without a run directory; returns (on
    every rank) the line saying what was built and checked."""
    comm = silo.split(comm or run_comm(cfg), cfg)
    fed, _ = set_up(cfg, comm)
    b = fed.built
    hosted = comm.max_int(len(b.hosted), what="dry run summary")
    return (f"dry run passed on {comm.size} rank(s): data {b.data.num_classes} classes, inputs "
            f"{tuple(b.data.input_shape)}, {b.num_clients} clients (up to {hosted} per rank, one "
            f"forward/backward batch each, one evaluation batch); model {cfg.model.name} "
            f"({b.flat.size} values, {b.num_outputs} outputs); method {cfg.algorithm.name}; "
            f"weighting {cfg.aggregation.weighting}; transforms {list(cfg.transforms) or 'none'}")


def _run(cfg: Config, out_dir: Optional[str | Path], comm: Comm, resume: bool,
         overwrite: bool = False, code: Optional[UserCode] = None,
         callbacks: Sequence[Callback] = (),
         finals: Sequence[FinalEvaluation] = ()) -> Optional[dict[str, float]]:
    out = Path(out_dir) if out_dir else Path(cfg.runtime.out_dir) / cfg.name
    after: Optional[AfterRound] = None

    def open_dir(fed: Federation) -> Optional[checkpoint.Restored]:
        """Rank 0, after the build and the dry run: the run directory, then the
        trackers and the after-round hooks (best model, early stopping, callbacks)."""
        nonlocal after
        check_trackers(cfg)   # a missing extra is bad input before anything is written
        for evaluation in finals:
            evaluation.claim(out, resume, overwrite)
        opened = guard.open_run(fed.run_state(), guard.LogHeader.of(fed.built), out, resume,
                                overwrite)
        fed.log.history = opened.history   # the rounds a resumed run has logged
        try:
            trackers = open_trackers(cfg)
        except Exception:   # an MLflow server that answers with an error: no round ran,
            opened.writer.set_status("failed")   # so nothing may block the next plain run
            opened.writer.close()
            guard.discard_unstarted(out, 0, resume)
            raise
        fed.log.after = after = AfterRound(cfg, _best_model(fed, out), trackers, callbacks)
        return opened.restored

    fed, restored = set_up(cfg, comm, out, code, open_dir, dry=not resume)
    try:
        start = checkpoint.resume(fed.run_state(), restored) if resume else 0
    except CommTimeout as exc:
        guard.setup_timed_out(comm, exc, fed.log.writer)
    fed.status.checkpoint_round = start
    if comm.timeout_key == "runtime.setup_timeout":
        comm.timeout, comm.timeout_key = cfg.runtime.round_timeout, "runtime.round_timeout"
    if after is not None:
        after.replay(fed.log.history)   # a resumed run's best value and patience count

    progress = None
    if comm.rank == 0 and cfg.runtime.progress:
        from tqdm import tqdm

        progress = tqdm(total=cfg.train.rounds, initial=min(start, cfg.train.rounds), desc=cfg.name,
                        unit="round", file=sys.stderr, dynamic_ncols=True)
    status = "completed"
    try:
        t = start
        while True:
            if comm.rank == 0:
                heartbeat()   # the lock says this run is alive (other hosts too)
            cmd = fed.round(t)
            if cmd != CMD_ROUND:
                break
            if progress is not None:
                if fed.log.history:   # with eval.overlap the newest row lags one round behind
                    h = fed.log.history[-1]
                    progress.set_postfix(acc=f"{h['test_accuracy']:.4f}",
                                         loss=f"{h['train_loss']:.4f}", refresh=False)
                progress.update(1)
            t += 1
        if cmd == CMD_ABORT:
            status = "failed"
        elif fed.status.stop_reason is not None and t < cfg.train.rounds:
            status = "interrupted"
        else:   # every rank knows the status from the headers: a collective is safe
            for evaluation in finals:
                evaluation.run(fed.view, t)
    except OutputError as exc:   # disk full: one line naming the file, exit 1
        guard.write_failed(fed.log.writer, comm, exc, t)
    except KeyboardInterrupt:   # a second Ctrl-C: the log must not stay "running"
        writer = fed.log.writer
        if writer is not None:
            try:
                writer.event(t, comm.rank, -1, "interrupted twice (SIGINT): stopped in "
                             f"round {t} without a checkpoint of it")
                writer.set_status("failed")
                writer.close()
            except Exception:  # noqa: BLE001 - the stop itself must not be delayed
                pass
        raise   # run() aborts every rank
    except CommTimeout as exc:   # one line naming the missing ranks; lock released
        _finish_pending_quietly(fed)
        _close_quietly(after, "failed")
        guard.end_job(fed.log.writer, comm, exc, t)
    except Exception as exc:  # noqa: BLE001 - a rank outside local training failed
        b = fed.built
        line, user = runtime_error_line(exc, run_objects(b.algo, b.flat.model, b.weighting,
                                                         b.transforms, b.rule))
        line = f"{line} (round {t} on rank {comm.rank})"
        if show_traceback() or not user:   # a fedmpi bug: show where
            traceback.print_exc()
        _finish_pending_quietly(fed)
        writer = fed.log.writer
        if writer is not None:
            writer.event(t, comm.rank, -1, line)
            writer.set_status("failed")
            writer.close()
        _close_quietly(after, "failed")
        if comm.size == 1:   # nobody waits in a collective: an exception, not an abort
            logged = len(fed.log.history) + (fed.log.pending is not None)
            kept = guard.discard_unstarted(out, logged, resume)
            raise RunFailed(line, log_path=str(out / "log.h5") if kept else None) from exc
        if comm.rank != 0:
            # code that every rank runs (a method's begin_round) fails on every rank: give
            # rank 0 the time to report it and end the job, so the line appears once
            time.sleep(ABORT_GRACE_SECONDS)
        print(f"fedmpi: error: {line}", file=sys.stderr, flush=True)
        release()   # abort skips run()'s finally
        guard.abort_job(comm, 1)
    finally:
        if progress is not None:
            progress.close()

    if comm.rank != 0:
        if status == "failed":
            raise RunFailed("the run failed (rank 0 reports why)", quiet=True)
        if status == "interrupted":
            raise RunInterrupted("the run was interrupted (rank 0 reports where)", quiet=True)
        return None
    log, run = fed.log, fed.status
    assert log.writer is not None, "rank 0 of a run has its log open"
    logged = len(log.history) + (log.pending is not None)
    if status != "failed" and guard.has_result(out, logged, resume):   # else: no final model
        # (the stop released the uplink buffers: the copy model.pt is written from does
        # not add to the peak)
        fed.built.flat.load(fed.global_state)
        write_model(fed.built.flat.model, out / "model.pt")
    log.writer.set_status(status)
    log.writer.close()
    if after is not None:
        after.close(status)
    if status == "failed":
        kept = guard.discard_unstarted(out, logged, resume)
        raise RunFailed(str(run.failure), log_path=str(out / "log.h5") if kept else None)
    if status == "interrupted":
        kept = guard.discard_unstarted(out, logged, resume)
        raise RunInterrupted(guard.interrupted_message(run.stop_reason, t, cfg.train.rounds,
                                                       run.checkpoint_round, out, kept),
                             log_path=str(out / "log.h5") if kept else None)
    names = ("test_accuracy", *metrics.extra_names(cfg.eval.metrics))
    final: dict = next((h for h in reversed(log.history) if not np.isnan(h["test_accuracy"])), {})
    result = {n: float(final.get(n, float("nan"))) for n in names}
    last = log.history[-1] if log.history else {}
    for _, part in fed.built.components:   # the components' own final numbers (ε)
        for name in part.final_scalars:
            result[name] = float(last.get(name, float("nan")))
    return result
