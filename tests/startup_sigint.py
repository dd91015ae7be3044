"""Ctrl-C at a known start-up point, for tests (issue 48.3): ``data.dataset:
startup_sigint:digits`` — the rank FEDMPI_SIGINT_RANK, while it loads its data, sends SIGINT
to the process group that leads its session (the test starts ``mpiexec`` in a session of
its own, so that group is ``mpiexec``'s: what a terminal's Ctrl-C reaches; ``mpiexec``
forwards it to every rank) and loads on."""
from __future__ import annotations

import os
import signal


def digits():
    from fedmpi.data.datasets import load_dataset
    from fedmpi.errors import launch_rank

    if launch_rank() == int(os.environ.get("FEDMPI_SIGINT_RANK", "0")):
        os.killpg(os.getsid(0), signal.SIGINT)
    return load_dataset("digits", "data", False)
