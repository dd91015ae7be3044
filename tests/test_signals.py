"""Signal handling (fedmpi.job.signals): a stop request is recorded, handlers are restored,
a second SIGINT interrupts at once.

Signals are raised in this thread (``signal.raise_signal``): the handler has run when the
call returns, so no sleep waits for it.
"""
from __future__ import annotations

import signal

import pytest

from fedmpi.job import signals


def test_signal_handlers_record_and_restore():
    before = signal.getsignal(signal.SIGUSR1)
    assert signals.install()
    try:
        assert signals.requested() is None
        signal.raise_signal(signal.SIGUSR1)
        assert signals.requested() == "SIGUSR1" and signals.requested_signum() == signal.SIGUSR1
        signal.raise_signal(signal.SIGTERM)                 # the first request wins
        assert signals.requested() == "SIGUSR1"
        signal.raise_signal(signal.SIGINT)                  # not a second SIGINT: no exception
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGUSR1) == before
    assert signals.signal_name(15) == "SIGTERM" and signals.signal_name(250) == "signal 250"


def test_second_sigint_raises_keyboard_interrupt():
    signals.install()
    try:
        signal.raise_signal(signal.SIGINT)
        assert signals.requested() == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        signals.restore()
