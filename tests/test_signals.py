"""Signal handling (fedmpi.job.signals): a stop request is recorded, handlers are restored,
a second SIGINT interrupts at once."""
from __future__ import annotations

import os
import signal
import time

import pytest

from fedmpi.job import signals


def test_signal_handlers_record_and_restore():
    before = signal.getsignal(signal.SIGUSR1)
    assert signals.install()
    try:
        assert signals.requested() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert signals.requested() == "SIGUSR1" and signals.requested_signum() == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)               # the first request wins
        time.sleep(0.01)
        assert signals.requested() == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGINT)                # not a second SIGINT: no exception
        time.sleep(0.01)
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGUSR1) == before
    assert signals.signal_name(15) == "SIGTERM" and signals.signal_name(250) == "signal 250"


def test_second_sigint_raises_keyboard_interrupt():
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert signals.requested() == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
    finally:
        signals.restore()
