"""Creating files in a run directory without following planted links (issue 30).

Every file fedmpi writes into an output directory (``config.yaml``, ``checkpoint.pt``,
``model.pt``, ``log.h5``, the report, ``compare`` tables) is created the same way:

1. a temporary file with an unpredictable name ``.<name>.tmp-<pid>-<random>`` opened
   with ``O_CREAT | O_EXCL | O_NOFOLLOW`` — ``O_EXCL`` fails on *any* existing entry,
   a symbolic link included, so a planted link is never opened, let alone followed;
2. written and ``fsync``-ed;
3. renamed over the target with ``rename(2)``, which replaces a link at the target
   name instead of writing through it, and is atomic on POSIX file systems (a reader
   sees the old file or the new one, never half of one).

:func:`refuse_links` is the other half: :func:`fedmpi.job.rundir.prepare` refuses a run
directory in which a name fedmpi writes is a symbolic link (fedmpi never makes one).
"""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator

from fedmpi.errors import UserError

_FLAGS = os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | \
    getattr(os, "O_CLOEXEC", 0)


def temp_name(path: Path) -> Path:
    """``.<name>.tmp-<pid>-<8 hex>`` beside ``path`` (the ``--overwrite`` glob knows it)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def create_temp(path: str | os.PathLike, readable: bool = False) -> tuple[int, Path]:
    """Open a new temporary file beside ``path`` exclusively (write-only, or read-write
    when ``readable``); returns ``(fd, temp path)``."""
    target = Path(path)
    for _ in range(16):
        tmp = temp_name(target)
        try:
            return os.open(tmp, _FLAGS | (os.O_RDWR if readable else os.O_WRONLY), 0o644), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{target}: cannot create a temporary file beside it")


def fsync_dir(path: Path) -> None:
    """Make a rename in directory ``path`` durable (where the file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:   # some filesystems do not fsync directories
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | os.PathLike, mode: str = "wb") -> Iterator:
    """``with replacing(p) as f: f.write(...)``: write a temporary file, ``fsync``, rename
    over ``p`` (module docstring). On an error the temporary file is removed and ``p`` is
    untouched; the error propagates."""
    target = Path(path)
    fd, tmp = create_temp(target)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    fsync_dir(target.parent)


@contextlib.contextmanager
def replacing_path(path: str | os.PathLike) -> Iterator[Path]:
    """Like :func:`replacing` for writers that want a file name (``savefig``): yields an
    exclusively created, empty temporary path that is renamed over ``path`` afterwards."""
    target = Path(path)
    fd, tmp = create_temp(target)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def write_text(path: str | os.PathLike, text: str) -> None:
    """UTF-8 ``text`` to ``path`` atomically and without following links."""
    with replacing(path, "wb") as f:
        f.write(text.encode("utf-8"))


def refuse_links(directory: Path, names: tuple[str, ...], what: str) -> None:
    """Raise :class:`UserError` naming the first entry of ``directory`` that is one of
    ``names`` (or matches them as glob patterns) and is a symbolic link."""
    for pattern in names:
        found = (sorted(directory.glob(pattern)) if any(c in pattern for c in "*?[")
                 else [directory / pattern])
        for entry in found:
            if entry.is_symlink():
                raise UserError(f"{entry}: is a symbolic link (to {os.readlink(entry)}); fedmpi "
                                f"never makes links in {what}, so it will not write through it: "
                                "remove the link, or use another --out")
