"""Run-level safety nets the driver calls at a few points (issue 18).

Kept out of :mod:`fedmpi.runtime` so the driver only has one-line call sites:

* :func:`open_run` — rank 0's setup of the output directory: lock and checks
  (:mod:`fedmpi.job.rundir`), checkpoint restore, the log (new, or continued after the
  checkpoint's round), ``config.yaml``.
* :func:`agree_on_setup` — every rank learns whether any rank failed to set up; the
  error line is printed once (by rank 0, or by a worker whose problem rank 0 does not
  share), the others exit quietly with the same status.
* :func:`diverged` — after aggregation: a non-finite θ stops the run (exit 1,
  status ``failed``); no checkpoint is written after it, so the last one is the last
  good state, and no ``model.pt`` is written.
* :func:`no_progress` — ``runtime.max_rounds_without_update`` rounds in a row without an
  accepted update stop the run (exit 1, status ``failed``).
* :func:`write_failed` — a refused write (disk full) of the log, checkpoint or
  ``model.pt``: one line naming the file, status ``failed`` if the log still takes it,
  exit 1 without running HDF5's finalisation (which crashes on a file whose flush
  failed).
* :func:`discard_unstarted` — a fresh run that failed in its first round leaves nothing
  that blocks its rerun.
* :func:`interrupted_message` — what the stop message says about the checkpoint.

Each takes what it needs (the checkpoint's :class:`~fedmpi.job.checkpoint.RunState`, the
log's :class:`LogHeader`, a writer, numbers), never the whole
:class:`~fedmpi.runtime.Federation`; the two round checks return the failure line and
the federation records it.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Optional

import numpy as np
import torch

from fedmpi.job import checkpoint, rundir
from fedmpi._version import __version__
from fedmpi.errors import ReportedElsewhere, RunFailed, UserError
from fedmpi.job.outputs import OutputError, quiet_h5py_errors
from fedmpi.log.row import Reports
from fedmpi.job.safefile import write_text
from fedmpi.job.checkpoint_file import checkpoint_path
from fedmpi.job.lock import release
from fedmpi.component import Component
from fedmpi.job.state_check import CheckpointError
from fedmpi.training.vecops import all_finite

if TYPE_CHECKING:  # annotations only: the log (h5py) is imported when rank 0 opens it
    from fedmpi.log.writer import LogWriter
    from fedmpi.runtime.build import Built


@dataclass(frozen=True)
class LogHeader:
    """What rank 0's log records about the run before its first round, besides what
    the :class:`~fedmpi.job.checkpoint.RunState` holds (config, world size, K): the
    :class:`~fedmpi.log.writer.LogWriter`'s header, the run information, and ``reports``,
    where the build's writes for the log wait until the file exists (the rank table, the
    components' attributes and events), replayed into it when it opens."""

    num_samples: np.ndarray       # n_k of every client
    class_counts: np.ndarray      # [K, C] training samples per client and class
    run_info: dict                # what ran (fedmpi.job.provenance)
    reports: Reports

    @classmethod
    def of(cls, built: Built) -> LogHeader:
        """The header of the rank ``built``."""
        return cls(num_samples=built.num_samples, class_counts=built.partition.class_counts,
                   run_info=built.run_info, reports=built.reports)


@dataclass(frozen=True)
class OpenedRun:
    """What :func:`open_run` hands the driver: the open log, the rounds a resumed run
    has logged already (``[]`` for a fresh run) and the restored checkpoint (None)."""

    writer: LogWriter
    history: list[dict]
    restored: Optional[checkpoint.Restored]


def open_run(run: checkpoint.RunState, header: LogHeader, out: Path, resume: bool,
             overwrite: bool) -> OpenedRun:
    """Rank 0: own ``out``, restore the checkpoint into ``run`` on ``resume``, open the
    log (new, or continued after the checkpoint's round) and write ``config.yaml``."""
    from fedmpi.log.writer import LogWriter

    cfg = run.cfg
    owned = rundir.prepare(out, cfg, resume, overwrite)
    restored = None
    history: list[dict] = []
    if resume:
        restored = checkpoint.load_server_side(run, checkpoint_path(out))
        history = rundir.resume_history(out / "log.h5", restored.path, restored.round, cfg)
        for name, part in run.components.items():   # restored state against round and log
            why = part.check_restored(restored.round, history) \
                if isinstance(part, Component) else None
            if why is not None:
                raise CheckpointError(f"{restored.path}: entry {name!r}: {why}")
    writer = LogWriter(out / "log.h5", config_yaml=cfg.to_yaml(), world_size=run.comm.world_size,
                       num_clients=run.num_clients, num_samples=header.num_samples,
                       class_counts=header.class_counts, fedmpi_version=__version__,
                       resume=restored is not None,
                       resume_rounds=restored.round if restored else None,
                       fingerprint=owned.fingerprint)
    header.reports.attach(writer)
    writer.set_run_info(json.dumps(header.run_info, sort_keys=True))
    if owned.stale_lock:
        writer.event(restored.round if restored else 0, 0, -1,
                     f"took over the stale lock of a run that is gone ({owned.stale_lock})")
    try:
        write_text(out / "config.yaml", cfg.to_yaml())
    except OSError as exc:
        from fedmpi.job.outputs import write_failed

        raise write_failed(out / "config.yaml", exc) from None
    return OpenedRun(writer, history, restored)


def agree_on_setup(comm, error: Optional[BaseException]) -> None:
    """Collective: return if every rank set up; else raise on every rank.

    Rank 0 raises its own error (the CLI prints it); a worker raises a quiet
    :class:`~fedmpi.errors.ReportedElsewhere` (bad input) or
    :class:`~fedmpi.errors.RunFailed` when rank 0 failed too (the same bad input,
    reported once), and prints its own error first when rank 0 did not fail."""
    code = 2 if isinstance(error, UserError) else (1 if error is not None else 0)
    agreed = comm.max_int(code, what="setup agreement")
    if agreed == 0:
        return
    lead = np.array([code], dtype=np.int64)
    comm.broadcast(lead, what="setup error Bcast")
    if error is not None and comm.rank == 0:
        raise error
    if error is not None and lead[0] == 0:
        print(f"fedmpi: error: rank {comm.rank}: {error}", file=sys.stderr, flush=True)
    if agreed == 2:
        raise ReportedElsewhere("the run's set-up failed on another rank (its error line says "
                                "why)")
    raise RunFailed("the run's set-up failed on another rank (its error says why)", quiet=True)


def setup_timed_out(comm, exc: BaseException, writer: Optional[LogWriter] = None) -> NoReturn:
    """A collective of the start-up did not complete within ``runtime.setup_timeout``:
    one line (naming the slow rank where the roll call knows it), the log (``writer``,
    if rank 0 opened it already) says ``failed``, every rank stops (exit 1)."""
    end_job(writer, comm, exc, 0)


def end_job(writer: Optional[LogWriter], comm, exc: BaseException, t: int) -> NoReturn:
    """Report ``exc`` in one line, record it in the log (status ``failed``) while the log
    still takes writes, release the lock, and end every rank with exit 1."""
    print(f"fedmpi: error: {exc}", file=sys.stderr, flush=True)
    if writer is not None and writer.broken is None:
        try:
            writer.event(t, comm.rank, -1, str(exc))
            writer.set_status("failed")
            writer.close()
        except OutputError:
            pass
    release()
    abort_job(comm, 1)
    raise SystemExit(1)   # not reached: abort ends the process


def abort_job(comm, code: int) -> None:
    """End every rank with ``code`` once the launcher has read this rank's error line
    (:func:`fedmpi.job.stdio.wait_until_read`: an abort must not overtake it)."""
    from fedmpi.job.stdio import wait_until_read

    wait_until_read()
    comm.abort(code)


def diverged(state: torch.Tensor, t: int, checkpoint_file: Optional[Path],
             checkpoint_round: int) -> Optional[str]:
    """Rank 0 after aggregation: None while θ (``state``) is finite, else the failure
    line of round ``t``, saying whether ``checkpoint_file`` (rounds <
    ``checkpoint_round``) holds the last good state."""
    if all_finite(state):
        return None
    kept = (f"the last good state is the checkpoint {checkpoint_file} (rounds < "
            f"{checkpoint_round})" if checkpoint_file is not None and checkpoint_file.exists()
            else "no checkpoint was written before it")
    return (f"round {t}: the global model has non-finite values after aggregation "
            f"(diverged: lower train.lr or algorithm.server_lr); {kept}")


def no_progress(limit: Optional[int], rounds_without_update: int, t: int) -> Optional[str]:
    """Rank 0 after aggregation: the failure line when ``limit``
    (``runtime.max_rounds_without_update``) consecutive rounds, round ``t`` the last,
    accepted no client update; else None. The run then ends ``failed`` (exit 1): a run
    that cannot move is not a success."""
    if not limit or rounds_without_update < limit:
        return None
    return (f"rounds {t - limit + 1}..{t}: no client update was accepted in {limit} "
            f"consecutive rounds (runtime.max_rounds_without_update={limit}); the global "
            "model has not changed since: the log's events say why each update was "
            "excluded")


def write_failed(writer: Optional[LogWriter], comm, exc: OutputError, t: int) -> None:
    """A refused write on this rank: report it in one line and end the job (exit 1)."""
    quiet_h5py_errors()
    end_job(writer, comm, exc, t)


def has_result(out: Path, logged: int, resume: bool) -> bool:
    """Whether a run that ended with ``logged`` rounds in its log produced anything: a
    round, a checkpoint, or a run it continued. One that did not writes no ``model.pt``
    (the initial model is no result) and leaves nothing behind."""
    return resume or logged > 0 or checkpoint_path(out).exists()


def discard_unstarted(out: Path, logged: int, resume: bool) -> bool:
    """Rank 0, after a fresh run failed or was stopped with ``logged`` rounds in its log:
    a run that ended before its first round was logged (no checkpoint) removes the
    ``log.h5`` and ``config.yaml`` it created, so nothing blocks the next plain run
    (issues 26, 48). Returns whether the log is kept."""
    if has_result(out, logged, resume):
        return True
    for name in ("log.h5", "config.yaml"):   # the directory stays: it may be the user's
        (out / name).unlink(missing_ok=True)
    return False


def interrupted_message(stop_reason: Optional[str], t: int, rounds: int, checkpoint_round: int,
                        out: Path, kept: bool = True) -> str:
    """The stop line of a run stopped (``stop_reason``) at round ``t`` of ``rounds``:
    which rounds the checkpoint in ``out`` holds (< ``checkpoint_round``), that there is
    none, or (``kept`` false) that nothing of it was kept."""
    path = checkpoint_path(out)
    if checkpoint_round > 0 and path.exists():
        return (f"fedmpi: interrupted ({stop_reason}) after {t} of {rounds} rounds; checkpoint "
                f"{path} (rounds < {checkpoint_round}); continue with: fedmpi run ... --resume")
    if not kept:
        return (f"fedmpi: interrupted ({stop_reason}) before round {t} was logged; nothing of "
                "it was kept: run the same command again")
    return (f"fedmpi: interrupted ({stop_reason}) before round {t}; no checkpoint was "
            f"written, nothing to resume: start again with: fedmpi run ... --overwrite")
