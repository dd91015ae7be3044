"""A dataset factory (``data.dataset: slow_start:digits``) whose rank FEDMPI_SLOW_RANK
takes FEDMPI_SLOW_SECONDS to load: a slow silo at start-up (tests/test_adversarial.py)."""
from __future__ import annotations

import os
import time


def digits():
    from fedmpi.cli import launch_rank
    from fedmpi.data.datasets import load_dataset

    if launch_rank() == int(os.environ.get("FEDMPI_SLOW_RANK", "-1")):
        time.sleep(float(os.environ.get("FEDMPI_SLOW_SECONDS", "0")))
    return load_dataset("digits", "data", False)
