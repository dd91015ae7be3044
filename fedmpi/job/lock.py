"""The one-writer lock of a run directory, ``<out>/.fedmpi.lock`` (issues 18, 30 and 40).

:func:`acquire` (rank 0, before anything is written; called by
:func:`fedmpi.job.rundir.prepare`) writes ``host pid start-time since round_timeout``
into a private temporary file, takes an ``flock`` on it, and only then publishes it
atomically with ``link(2)``; it keeps the ``flock`` for its lifetime. So the lock never
exists without its holder's ``flock`` (where the file system has ``flock``): a racing
run that opens it finds the ``flock`` taken and stops with exit 2 naming the holder. A
lock whose process is gone is stale and taken over (an event in the log says so): on
this host, its pid is dead or now belongs to a process started at another time (a live
pid here is never stale, whatever its heartbeat); on another host, no :func:`heartbeat`
for :data:`LOCK_STALE_FACTOR` × the holder's ``round_timeout``, and at least
:data:`MIN_STALE_SECONDS`. A recorded ``round_timeout`` that is not a positive finite
number (fedmpi never writes one) counts as the default 600 s. :func:`release` removes it when the run ends (any exit
that runs Python's ``finally``; after ``MPI_Abort`` or ``SIGKILL`` it is stale).
Tools read the holder with :func:`lock_holder`.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fedmpi.errors import RunDirError
from fedmpi.job.safefile import create_temp

__all__ = ["LOCK_NAME", "LOCK_STALE_FACTOR", "MIN_STALE_SECONDS", "LockHolder", "acquire",
           "heartbeat", "lock_holder", "parse_lock", "pid_alive", "release", "user_label"]

LOCK_NAME = ".fedmpi.lock"

#: A lock whose heartbeat is older than this many of its holder's
#: ``runtime.round_timeout`` is stale, also on another host (a live run refreshes it
#: every round, and a round longer than ``round_timeout`` aborts the run).
LOCK_STALE_FACTOR = 3
#: ... and never sooner than this (a holder on another host with a tiny
#: ``round_timeout`` still refreshes only once per round, and a fresh lock is not stale).
MIN_STALE_SECONDS = 60.0
#: The ``round_timeout`` assumed for a lock that records none (fedmpi before issue 30)
#: or one that is not a positive finite number of seconds.
DEFAULT_ROUND_TIMEOUT = 600.0


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


@dataclass(frozen=True)
class LockHolder:
    """Who holds ``<out>/.fedmpi.lock`` (the file's text) and its last heartbeat.

    The text is ``host pid start-time since round_timeout`` (one line, written before
    the file gets its name, so nobody ever reads half of it); the heartbeat is the
    file's modification time, refreshed by :func:`heartbeat`."""

    host: str
    pid: int
    start: str               # /proc start time of the pid ("-" where unknown)
    since: float             # Unix time the lock was taken
    round_timeout: float     # the holder's runtime.round_timeout
    heartbeat: float         # Unix time of the last refresh (the file's mtime)
    text: str = ""

    @property
    def stale_after(self) -> float:
        """Seconds without a heartbeat after which a lock of another host is stale."""
        return max(LOCK_STALE_FACTOR * self.round_timeout, MIN_STALE_SECONDS)

    def stale(self, now: Optional[float] = None) -> bool:
        """Whether the holder is gone: on this host its pid is dead (or reused by a
        process started at another time) — a live pid here is never stale; on another
        host no heartbeat for :attr:`stale_after` seconds (hosts' clocks must agree to
        well within that)."""
        if self.host == socket.gethostname():
            if not pid_alive(self.pid):
                return True
            started = _start_time(self.pid)
            return self.start != "-" and started is not None and started != self.start
        return (time.time() if now is None else now) - self.heartbeat > self.stale_after

    def describe(self) -> str:
        try:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        except (ValueError, OverflowError, OSError):   # a crafted time: say so, not a traceback
            when = "an unknown time"
        return (f"pid {self.pid} on host {self.host}, since {when}, last heartbeat "
                f"{max(0.0, time.time() - self.heartbeat):.0f} s ago")


@dataclass
class _Held:
    fd: int
    text: str


_held: dict[Path, _Held] = {}   # lock files this process holds


def _start_time(pid: int) -> Optional[str]:
    """Start time of process ``pid`` (field 22 of /proc/pid/stat, clock ticks since
    boot), or None where /proc is not available."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _lock_text(round_timeout: float) -> str:
    pid = os.getpid()
    return (f"{socket.gethostname()} {pid} {_start_time(pid) or '-'} {time.time():.0f} "
            f"{float(round_timeout):g}\n")


def parse_lock(text: str, heartbeat: float) -> LockHolder:
    """The holder described by a lock file's text (ValueError if it is not one: a pid
    that is not a positive number names no process). Locks of fedmpi before issue 30
    lack ``round_timeout``, and one that is not a positive finite number of seconds
    (``nan``, ``inf``, ``0``: fedmpi never writes such a value) is no promise either: the
    default :data:`DEFAULT_ROUND_TIMEOUT` is assumed for both."""
    fields = text.split()
    if len(fields) not in (4, 5):
        raise ValueError(f"not a fedmpi lock: {text[:80]!r}")
    pid = int(fields[1])
    if pid <= 0:   # kill(0 or -n, 0) would ask about a process group, not a process
        raise ValueError(f"not a fedmpi lock (pid {pid}): {text[:80]!r}")
    timeout = float(fields[4]) if len(fields) == 5 else DEFAULT_ROUND_TIMEOUT
    if not (math.isfinite(timeout) and timeout > 0):
        timeout = DEFAULT_ROUND_TIMEOUT
    return LockHolder(fields[0], pid, fields[2], float(fields[3]), timeout, heartbeat,
                      text.strip())


def lock_holder(out: str | os.PathLike) -> Optional[LockHolder]:
    """The holder of ``<out>/.fedmpi.lock``, or None where there is no (readable) lock.
    A file that is not a lock reads as a holder that is long gone."""
    path = Path(out) / LOCK_NAME
    try:
        st = os.stat(path, follow_symlinks=False)
        text = path.read_text()
    except (FileNotFoundError, PermissionError):
        return None
    try:
        return parse_lock(text, st.st_mtime)
    except ValueError:
        return LockHolder("?", 0, "-", st.st_mtime, 0.0, 0.0, text.strip())


def _flock(fd: int, block: bool) -> Optional[bool]:
    """``flock(LOCK_EX)``: True taken, False held by another open file, None where the
    file system does not support it (NFS without lockd, Lustre without ``-o flock``)."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _publish(path: Path, text: str) -> Optional[int]:
    """Create ``path`` holding ``text`` atomically and already ``flock``-ed by us: write a
    private temporary file, take its ``flock`` (nobody else knows the file yet), then
    ``link(2)`` it to ``path``, which fails if ``path`` exists (``O_EXCL`` semantics that
    also hold on NFS). Returns an fd of the new lock, or None if ``path`` exists.

    Taking the ``flock`` before the link closes the window in which a racer could open
    the published lock, take its free ``flock`` and judge it (issue 40)."""
    fd, tmp = create_temp(path, readable=True)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
        _flock(fd, block=False)   # True, or None where the file system has no flock
        try:
            os.link(tmp, path)
        except FileExistsError:
            os.close(fd)
            return None
        return fd
    finally:
        os.unlink(tmp)


def _busy(out: Path, holder: LockHolder) -> RunDirError:
    when = (f"once pid {holder.pid} has exited" if holder.host == socket.gethostname() else
            f"{holder.stale_after:g} s after its last heartbeat")
    return RunDirError(
        f"{out}: another fedmpi run is writing here ({holder.describe()}; lock file "
        f"{out / LOCK_NAME}); wait for it, or use another --out (the lock is stale, and taken "
        f"over, {when})")


def _foreign_stale(out: Path, st: os.stat_result) -> RunDirError:
    return RunDirError(
        f"{out / LOCK_NAME}: left by a run of user {user_label(st.st_uid)} that is gone; you "
        f"({user_label(os.geteuid())}) may not remove it here: ask {user_label(st.st_uid)} or an "
        "administrator to remove it, or use another --out")


def acquire(out: str | os.PathLike, round_timeout: float = 600.0) -> Optional[str]:
    """Take ``<out>/.fedmpi.lock``; returns the text of the stale lock it took over (or
    None). Raises :class:`RunDirError` when a live run holds it.

    Atomic: a fresh lock is published with ``link(2)`` (exactly one of any number of
    racing processes succeeds); the holder keeps an ``flock`` on it for its lifetime,
    and a stale lock is taken over only by the process that gets that ``flock`` and
    finds the holder gone (module docstring; NFS and Lustre in docs/cluster.md)."""
    out = Path(out)
    path = out / LOCK_NAME
    text = _lock_text(round_timeout)
    for _ in range(100):
        fd = _publish(path, text)
        if fd is not None:   # published with our flock already on it
            _held[path] = _Held(fd, text)
            return None
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
        except FileNotFoundError:
            continue   # released meanwhile
        except PermissionError:
            holder, st = lock_holder(out), os.stat(path, follow_symlinks=False)
            if holder is not None and not holder.stale():
                raise _busy(out, holder) from None
            raise _foreign_stale(out, st) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RunDirError(f"{path}: is a symbolic link; fedmpi never makes links in a "
                                  "run directory: remove it") from None
            raise
        try:
            taken = _flock(fd, block=False)
            st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            os.close(fd)
            continue
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
            os.close(fd)   # released and re-created meanwhile
            continue
        old = os.pread(fd, 4096, 0).decode(errors="replace")
        try:
            holder = parse_lock(old, st.st_mtime)
        except ValueError:
            holder = None
        if taken is False or (holder is not None and not holder.stale()):
            os.close(fd)
            if holder is None:
                holder = lock_holder(out) or LockHolder("?", 0, "-", 0.0, 0.0, 0.0)
            raise _busy(out, holder)
        if taken is None:
            # no flock here: set the stale lock aside (rename is atomic), then race to
            # publish a new one; a racer that set aside a *live* lock puts it back
            os.close(fd)
            aside = path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            if aside.read_text() != old:
                with contextlib.suppress(OSError):
                    os.link(aside, path)
                aside.unlink()
                continue
            aside.unlink()
            fd = _publish(path, text)
            if fd is None:
                continue
            _held[path] = _Held(fd, text)
            return old.strip() or "an empty lock"
        os.ftruncate(fd, 0)   # ours now: the flock excludes every other taker
        os.pwrite(fd, text.encode(), 0)
        os.fsync(fd)
        os.utime(fd)
        _held[path] = _Held(fd, text)
        return old.strip() or "an empty lock"
    raise RunDirError(f"{out}: cannot take the lock {path} (it keeps changing)")


def heartbeat() -> None:
    """Refresh the modification time of every lock this process holds (rank 0, every
    round): what tells a run on another host that this one is alive."""
    for held in _held.values():
        with contextlib.suppress(OSError):
            os.utime(held.fd)


def release() -> None:
    """Remove every lock this process holds (if still ours)."""
    for path, held in list(_held.items()):
        try:
            if os.pread(held.fd, 4096, 0).decode(errors="replace") == held.text:
                st, now = os.fstat(held.fd), os.stat(path, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                    path.unlink()
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.close(held.fd)
        del _held[path]



def user_label(uid: int) -> str:
    """``name (uid N)`` for messages, or ``uid N`` where the user has no name."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"
