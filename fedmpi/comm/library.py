"""The MPI library: mpi4py's ``MPI`` module (imported on first use, so that
``fedmpi check`` works without MPI), the world size, the library's version and whether it
is CUDA-aware."""
from __future__ import annotations

import os
import sys


def load_mpi():
    from mpi4py import MPI  # imported lazily: `fedmpi check` works without MPI

    return MPI


def mpi4py_version() -> str:
    """mpi4py's version (ImportError where it is not installed)."""
    import mpi4py

    return str(mpi4py.__version__)


def world_size() -> int:
    """Number of ranks in ``MPI_COMM_WORLD`` (initialises MPI)."""
    return int(load_mpi().COMM_WORLD.Get_size())


def mpi_library_version(initialize: bool = True) -> str:
    """The MPI library's version string (first line).

    ``initialize=False`` asks without initialising MPI (``MPI_Get_library_version``
    may be called before ``MPI_Init``), e.g. in a batch script outside any job step;
    only effective when mpi4py's ``MPI`` module is not imported yet.
    """
    try:
        if not initialize and "mpi4py.MPI" not in sys.modules:
            import mpi4py

            mpi4py.rc.initialize = False
            mpi4py.rc.finalize = False
        return load_mpi().Get_library_version().strip().splitlines()[0]
    except Exception as exc:  # noqa: BLE001 - informational only
        return f"unavailable ({exc.__class__.__name__}: {exc})"


def cuda_aware_mpi() -> bool | None:
    """Whether the MPI library reports CUDA support (``None`` if unknown).

    Open MPI exposes ``MPIX_Query_cuda_support``; MPICH reports GPU support
    through the environment (``MPIR_CVAR_ENABLE_GPU``). This is a best effort:
    a library built without such query functions gives ``None``.
    """
    try:
        MPI = load_mpi()
        query = getattr(MPI, "Query_cuda_support", None)
        if query is not None:
            return bool(query())
    except Exception:  # noqa: BLE001
        return None
    version = mpi_library_version().lower()
    if "mpich" in version:
        flag = os.environ.get("MPIR_CVAR_ENABLE_GPU")
        return None if flag is None else flag not in ("0", "false", "no")
    return None
