"""How ranks are started: which launcher fits the MPI library, and a wrong launch caught.

Three jobs, one idea (the MPI library and the program that starts the ranks
must speak the same process-management protocol):

* :func:`mpi_flavour` names the MPI family from a version text (mpi4py's
  ``MPI_Get_library_version`` or ``mpirun --version``);
* :func:`choose_launcher` picks the launcher for a Slurm job (``fedmpi info
  --launcher``, used by ``slurm/*.sbatch``)::

      MPICH family (MPICH, the pip wheel, MVAPICH) + srun offers pmi2  ->  srun --mpi=pmi2
      Open MPI >= 4 (built with PMIx)             + srun offers pmix  ->  srun --mpi=pmix
      anything else                                                   ->  mpirun / mpiexec

  ``mpirun``/``mpiexec`` read the allocation from Slurm by themselves;
* :func:`independent_copies` recognises N copies of a 1-rank job: a launcher
  that started N processes (``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS`` inside an
  ``srun`` step, ``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ``PMIX_SIZE``) while
  MPI reports a world of 1. This is what ``srun`` without ``--mpi`` does under
  Slurm's default ``MpiDefault=none``, or an ``mpirun`` of another MPI than
  mpi4py's: every copy would run the whole experiment into one directory.
  ``fedmpi run`` checks it right after MPI init, before touching any file.

A world larger than the launcher's count is legitimate (``mpirun`` inside an
allocation starts its ranks from one ``srun`` step per node), and a batch
script's ``SLURM_NTASKS`` outside a step says nothing about this process.

This module imports neither torch nor MPI (the launcher script uses it).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from fedmpi.errors import UserError

#: Environment variables holding the number of processes a launcher started.
MPI_COUNT_VARS: tuple[str, ...] = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
SLURM_STEP_VARS: tuple[str, ...] = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")


def mpi_flavour(version_text: str) -> str:
    """``'openmpi'``, ``'mpich'`` (MPICH, MVAPICH, the pip wheel) or ``'unknown'``.

    Intel MPI counts as unknown: it is MPICH-based, but its ``srun`` support needs
    ``I_MPI_PMI_LIBRARY``, so its own ``mpirun`` is the safe choice.
    """
    text = version_text.lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        return "openmpi"
    if "intel" in text:
        return "unknown"
    if "mpich" in text or "mvapich" in text or "hydra" in text:
        return "mpich"
    return "unknown"


def openmpi_major(version_text: str) -> Optional[int]:
    """Major version of Open MPI from ``Open MPI v4.1.6, ...`` (``None`` if absent)."""
    m = re.search(r"open mpi v?(\d+)", version_text.lower())
    return int(m.group(1)) if m else None


def find_mpirun(python: str = sys.executable, explicit: Optional[str] = None) -> str:
    """The MPI launcher program for the ranks' Python ``python``.

    ``explicit``, else ``$FEDMPI_MPIRUN``, else the ``mpiexec`` next to ``python``
    (the pip ``mpich`` wheel in a venv), else ``mpirun``/``mpiexec`` on ``PATH``.
    Raises :class:`UserError` naming the Python looked in when there is none.
    """
    for cand in (explicit, os.environ.get("FEDMPI_MPIRUN")):
        if cand:
            return cand
    beside = Path(python).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name)
        if found:
            return found
    raise UserError(f"no mpirun/mpiexec next to {python} nor on PATH: install the MPICH "
                    f"wheel into that Python ({python} -m pip install -e '.[mpich]'), load "
                    "your site's MPI, or set FEDMPI_MPIRUN")


def srun_mpi_plugins() -> Optional[set[str]]:
    """MPI plugin types ``srun --mpi=list`` offers (``None`` without ``srun``)."""
    srun = shutil.which("srun")
    if srun is None:
        return None
    try:
        proc = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    words = re.findall(r"\b(pmi2|pmix(?:_v\d+)?|none|cray_shasta)\b", proc.stdout + proc.stderr)
    return set(words)


def choose_launcher(version_text: str, srun_plugins: Optional[set[str]],
                    mpirun: str) -> tuple[list[str], str]:
    """(launcher words, reason) for a Slurm job step of the MPI in ``version_text``.

    ``srun_plugins``: what ``srun --mpi=list`` offers (``None``: no ``srun``);
    ``mpirun``: the fallback program (:func:`find_mpirun`).
    """
    flavour = mpi_flavour(version_text)
    plugins = srun_plugins or set()
    if flavour == "mpich" and "pmi2" in plugins:
        return (["srun", "--mpi=pmi2", "--kill-on-bad-exit=1"],
                "MPICH-family MPI; srun offers PMI-2")
    major = openmpi_major(version_text)
    if flavour == "openmpi" and (major or 0) >= 4 and any(p.startswith("pmix") for p in plugins):
        return (["srun", "--mpi=pmix", "--kill-on-bad-exit=1"],
                f"Open MPI {major} (PMIx); srun offers PMIx")
    why = ("no srun" if srun_plugins is None
           else f"{flavour} MPI and srun offers {', '.join(sorted(plugins)) or 'no MPI plugin'}")
    return [mpirun], f"{why}: the MPI's own launcher reads the Slurm allocation"


def _count(env: Mapping[str, str], name: str) -> Optional[int]:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def independent_copies(env: Mapping[str, str], world_size: int) -> Optional[tuple[str, int]]:
    """``(variable, N)`` when this process is one of N > 1 copies of a 1-rank world.

    Counts: an MPI launcher's ``PMI_SIZE``/``OMPI_COMM_WORLD_SIZE``/``PMIX_SIZE``, and
    inside an ``srun`` step (``SLURM_STEP_ID`` set; a batch script has none)
    ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``). ``None`` when consistent.
    """
    if world_size != 1:
        return None
    names = list(MPI_COUNT_VARS)
    if "SLURM_STEP_ID" in env or "SLURM_STEPID" in env:
        names += [next((v for v in SLURM_STEP_VARS if v in env), SLURM_STEP_VARS[0])]
    for name in names:
        n = _count(env, name)
        if n is not None and n > 1:
            return name, n
    return None


def check_world(env: Mapping[str, str], world_size: int, mpi_version: str) -> None:
    """Raise :class:`UserError` (one line: how to launch) if :func:`independent_copies`."""
    found = independent_copies(env, world_size)
    if found is None:
        return
    name, n = found
    flavour = mpi_flavour(mpi_version)
    how = {"mpich": "`srun --mpi=pmi2` or this MPI's `mpiexec`",
           "openmpi": "`srun --mpi=pmix` or this MPI's `mpirun`"}.get(
        flavour, "this MPI's own `mpirun`/`mpiexec`")
    raise UserError(f"started as {n} independent 1-rank copies ({name}={n}, but the MPI world "
                    f"has 1 rank): the launcher did not connect the ranks to this MPI "
                    f"({' '.join(mpi_version.split())[:60]}); launch with {how} "
                    "(`fedmpi info --launcher` prints the one to use); nothing was written")
