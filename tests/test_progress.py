"""The progress bar counts every round, also when evaluation overlaps the next round."""
from __future__ import annotations

import re

import pytest

from conftest import SMALL, run_fedmpi


@pytest.mark.mpi
def test_progress_bar_reaches_r_of_r_with_overlapped_evaluation(tmp_path):
    # world size 2: eval.overlap (default) logs round t's row during round t + 1
    args = ["run", "configs/quickstart.yaml", *SMALL, "--set", "train.rounds=3",
            "--set", "runtime.threads=1", "--set", "runtime.progress=true",
            "--out", str(tmp_path / "out")]
    proc = run_fedmpi(args, n=2)
    counts = [(int(a), int(b)) for a, b in re.findall(r"(\d+)/(\d+) \[", proc.stderr)]
    assert counts and counts[-1] == (3, 3), proc.stderr[-2000:]
