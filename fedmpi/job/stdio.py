"""The launcher's copy of a rank's error line, before the job is aborted.

Under ``mpiexec`` a rank's stderr is a pipe that the launcher's proxy reads and forwards.
``MPI_Abort`` reaches the same proxy on another channel; when the proxy handles the
abort first, it ends the job and a line still in the pipe is never forwarded — the
job's one error line is lost (issue 48: ``mpiexec`` exit 1, empty stderr, under load).
:func:`wait_until_read` waits until the reader has taken every byte written to the
pipe (``FIONREAD`` reads 0), so the line precedes the abort on the proxy's way out.
"""
from __future__ import annotations

import fcntl
import os
import stat
import struct
import sys
import termios
import time

__all__ = ["unread_bytes", "wait_until_read"]

POLL_SECONDS = 0.005


def unread_bytes(fd: int) -> int:
    """Bytes written to the pipe ``fd`` and not yet read at its other end (0 for
    anything that is not a pipe: a terminal or a file holds what was written)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])
    except OSError:
        return 0


def wait_until_read(fd: int | None = None, limit: float = 5.0) -> bool:
    """Flush stdout and stderr, then wait (at most ``limit`` seconds: a reader that is
    gone must not hold the abort) until the reader of the pipe ``fd`` (default:
    stderr's) has read everything. Returns whether it has."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if fd is None:
        try:
            fd = sys.stderr.fileno()
        except (OSError, ValueError, AttributeError):
            return True
    deadline = time.monotonic() + limit
    while unread_bytes(fd):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True
