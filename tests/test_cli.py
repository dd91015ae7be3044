"""CLI behaviour: bad input exits 2 with one message naming the key or file."""
from __future__ import annotations

import pytest

from conftest import run_fedmpi

CFG = "configs/quickstart.yaml"


@pytest.mark.parametrize("args, needle", [
    (["--set", "train.lrr=0.1"], "train.lr"),
    (["--set", "train.rounds=0"], "train.rounds"),
    (["--set", "data.partition.alpha=0"], "data.partition.alpha"),
    (["--set", "train.clients_per_round=11"], "train.clients_per_round"),
    (["--set", "data.validation.fraction=1.5"], "data.validation.fraction"),
    (["--set", "train.lr=fast"], "train.lr"),
    (["--set", "data.dataset=cifar10", "--set", "data.root=/nonexistent"], "cifar-10"),
    (["--set", "data.partition.method=file", "--set", "data.partition.file=/no/such.json"], "/no/such.json"),
])
def test_bad_input_exits_2(args, needle):
    proc = run_fedmpi(["run", CFG, *args], n=0, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0  # one line


def test_missing_config_file_exits_2():
    proc = run_fedmpi(["check", "configs/nope.yaml"], n=0, check=False)
    assert proc.returncode == 2 and "configs/nope.yaml" in proc.stderr


def test_bad_input_under_mpiexec_exits_2():
    proc = run_fedmpi(["run", CFG, "--set", "data.dataset=svhn", "--set", "data.root=/nonexistent"],
                      n=2, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "svhn" in proc.stderr.lower()


def test_check_prints_resolved_config():
    proc = run_fedmpi(["check", CFG, "--set", "train.lr=0.2"], n=0)
    assert "lr: 0.2" in proc.stdout and "num_clients: 10" in proc.stdout


def test_info():
    proc = run_fedmpi(["info"], n=0)
    assert "MPI library" in proc.stdout and "torch" in proc.stdout
