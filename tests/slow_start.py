"""Slow ranks for tests/test_adversarial.py: rank FEDMPI_SLOW_RANK is slow.

* ``data.dataset: slow_start:digits`` -- that rank takes FEDMPI_SLOW_SECONDS to load
  its data (a slow silo at start-up);
* ``algorithm.name: slow_start:SlowFedAvg`` -- FedAvg, but that rank's local training
  in round FEDMPI_SLOW_ROUND takes FEDMPI_SLOW_SECONDS longer (a rank alive but
  slower than ``runtime.round_timeout``);
* ``algorithm.name: slow_start:SlowBeginFedAvg`` -- that rank starts every round
  FEDMPI_SLOW_SECONDS late, outside local training (tests/test_round_time.py).
"""
from __future__ import annotations

import os
import time

from fedmpi.methods.fedavg import FedAvg


def _slow_here() -> bool:
    from fedmpi.errors import launch_rank

    return launch_rank() == int(os.environ.get("FEDMPI_SLOW_RANK", "-1"))


def _pause() -> None:
    time.sleep(float(os.environ.get("FEDMPI_SLOW_SECONDS", "0")))


def digits():
    from fedmpi.data.datasets import load_dataset

    if _slow_here():
        _pause()
    return load_dataset("digits", "data", False)


class SlowFedAvg(FedAvg):
    """FedAvg whose slow rank trains FEDMPI_SLOW_SECONDS longer in FEDMPI_SLOW_ROUND."""

    name = "slow_fedavg"

    def hooks(self, task, state, extras):
        if task.round == int(os.environ.get("FEDMPI_SLOW_ROUND", "-1")) and _slow_here():
            _pause()
        return super().hooks(task, state, extras)


class SlowBeginFedAvg(FedAvg):
    """FedAvg whose slow rank starts every round FEDMPI_SLOW_SECONDS late, outside local
    training (its ``begin_round``): the others wait for it, and rank 0 logs that as
    ``wait_seconds``, not as training."""

    name = "slow_begin_fedavg"

    def begin_round(self, t, mask, state, extras):
        if _slow_here():
            _pause()
        return super().begin_round(t, mask, state, extras)
