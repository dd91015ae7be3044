"""Exceptions that the CLI turns into a one-line message: bad input (exit status 2),
user code that raised (:class:`UserCodeError`, 2 while the run is built;
:class:`RunFailed`, 1 once it runs) — the Python API raises them as they are."""
from __future__ import annotations

import os
import traceback
from typing import NamedTuple, Optional


class UserError(Exception):
    """Bad input from the user: a config key, a file, a dataset, a log.

    The CLI prints ``fedmpi: error: <message>`` (no traceback) and exits with
    :data:`EXIT_USAGE`. The message must name the key or file and say what is
    expected.
    """


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or is out of range."""


class DataError(UserError):
    """A dataset or partition file is missing or malformed."""


class LogFormatError(UserError):
    """A file is not a readable fedmpi HDF5 log."""


class RunDirError(UserError):
    """The output directory cannot be used (locked, holds another run, not writable)."""


EXIT_USAGE = 2


EXIT_FAILED = 1
EXIT_INTERRUPTED = 75   # EX_TEMPFAIL (fedmpi.job.signals)


class RunFailed(Exception):
    """A run started and failed (a client or the server raised, a collective timed
    out) or was interrupted; :func:`fedmpi.run` raises it instead of exiting.

    ``exit_code``: the status ``fedmpi run`` exits with (1 failed, 75 interrupted);
    ``quiet``: this rank's CLI prints nothing (the line came from another rank);
    ``log_path``: the run's log, where one was written.
    """

    def __init__(self, message: str, exit_code: int = EXIT_FAILED, quiet: bool = False,
                 log_path: Optional[str] = None) -> None:
        super().__init__(message)
        self.exit_code, self.quiet, self.log_path = exit_code, quiet, log_path


class ReportedElsewhere(ConfigError):
    """Bad input that another rank found and reported (exit status 2): this rank stops
    too, and the CLI prints nothing more (``quiet``)."""

    quiet = True


class RunInterrupted(RunFailed):
    """The run stopped on a signal after a checkpoint (exit status 75; continue it with
    ``resume``). Its message is the stop line (``fedmpi: interrupted ...``)."""

    def __init__(self, message: str, quiet: bool = False, log_path: Optional[str] = None) -> None:
        super().__init__(message, EXIT_INTERRUPTED, quiet, log_path)


# ----------------------------------------------------------------- user code
#: What each config key's object is called in an error line.
OBJECTS = {"model.name": "model", "data.dataset": "dataset", "algorithm.name": "method",
           "aggregation.weighting": "weighting", "aggregation.rule": "server rule",
           "data.silos.loader": "silo loader",
           "transforms": "update transform"}


def show_traceback() -> bool:
    """Whether full tracebacks are wanted (``--traceback`` or ``FEDMPI_TRACEBACK=1``)."""
    return os.environ.get("FEDMPI_TRACEBACK", "") not in ("", "0")


def _fedmpi_or_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    return (path.startswith(_PACKAGE) or path.startswith(_LIBS) or filename.startswith("<frozen")
            or "site-packages" in path or "dist-packages" in path)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBS = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


class Frame(NamedTuple):
    """Where user code raised: file, line and the function's qualified name."""

    filename: str
    lineno: int
    qualname: str


def user_frame(exc: BaseException) -> Optional[Frame]:
    """The innermost frame of ``exc``'s traceback in user code (not fedmpi, the standard
    library or an installed package), None if there is none."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not _fedmpi_or_library(code.co_filename):
            found = Frame(code.co_filename, tb.tb_lineno, getattr(code, "co_qualname", code.co_name))
        tb = tb.tb_next
    return found


def _shown(filename: str) -> str:
    """A file relative to the working directory when it lies below it, else absolute."""
    rel = os.path.relpath(os.path.abspath(filename))
    return rel if not rel.startswith("..") else os.path.abspath(filename)


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of ``exc``'s chain: ``raise ... from cause`` and the
    exception being handled when ``exc`` was raised (unless ``from None`` hid it)."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ if exc.__cause__ is not None else \
            (exc.__context__ if not exc.__suppress_context__ else None)
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


def _one_line(exc: BaseException) -> str:
    return " ".join(part.strip() for part in str(exc).splitlines() if part.strip())


def code_error_line(what: str, path: Optional[str], exc: BaseException) -> str:
    """``<what> (<path>) raised <Type>: <message> [at file:line][; root cause: <Type>:
    <message>]`` on one line: the chain's innermost exception too (a model that fails
    because an import inside it failed names that import's error)."""
    frame = user_frame(exc)
    at = f" at {_shown(frame.filename)}:{frame.lineno}" if frame is not None else ""
    name = f"{what} ({path})" if path else what
    root = root_cause(exc)
    cause = f"; root cause: {type(root).__name__}: {_one_line(root)}" if root is not exc else ""
    return f"{name} raised {type(exc).__name__}: {_one_line(exc)}{at}{cause}"


class UserCodeError(ConfigError):
    """User code (a model, dataset, method, weighting, transform, silo loader named
    in the config or given to :func:`fedmpi.run`) raised while the run was built.

    One line (:func:`code_error_line`), exit status 2 like other bad input; the
    original traceback is kept in ``trace`` (printed with ``--traceback``)."""

    def __init__(self, what: str, path: Optional[str], exc: BaseException) -> None:
        super().__init__(code_error_line(what, path, exc))
        self.trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def launch_rank() -> int:
    """This process's rank as the MPI launcher announced it (0 when run alone): the
    rank that prints a job's one error line (every rank reads the same input)."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0
