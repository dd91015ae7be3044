"""The virtual clock: a round policy run on simulated time.

Under ``round.clock: virtual`` a job's duration is not measured but derived from the
work it does, so which updates make a deadline, and in what order buffered updates
arrive, is the same on every machine, under any load and at any world size:

    d(job) = slowdown_k · work(job) · unit

with ``work`` the samples the client's local training processes (``local_epochs`` ·
n_k, or ``local_steps`` · batch size), ``slowdown_k`` its factor (``system.slowdown``,
default 1) and ``unit`` the virtual seconds per sample (``round.sample_seconds``).
The clock is named as simulated wherever it is logged (``virtual_seconds``); the real
compute time of each job is measured and logged beside it.

:func:`simulate` runs a policy (:mod:`fedmpi.round.modes`) to its last step and
returns every step in order; ties (two updates arriving at the same virtual time) are
broken by client id, and an update arriving exactly at a deadline makes it.
"""
from __future__ import annotations

import heapq
from typing import Callable

from fedmpi.round.modes import INF, Actions, Job, Mode, Step


class RoundTimeout(RuntimeError):
    """A deadline round could not reach ``round.min_updates`` within the timeout."""


def simulate(mode: Mode, duration: Callable[[Job], float],
             log: Callable[[Job, float], None] | None = None) -> list[Step]:
    """Every step of ``mode`` on the virtual clock; ``log(job, end)`` sees each job as it
    is started (``end`` its virtual arrival)."""
    steps: list[Step] = []
    running: list[tuple[float, int, Job]] = []

    def apply(acts: Actions) -> None:
        steps.extend(acts.steps)
        for job in acts.start:
            end = job.start + duration(job)
            heapq.heappush(running, (end, job.client, job))
            if log is not None:
                log(job, end)

    apply(mode.begin(0.0))
    while not mode.done:
        arrival = running[0][0] if running else INF
        wake = mode.timer()
        if arrival == INF and wake == INF:
            raise RuntimeError("the round policy waits for nothing: no job runs and no timer is set")
        if wake < arrival:
            apply(mode.wake(wake))
            if getattr(mode, "timed_out", False):
                raise RoundTimeout(f"round {getattr(mode, 'version', '?')} did not reach "
                                   "round.min_updates within runtime.round_timeout")
        else:
            end, _, job = heapq.heappop(running)
            apply(mode.arrive(job, end))
    return steps
