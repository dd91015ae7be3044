"""``fedmpi`` whose stop-signal handler also leaves a mark: a readiness handshake for tests.

``python tests/signal_probe.py ARGS`` runs ``fedmpi ARGS``; each time a stop signal's
handler of :mod:`fedmpi.job.signals` has recorded the signal, it appends the signal's
number to the file ``$FEDMPI_SIGNAL_SEEN.<pid>``. A test that must send a second signal
only once the first was handled (Python runs a handler once for signals that arrive
before it runs) waits for that file instead of sleeping.
"""
from __future__ import annotations

import os

from fedmpi.job import signals

_record = signals._handler


def _handler(signum, frame) -> None:
    _record(signum, frame)           # a second SIGINT raises here: no mark
    with open(f"{os.environ['FEDMPI_SIGNAL_SEEN']}.{os.getpid()}", "a") as f:
        f.write(f"{signum}\n")


signals._handler = _handler          # install() binds the module's handler

if __name__ == "__main__":
    from fedmpi.cli import entry

    entry()
