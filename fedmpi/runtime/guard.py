"""Run-level safety nets the driver calls at a few points (issue 18).

Kept out of :mod:`fedmpi.runtime` so the driver only has one-line call sites:

* :func:`open_run` — rank 0's setup of the output directory: lock and checks
  (:mod:`fedmpi.rundir`), checkpoint restore, the log (new, or continued after the
  checkpoint's round), ``config.yaml``.
* :func:`agree_on_setup` — every rank learns whether any rank failed to set up; the
  error line is printed once (by rank 0, or by a worker whose problem rank 0 does not
  share), the others exit quietly with the same status.
* :func:`global_model_finite` — after aggregation: a non-finite θ stops the run (exit 1,
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
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn, Optional

import numpy as np
import torch

from .. import checkpoint, rundir
from .._version import __version__
from ..errors import ReportedElsewhere, RunFailed, UserError
from ..outputs import OutputError, quiet_h5py_errors
from ..safefile import write_text


def open_run(fed, out: Path, resume: bool, overwrite: bool) -> Optional[checkpoint.Restored]:
    """Rank 0: own ``out``, restore the checkpoint on ``resume``, open the log."""
    from ..log import LogWriter

    owned = rundir.prepare(out, fed.cfg, resume, overwrite)
    restored = None
    if resume:
        restored = checkpoint.load_server_side(fed.run_state(), checkpoint.checkpoint_path(out))
        fed.history = rundir.resume_history(out / "log.h5", restored.path, restored.round,
                                            fed.cfg)
    fed.writer = LogWriter(out / "log.h5", config_yaml=fed.cfg.to_yaml(), world_size=fed.size,
                           num_clients=fed.K, num_samples=fed.num_samples,
                           class_counts=fed.partition.class_counts, fedmpi_version=__version__,
                           resume=restored is not None,
                           resume_rounds=restored.round if restored else None,
                           fingerprint=owned.fingerprint)
    fed.writer.set_run_info(json.dumps(fed.built.run_info, sort_keys=True))
    if owned.stale_lock:
        fed.writer.event(restored.round if restored else 0, 0, -1,
                         f"took over the stale lock of a run that is gone ({owned.stale_lock})")
    try:
        write_text(out / "config.yaml", fed.cfg.to_yaml())
    except OSError as exc:
        from ..outputs import write_failed

        raise write_failed(out / "config.yaml", exc) from None
    return restored


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


def setup_timed_out(comm, exc: BaseException, fed=None) -> NoReturn:
    """A collective of the start-up did not complete within ``runtime.setup_timeout``:
    one line (naming the slow rank where the roll call knows it), the log (if rank 0
    opened it already) says ``failed``, every rank stops (exit 1)."""
    end_job(fed, comm, exc, 0)


def end_job(fed, comm, exc: BaseException, t: int) -> NoReturn:
    """Report ``exc`` in one line, record it in the log (status ``failed``) while the log
    still takes writes, release the lock, and end every rank with exit 1."""
    print(f"fedmpi: error: {exc}", file=sys.stderr, flush=True)
    writer = getattr(fed, "writer", None)
    if writer is not None and writer.broken is None:
        try:
            writer.event(t, comm.rank, -1, str(exc))
            writer.set_status("failed")
            writer.close()
        except OutputError:
            pass
    rundir.release()
    comm.abort(1)
    raise SystemExit(1)   # not reached: abort ends the process


def global_model_finite(fed, t: int) -> bool:
    """Rank 0 after aggregation: whether θ is finite; if not, record the failure."""
    if bool(torch.isfinite(fed.global_state.sum(dtype=torch.float64))):
        return True
    path = checkpoint.checkpoint_path(fed.out_dir) if fed.out_dir is not None else None
    kept = (f"the last good state is the checkpoint {path} (rounds < {fed.checkpoint_round})"
            if path is not None and path.exists() else "no checkpoint was written before it")
    fed.failure = (f"round {t}: the global model has non-finite values after aggregation "
                   f"(diverged: lower train.lr or algorithm.server_lr); {kept}")
    fed.recorder.event(t, 0, -1, fed.failure)
    return False


def no_progress(fed, t: int) -> bool:
    """Rank 0 after aggregation: whether ``runtime.max_rounds_without_update``
    consecutive rounds (this one the last) accepted no client update; if so, record the
    failure (the run ends ``failed``, exit 1: a run that cannot move is not a success)."""
    limit = fed.cfg.runtime.max_rounds_without_update
    if not limit or fed.rounds_without_update < limit:
        return False
    fed.failure = (f"rounds {t - limit + 1}..{t}: no client update was accepted in {limit} "
                   f"consecutive rounds (runtime.max_rounds_without_update={limit}); the global "
                   "model has not changed since: the log's events say why each update was "
                   "excluded")
    fed.recorder.event(t, 0, -1, fed.failure)
    return True


def write_failed(fed, comm, exc: OutputError, t: int) -> None:
    """A refused write on this rank: report it in one line and end the job (exit 1)."""
    quiet_h5py_errors()
    end_job(fed, comm, exc, t)


def discard_unstarted(out: Path, logged: int, resume: bool) -> bool:
    """Rank 0, after a fresh run failed with ``logged`` rounds in its log: a run that
    failed in its first round (no round logged, no checkpoint) removes the ``log.h5``
    and ``config.yaml`` it created, so nothing blocks the corrected rerun (issue 26).
    Returns whether the log is kept."""
    if resume or logged > 0 or checkpoint.checkpoint_path(out).exists():
        return True
    for name in ("log.h5", "config.yaml"):   # the directory stays: it may be the user's
        (out / name).unlink(missing_ok=True)
    return False


def interrupted_message(fed, t: int, out: Path) -> str:
    """The stop line: which rounds the checkpoint holds, or that there is none."""
    path = checkpoint.checkpoint_path(out)
    if fed.checkpoint_round > 0 and path.exists():
        return (f"fedmpi: interrupted ({fed.stop_reason}) after {t} of {fed.cfg.train.rounds} "
                f"rounds; checkpoint {path} (rounds < {fed.checkpoint_round}); continue with: "
                "fedmpi run ... --resume")
    return (f"fedmpi: interrupted ({fed.stop_reason}) before round {t}; no checkpoint was "
            f"written, nothing to resume: start again with: fedmpi run ... --overwrite")
