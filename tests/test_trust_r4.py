"""Trust, round four (issue 48): each item's behaviour as a new user or a consortium meets it.

The silo-of-two Dropout check is in tests/test_silo.py and the one-site re-scoring of a
cross-site cell in tests/test_cross_site.py; this file holds the rest."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, fedmpi_cmd, mpiexec_path

QUICK = ["run", "configs/quickstart.yaml", "--set", "model.name=mlp", "--set", "train.rounds=1",
         "--set", "data.num_clients=2", "--set", "train.clients_per_round=2", "--set",
         "runtime.progress=false", "--set", "runtime.threads=1"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **extra}


# ------------------------------------------------- 3 Ctrl-C during start-up
@pytest.mark.mpi
def test_ctrl_c_at_start_up_leaves_nothing_and_the_plain_rerun_exits_0(tmp_path):
    """A Ctrl-C reaching ``mpiexec -n 3`` while rank 0 loads its data (sent from there: a
    known start-up point, no sleep): exit 75, one fedmpi line saying nothing was kept, an
    empty run directory — no config.yaml, log.h5 or model.pt to block the next run — and
    the same command then runs to the end (exit 0)."""
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    out = tmp_path / "run"
    args = [*QUICK, "--out", str(out)]
    proc = subprocess.Popen([mpi, "-n", "3", *fedmpi_cmd(*args, "--set",
                                                           "data.dataset=startup_sigint:digits")],
                            cwd=ROOT, env=_env(), start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    ours = [ln for ln in err.splitlines() if ln.startswith("fedmpi")]
    assert len(ours) == 1 and "nothing of it was kept: run the same command again" in ours[0], err
    assert "Traceback" not in err and "BAD TERMINATION" not in err, err
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
    again = subprocess.run([mpi, "-n", "3", *fedmpi_cmd(*args)], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]


def test_ctrl_c_during_import_torch_is_one_line_and_exit_75(tmp_path):
    """SIGINT sent the moment the process exists, while the launcher keeps it blocked:
    it waits (pending) until fedmpi's first statement unblocks it, i.e. before torch,
    numpy or MPI are imported — one line and 75, not a KeyboardInterrupt traceback (under
    ``mpiexec``: one from every rank, and MPICH's BAD TERMINATION); nothing written."""
    out = tmp_path / "out"
    proc = subprocess.Popen(fedmpi_cmd(*QUICK, "--out", str(out)), cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK,
                                                                      {signal.SIGINT}))
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-2000:]
    assert err.strip() == ("fedmpi: interrupted (SIGINT) during start-up, before anything was "
                           "written; nothing to resume: run the same command again"), err
    assert not out.exists() or not any(out.iterdir())


def test_other_commands_keep_ctrl_c_as_keyboard_interrupt():
    """Only ``run`` turns a start-up Ctrl-C into 75: the other commands get Python's own
    handler back once their arguments are parsed."""
    code = ("import signal, fedmpi.cli as c\n"
            "early = signal.getsignal(signal.SIGINT) is not signal.default_int_handler\n"
            "c.main(['info'])\n"
            "print('handlers', early, signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "handlers True True" in proc.stdout, proc.stdout
