"""CLI behaviour: bad input exits 2 with one message naming the key or file; ``check``
prints the resolved config and ``info`` the versions.

In this process through :func:`fedmpi.cli.main`, except one test of the console entry
point itself (its process's exit status and stderr). The table of bad input, in
process, is tests/test_bad_input.py (a missing config file, missing dataset files, a
bad value of every key; one case under ``mpiexec``); these are the cases it does not
hold: an unknown key given by ``--set``, a bound itself, a missing partition file.
"""
from __future__ import annotations

import subprocess

import pytest

from conftest import ROOT, fedmpi_cmd
from fedmpi.cli import main

CFG = str(ROOT / "configs" / "quickstart.yaml")


@pytest.mark.parametrize("args, needle", [
    (["--set", "train.lrr=0.1"], "train.lrr"),
    (["--set", "data.partition.alpha=0"], "data.partition.alpha"),
    (["--set", "data.partition.method=file", "--set", "data.partition.file=/no/such.json"],
     "/no/such.json"),
])
def test_bad_input_exits_2(args, needle, tmp_path, capsys):
    capsys.readouterr()
    assert main(["run", CFG, *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert err.strip().count("\n") == 0  # one line
    assert not (tmp_path / "o").exists()


def test_the_entry_point_exits_2_with_one_line(tmp_path):
    """The ``fedmpi`` process itself (``python -m fedmpi``, the console script's
    entry): exit status 2 and one line on stderr, no traceback."""
    proc = subprocess.run(fedmpi_cmd("run", CFG, "--set", "train.lr=fast", "--out",
                                     str(tmp_path / "o")), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedmpi: error: "), proc.stderr
    assert "'train.lr'" in lines[0]
    assert not (tmp_path / "o").exists()


def test_check_prints_resolved_config(capsys):
    assert main(["check", CFG, "--set", "train.lr=0.2"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.2" in out and "num_clients: 10" in out


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "MPI library" in out and "torch" in out
