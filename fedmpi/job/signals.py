"""Graceful stop on SIGTERM, SIGUSR1 and SIGINT (operations, issue 5).

A handler only *records* the request; the runtime acts on it at the next safe
point, the end of a round:

* rank 0 sees :func:`requested` at the start of a round and broadcasts
  ``CMD_STOP`` with the checkpoint and interrupted flags in the round header;
* a worker that received the signal tells rank 0 through the uplink it sends
  anyway: its own slot (the signal number) at the end of the metadata
  ``Allreduce`` buffer. No extra message, no extra round trip: the stop takes
  effect after the round in which any rank saw the signal.

Every rank then writes (rank 0) or contributes (workers) the checkpoint and
exits with :data:`EXIT_INTERRUPTED` = 75 (``EX_TEMPFAIL`` of ``sysexits.h``:
"temporary failure, retry"). The SLURM scripts test for 75 to requeue the job
with ``--resume``; ``mpiexec`` (MPICH hydra, Open MPI) and ``srun`` forward
SIGTERM, SIGUSR1 and SIGINT to every rank and pass 75 through as their own
exit status.

A second SIGINT raises :class:`KeyboardInterrupt` (interactive escape hatch:
Ctrl-C twice stops without a checkpoint); under MPI the driver then aborts the
communicator, so no rank keeps waiting for the one that left (issue 31).
Before the run's handlers are installed, :func:`install_early` (the first statement
of the ``fedmpi`` command, before anything slow is imported) makes SIGTERM/SIGUSR1/SIGINT
exit with 75 too: while nothing is written yet the process leaves at once with one line
(:func:`defer_early` ends that phase just before MPI starts); from then on the request
is kept and :func:`install` carries it over to the run, which stops at its first safe
point. A stop signal the launcher left *blocked* (pending since the process began) is
delivered the moment the handlers are in place, so from the first instruction of the
process on, a stop signal is never death by signal 15. Repeated SIGTERM/SIGUSR1 only keep
the request (SLURM follows SIGTERM with SIGKILL after ``KillWait`` anyway) —
also after the run has returned: in the ``fedmpi`` process
(:func:`hold_after_stop`) :func:`restore` leaves stop signals ignored once a
stop was requested, so a second SIGTERM during the exit (MPI finalisation,
interpreter teardown) cannot turn status 75 into death by signal 15 (issue 18).
"""
from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any, Optional

#: Exit status of a run stopped by a signal after writing its checkpoint.
from fedmpi.errors import EXIT_INTERRUPTED, launch_rank  # noqa: E402 - one definition

#: Signals that request a checkpoint-and-stop.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_reason: Optional[str] = None
_signum: int = 0
_previous: dict[int, Any] = {}
_hold = False


def _handler(signum: int, frame: Optional[FrameType]) -> None:
    global _reason, _signum
    if signum == signal.SIGINT and _signum == signal.SIGINT:
        raise KeyboardInterrupt
    if _reason is None:
        _reason, _signum = signal.Signals(signum).name, int(signum)


#: The stop signals of the start-up phase: SIGINT too (issue 48: a Ctrl-C during ``import
#: torch`` is one line, not a KeyboardInterrupt traceback from every rank).
EARLY_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_early: Optional[tuple[str, int]] = None   # a request recorded after defer_early()


def _exit_interrupted(signum: int, frame: Optional[FrameType]) -> None:
    """Start-up, nothing written yet: leave now with 75 and one line (rank 0 says it).
    ``os._exit``, not an exception: one raised here would unwind through whatever
    import is running and leave half-initialised modules behind (issue 40)."""
    if launch_rank() == 0:
        os.write(2, (f"fedmpi: interrupted ({signal_name(signum)}) during start-up, before "
                     "anything was written; nothing to resume: run the same command again\n"
                     ).encode())
    os._exit(EXIT_INTERRUPTED)


def _record_early(signum: int, frame: Optional[FrameType]) -> None:
    global _early
    if _early is None:
        _early = (signal.Signals(signum).name, int(signum))


def install_early() -> None:
    """The ``fedmpi`` process, first thing (before torch, numpy and MPI are imported):
    a SIGTERM, SIGUSR1 or SIGINT before the run's own handlers are installed exits with
    :data:`EXIT_INTERRUPTED` (75) — nothing is written yet, and 75 is what the Slurm
    wrapper requeues — instead of dying by the signal (15) or a traceback from every
    rank (SIGINT, a Ctrl-C during ``import torch``). The signals are also
    unblocked, so one the launcher left blocked (pending) is acted on now."""
    if threading.current_thread() is threading.main_thread():
        for sig in EARLY_SIGNALS:
            signal.signal(sig, _exit_interrupted)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, EARLY_SIGNALS)


def defer_early() -> None:
    """End the leave-at-once phase of :func:`install_early` (just before MPI starts:
    a rank that leaves on its own after that would strand the others in a
    collective): a stop signal is from now on recorded, and :func:`install` hands it
    to the run, which stops at its first safe point with 75. No-op unless
    :func:`install_early` ran."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in EARLY_SIGNALS:
        if signal.getsignal(sig) is _exit_interrupted:
            signal.signal(sig, _record_early)


def install() -> bool:
    """Install the stop handlers (main thread only); returns whether they were.

    Clears any earlier request, except one recorded during the start-up
    (:func:`defer_early`), which becomes this run's. Pair with :func:`restore`.
    """
    pending = _early
    clear()
    if threading.current_thread() is not threading.main_thread():
        return False
    if pending is not None:
        request(*pending)
    for sig in STOP_SIGNALS:
        if sig not in _previous:
            _previous[sig] = signal.getsignal(sig)
        signal.signal(sig, _handler)
    return True


def restore() -> None:
    """Put back the handlers that were active before :func:`install` (after
    :func:`hold_after_stop` and a stop request: ignore stop signals instead)."""
    if threading.current_thread() is not threading.main_thread():
        return
    ignore = _hold and _reason is not None
    for sig, old in list(_previous.items()):
        signal.signal(sig, signal.SIG_IGN if ignore else old if old is not None else signal.SIG_DFL)
        del _previous[sig]


def hold_after_stop() -> None:
    """For a process that exits when the run returns (the ``fedmpi`` command):
    after a stop request, :func:`restore` ignores further stop signals."""
    global _hold
    _hold = True


def requested() -> Optional[str]:
    """Name of the first stop signal received since :func:`install` (or ``None``)."""
    return _reason


def requested_signum() -> int:
    """Number of that signal (0 if none); what a worker sends in its uplink flag byte."""
    return _signum


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, ``signal 99`` for an unknown number."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def clear() -> None:
    """Forget a stop request (what :func:`install` does first; for tests and embedding
    applications that drive rounds without :func:`fedmpi.runtime.run`)."""
    global _reason, _signum, _early
    _reason, _signum, _early = None, 0, None


def request(reason: str, signum: int = int(signal.SIGTERM)) -> None:
    """Record a stop request programmatically (tests, embedding applications)."""
    global _reason, _signum
    if _reason is None:
        _reason, _signum = reason, int(signum)

