"""The file under a run log: HDF5 writes through it, and a failed flush is undone.

h5py's ``fileobj`` driver hands every read, write and truncation of the HDF5 library to
a Python file object. :class:`UndoFile` is that object for
:class:`~fedmpi.log.writer.LogWriter`. Before a write overwrites bytes that the file
held at the last :meth:`~UndoFile.commit` (made after each flush that succeeded) it
keeps their old contents; a truncation below that size keeps the bytes it cuts.
:meth:`~UndoFile.rollback` truncates the file back to its committed size and puts the
kept bytes back, so the file is byte for byte what it was after the last successful
flush — a log readable up to its last flushed round — whatever write failed and however
far HDF5 had got. After a rollback every write is refused, so nothing HDF5 still holds
in its caches reaches the file.

Why not let HDF5 write the file directly: measured with HDF5 2.0 on a 440 KiB file
system, a disk that fills during a flush leaves object headers written that point past
the end of allocation recorded in the superblock (written last): "address of object past
end of allocation", the whole log unreadable (issue 40). HDF5 has no transaction of its
own short of SWMR, whose superblock flag makes a killed run's log unreadable until
``h5clear``.

The kept bytes are the ones HDF5 overwrites between two flushes (metadata blocks, the
chunks of the row being added): of the order of one round's row, not of the log.
"""
from __future__ import annotations

import errno
import io
import os
from typing import Optional

__all__ = ["UndoFile"]


class UndoFile(io.RawIOBase):
    """A read-write file on ``fd`` (``path`` for messages) whose writes since the last
    :meth:`commit` can be undone by :meth:`rollback` (module docstring)."""

    def __init__(self, fd: int, path: str) -> None:
        super().__init__()
        self.fd, self.path = fd, path
        self._pos = 0
        self.committed = os.fstat(fd).st_size
        self._undo: list[tuple[int, bytes]] = []   # (offset, old bytes), oldest first
        self.frozen = False
        self.discarding = False   # see discard()
        #: The first error of a write or truncation (the reason a flush failed).
        self.error: Optional[OSError] = None

    # -- what HDF5 calls -----------------------------------------------------------
    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        data = os.pread(self.fd, len(buffer), self._pos)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def write(self, data) -> int:  # type: ignore[no-untyped-def, override]
        view = memoryview(data).cast("B")
        if self.discarding:
            self._pos += len(view)
            return len(view)
        self._refuse_when_frozen()
        self._keep(self._pos, self._pos + len(view))
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], self._pos + done)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self._pos += done
        return done

    def truncate(self, size: Optional[int] = None) -> int:
        size = self._pos if size is None else int(size)
        if self.discarding:
            return size
        self._refuse_when_frozen()
        self._keep(size, os.fstat(self.fd).st_size)
        try:
            os.ftruncate(self.fd, size)
        except OSError as exc:
            self.error = self.error or exc
            raise
        return size

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos,
                io.SEEK_END: os.fstat(self.fd).st_size}[whence]
        self._pos = base + int(offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass   # every write went to the file already (os.pwrite)

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()

    # -- the transaction -----------------------------------------------------------
    def commit(self) -> None:
        """The file as it is now is the state :meth:`rollback` returns to."""
        self._undo.clear()
        self.committed = os.fstat(self.fd).st_size

    def rollback(self) -> bool:
        """Put the file back as it was at the last :meth:`commit` and refuse every later
        write; returns whether the file could be restored (False: a second failure
        while restoring, e.g. an I/O error of the disk itself)."""
        if self.frozen:
            return not self._undo
        self.frozen = True
        try:
            os.ftruncate(self.fd, self.committed)   # first: frees what the failed flush took
            for offset, old in reversed(self._undo):
                done = 0
                while done < len(old):
                    done += os.pwrite(self.fd, old[done:], offset + done)
            os.fsync(self.fd)
        except OSError:
            return False
        self._undo.clear()
        return True

    def discard(self) -> None:
        """From now on writes and truncations succeed without touching the file: what
        HDF5 writes while it closes the handle of a log left as of its last flush
        (refused, the close would fail and leave HDF5 to close the file at interpreter
        exit through this object, already torn down: a segmentation fault)."""
        self.discarding = True

    def _keep(self, start: int, end: int) -> None:
        """Keep the committed bytes in ``[start, end)`` before they change."""
        end = min(end, self.committed)
        if start < end:
            self._undo.append((start, os.pread(self.fd, end - start, start)))

    def _refuse_when_frozen(self) -> None:
        if self.frozen:
            raise OSError(errno.EROFS, f"{self.path}: log left as of its last flush after a "
                                       "failed write")
