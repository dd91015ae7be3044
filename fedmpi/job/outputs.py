"""Writing a run's files so that a failed write never leaves a wrong one (issue 18).

* :func:`save_atomic`: ``torch.save`` into a new temporary file in the same directory,
  ``fsync``, rename over the target (atomic on POSIX), ``fsync`` the directory. A write
  that fails half-way (disk full: ``torch.save`` then reports "unexpected pos …")
  leaves the previous file untouched and raises :class:`OutputError` naming the path.
* :func:`write_model`: ``model.pt``, the global model's ``state_dict`` (with the
  preprocessing its inputs need, :mod:`fedmpi.data.preprocessing`). BatchNorm's
  integer ``num_batches_tracked`` is not part of the federated state θ — each rank's
  copy counts only the batches *it* trained — so it is written at its initial value 0
  (it only matters for ``momentum=None`` BatchNorm, which no fedmpi model uses): the
  file is the same for any world size.
* :class:`OutputError` (exit status 1, not 2: the input was fine, the machine failed)
  carries one line ``<path>: cannot write (<reason>)``.
* :func:`record_written` / :func:`own_files` / :func:`remove_written`: a command that
  writes derived output (``report``, ``stats``) lists what it wrote, with SHA-256, in
  ``.fedmpi-<command>.json`` beside it: its files nobody changed since are its own — a
  report is regenerated without ``--overwrite``, and ``run --overwrite`` removes the
  replaced run's report and stats (issue 48).
* :func:`claim`: nothing fedmpi writes replaces a file it did not create in this
  command without ``--overwrite`` (issue 26): every command that writes files (``run``
  through :mod:`fedmpi.job.rundir`; ``report``, ``compare --out``, ``partition`` and
  ``partition --export``) first claims all its targets; one that exists stops the
  command before anything is written (exit 2, naming the files).
"""
from __future__ import annotations

import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Sequence

import torch

from fedmpi.errors import UserError
from fedmpi.job.safefile import replacing

EXIT_WRITE_FAILED = 1


class OutputError(Exception):
    """Writing an output file failed (disk full, quota, I/O error); exit status 1."""


class ExistingFiles(UserError):
    """Files a command would write exist already and ``--overwrite`` was not given."""


def claim(paths: "Sequence[str | os.PathLike]", overwrite: bool, what: str) -> None:
    """Refuse to write ``paths`` if any of them exists (unless ``overwrite``).

    Called with *all* the files a command is about to write, before it writes the first
    one, so a refusal leaves every file as it was. ``what`` names the command in the
    message, e.g. ``"fedmpi report"``.
    """
    existing = [os.fspath(p) for p in paths if os.path.lexists(p)]
    if not existing or overwrite:
        return
    shown = ", ".join(existing[:4]) + (f" and {len(existing) - 4} more" if len(existing) > 4 else "")
    raise ExistingFiles(f"{what}: {shown} exist{'s' if len(existing) == 1 else ''} already and "
                        "would be replaced; fedmpi replaces only files it created itself in "
                        "this command: add --overwrite to replace them, or choose another --out")


def _manifest(directory: Path, command: str) -> Path:
    return Path(directory) / f".fedmpi-{command}.json"


def sha256_file(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's bytes (silo digests, the derived-output lists)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def record_written(directory: Path, command: str, paths: Sequence[Path]) -> None:
    """List ``paths`` (files of ``directory``) with their SHA-256 as written by ``command``."""
    import json

    from fedmpi.job.safefile import write_text

    write_text(_manifest(directory, command),
               json.dumps({p.name: sha256_file(p) for p in paths}, indent=1, sort_keys=True) + "\n")


def own_files(directory: Path, command: str | None = None) -> set[str]:
    """The names in ``directory`` that ``command`` (None: any command) listed as written
    and that nobody changed since (same SHA-256; plain files, not links)."""
    import json

    own: set[str] = set()
    pattern = _manifest(Path("."), command or "*").name
    for manifest in sorted(Path(directory).glob(pattern)):
        try:
            listed = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        for name, digest in (listed.items() if isinstance(listed, dict) else ()):
            path = Path(directory) / str(name)
            if "/" not in str(name) and path.is_file() and not path.is_symlink() \
                    and sha256_file(path) == digest:
                own.add(str(name))
    return own


def remove_written(directory: Path) -> None:
    """Delete what derived-output commands wrote in ``directory`` and nobody changed since,
    their lists, and ``directory`` itself if that left it empty."""
    directory = Path(directory)
    if not directory.is_dir() or directory.is_symlink():
        return
    for name in own_files(directory):
        (directory / name).unlink()
    for manifest in directory.glob(_manifest(Path("."), "*").name):
        manifest.unlink()
    try:
        directory.rmdir()
    except OSError:   # a file of the user's is there
        pass


def reason(exc: BaseException) -> str:
    """A one-line reason for a failed write: ``strerror`` of an OSError, the C
    library's message inside an HDF5 error, else the first line of the text."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc)
    found = re.search(r"error message = '([^']*)'", text)
    if found:
        return found.group(1)
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def write_failed(path: str | os.PathLike, exc: BaseException) -> OutputError:
    return OutputError(f"{os.fspath(path)}: cannot write ({reason(exc)})")


def quiet_h5py_errors() -> None:
    """After a refused write: HDF5 retries the write whenever an object of that file is
    freed and h5py reports each failure ("Exception ignored in ObjectID.__dealloc__", with
    a traceback). Drop those reports so that a full disk reads as one line; everything
    else still goes to the previous hooks. Idempotent."""
    if getattr(sys.unraisablehook, "fedmpi_quiet", False):
        return
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def from_h5py(text: str) -> bool:
        return "h5py" in text and "_dealloc" in text

    def quiet_unraisable(u: Any) -> None:
        if not from_h5py(repr(getattr(u, "object", "")) + repr(u.exc_traceback)):
            unraisable(u)

    def quiet_except(tp: Any, value: Any, tb: Any) -> None:
        frames = "".join(traceback.format_tb(tb)) if tb is not None else ""
        if not from_h5py(frames):
            excepthook(tp, value, tb)

    quiet_unraisable.fedmpi_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook, sys.excepthook = quiet_unraisable, quiet_except


def save_atomic(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` atomically (see module docstring), through an
    exclusively created temporary file (:mod:`fedmpi.job.safefile`: a planted link is never
    written through).

    Raises :class:`OutputError` when the file system refuses the write; other
    errors (an object torch cannot save) propagate unchanged. Either way the
    previous ``path`` is intact and no temporary file is left.
    """
    path = Path(path)
    try:
        with replacing(path) as f:
            try:
                torch.save(obj, f)
            except RuntimeError as exc:   # torch's zip writer: "unexpected pos …" on a full
                if "pos" in str(exc) or "write" in str(exc).lower():   # disk (temp file still there)
                    raise write_failed(path, OSError(28, "No space left on device")
                                       if _disk_full(path) else exc) from None
                raise
    except OSError as exc:
        raise write_failed(path, exc) from None


def _disk_full(path: Path) -> bool:
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` on the CPU with ``num_batches_tracked`` at 0 (module docstring), with
    the model's preprocessing record in its ``_metadata``
    (:mod:`fedmpi.data.preprocessing`)."""
    from fedmpi.data import preprocessing

    state = {}
    for name, value in model.state_dict().items():
        value = value.detach().to("cpu", copy=True)
        if name.rsplit(".", 1)[-1] == "num_batches_tracked":
            value.zero_()
        state[name] = value
    return preprocessing.with_record(state, preprocessing.of(model))


def write_model(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """``model.pt`` (atomically, world-size independent)."""
    save_atomic(model_state(model), path)
