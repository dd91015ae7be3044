"""A silo member that stops mid-round, for tests/test_silo.py (``transforms:
[silo_stop:StopHere]``, with ``PYTHONPATH`` holding tests/).

In round FEDMPI_STOP_ROUND the process of world rank FEDMPI_STOP_RANK, before training its
client, either

* (``FEDMPI_STOP_HOW=wait``, the default) connects to the Unix socket FEDMPI_STOP_SOCKET,
  sends its pid and waits for an answer that never comes: the test, which accepted the
  connection, knows the member is mid-round and kills it (a readiness handshake, no
  sleeps); or
* (``signal``) sends itself SIGTERM: a stop request that only this member has seen; or
* (``kill``) sends itself SIGKILL: a silo that dies (tests/test_async_rounds.py).

Everywhere else a no-op.
"""
from __future__ import annotations

import os
import signal
import socket

from fedmpi.transforms.base import UpdateTransform


class StopHere(UpdateTransform):
    name = "stop_here"

    def before_training(self, task):
        from fedmpi.errors import launch_rank

        if task.round != int(os.environ.get("FEDMPI_STOP_ROUND", "-1")) or \
                launch_rank() != int(os.environ.get("FEDMPI_STOP_RANK", "-1")):
            return task
        how = os.environ.get("FEDMPI_STOP_HOW", "wait")
        if how in ("signal", "kill"):
            os.kill(os.getpid(), signal.SIGTERM if how == "signal" else signal.SIGKILL)
            return task
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(os.environ["FEDMPI_STOP_SOCKET"])
            s.sendall(f"{os.getpid()}\n".encode())
            s.recv(1)   # returns only when the test closes the connection
        return task
