"""The slurm/ templates on a real Slurm (issue 19): submitted, signalled, requeued.

Needs the single-node test cluster of ``slurm/testing/local-cluster`` (``.ci/run``
starts it as root after ``apt-get install slurm-wlm munge``) and ``SLURM_CONF``
pointing at it; otherwise every test here is skipped with that reason (with
``FEDMPI_REQUIRE_SLURM=1``, as in CI after starting the cluster, they fail
instead). Only a cluster named ``fedmpi-ci`` is used, never a site's real one.

Every job is tiny (quickstart config on digits, 2 ranks of 1 thread); the
round-level checks read ``log.h5``: rounds 0..R−1 each exactly once after a
requeue and resume.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from fedmpi.log.reader import read

CFG = "configs/quickstart.yaml"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
# 2 ranks (1 aggregator + 1 worker) of 1 CPU, no GPUs: the templates' EDIT lines ask for more
ALLOC = ["--ntasks=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=30"]
# rounds long enough (~0.5-1 s) to signal a job in the middle of its run
SLOW = ["--set", "train.local_epochs=3", "--set", "runtime.checkpoint_every=1"]


def cluster_problem(nodes: tuple[str, ...] = ()) -> str | None:
    """Why the fedmpi-ci test cluster (with ``nodes``, if given) cannot be used, or None."""
    conf = os.environ.get("SLURM_CONF")
    start = "start --nodes 3 DIR" if nodes else "start DIR"
    how = (f"start one with `slurm/testing/local-cluster {start}` as root and export "
           "SLURM_CONF=DIR/slurm.conf (.ci/run does both)")
    if not conf or not Path(conf).is_file():
        return f"no local test Slurm (SLURM_CONF unset): {how}"
    text = Path(conf).read_text()
    if not re.search(r"^ClusterName=fedmpi-ci\s*$", text, re.M) or not all(
            re.search(rf"^NodeName={n} ", text, re.M) for n in nodes):
        what = f"the fedmpi-ci test cluster{' of ' + ', '.join(nodes) if nodes else ''}"
        return f"SLURM_CONF={conf} is not {what}: {how}"
    if shutil.which("scontrol") is None:
        return f"no scontrol on PATH: {how}"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        return f"the test cluster of {conf} does not answer (scontrol ping): {how}"
    return None


_PROBLEM = cluster_problem()
if _PROBLEM and os.environ.get("FEDMPI_REQUIRE_SLURM") == "1":
    raise RuntimeError(f"FEDMPI_REQUIRE_SLURM=1 but {_PROBLEM}")
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")]


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(OMP_NUM_THREADS="1", FEDMPI_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    env.update(extra)
    return env


def _sbatch(tmp_path: Path, script: str, *args: str, env: dict | None = None,
            opts: tuple[str, ...] = ()) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *ALLOC, f"--output={tmp_path}/slurm-%j.out",
                           *opts, str(ROOT / "slurm" / script), *args], cwd=ROOT,
                          env=env or _env(tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _job(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                         text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait_end(job: str, timeout: float = 240) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = _job(job)
        if info.get("JobState") in TERMINAL:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job])
    raise AssertionError(f"job {job} did not end within {timeout} s: {_job(job)}")


def _wait_rounds(log: Path, job: str, n: int, timeout: float = 180) -> None:
    """Until ``log`` holds ``n`` rounds (the job is then in the middle of its run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            try:
                if read(log).num_rounds >= n:
                    return
            except Exception:  # noqa: BLE001 - created but not yet readable
                pass
        if _job(job).get("JobState") in TERMINAL:
            raise AssertionError(f"job {job} ended before round {n}: {_job(job)}")
        time.sleep(0.1)
    raise AssertionError(f"{log}: fewer than {n} rounds after {timeout} s")


def _output(tmp_path: Path, job: str) -> str:
    return (tmp_path / f"slurm-{job}.out").read_text()


def _rounds_once(log_path: Path, rounds: int) -> None:
    """rounds 0..R−1, each exactly once, every one evaluated at the end."""
    log = read(log_path)
    assert log.status == "completed"
    assert log.rounds["round"].tolist() == list(range(rounds))
    assert np.isfinite(log.rounds["test_accuracy"]).all()


def _launcher() -> str:
    proc = subprocess.run([sys.executable, "-m", "fedmpi", "info", "--launcher"], cwd=ROOT,
                          env=_env(Path(".")), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_fedmpi_sbatch_default_launcher_completes(tmp_path):
    out = tmp_path / "run"
    job = _sbatch(tmp_path, "fedmpi.sbatch", CFG, "--set", "train.rounds=2",
                  env=_env(tmp_path, OUT=str(out)))
    info = _wait_end(job)
    text = _output(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert f"fedmpi-slurm: {_launcher()} {sys.executable} -m fedmpi run" in text
    log = read(out / "log.h5")
    assert int(log.attrs["world_size"]) == 2          # = --ntasks: one MPI world, not 2 copies
    _rounds_once(out / "log.h5", 2)


def test_srun_without_mpi_plugin_exits_2_and_writes_nothing(tmp_path):
    """Slurm's MpiDefault=none: srun starts 2 unconnected copies; both refuse to run."""
    out = tmp_path / "copies"
    proc = subprocess.run(["srun", "--mpi=none", "-n", "2", "--time=5", sys.executable, "-m",
                           "fedmpi", "run", CFG, "--out", str(out)], cwd=ROOT,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("fedmpi: error:")]
    # one line: the copy with launcher rank 0 reports, the other exits 2 quietly
    assert len(lines) == 1 and "2 independent 1-rank copies" in lines[0]
    assert "srun --mpi=" in lines[0] or "mpirun" in lines[0]
    assert not out.exists()


def test_sweep_of_two_tasks(tmp_path):
    sweep = tmp_path / "sweep.txt"
    sweep.write_text("seed: 0 1\n")
    env = _env(tmp_path, OUT_ROOT=str(tmp_path / "sw"), LOG_DIR=str(tmp_path / "logs"),
               SBATCH_ARGS=" ".join(ALLOC))
    proc = subprocess.run([str(ROOT / "slurm" / "submit-sweep.sh"), str(sweep), CFG, "--set",
                           "train.rounds=2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    array = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
    for task in (0, 1):
        info = _wait_end(f"{array}_{task}")
        assert info["JobState"] == "COMPLETED", info
        run = tmp_path / "sw" / f"{task}_seed={task}"
        _rounds_once(run / "log.h5", 2)
        assert read(run / "log.h5").config["seed"] == task
        assert int(read(run / "log.h5").attrs["world_size"]) == 2
        assert (tmp_path / "logs" / f"fedmpi-sweep-{array}_{task}.out").exists()


def _interrupted_then_completed(tmp_path: Path, signal_job, rounds: int = 8) -> tuple[str, str]:
    out = tmp_path / "run"
    job = _sbatch(tmp_path, "fedmpi.sbatch", CFG, "--set", f"train.rounds={rounds}", *SLOW,
                  env=_env(tmp_path, OUT=str(out)))
    _wait_rounds(out / "log.h5", job, 2)
    signal_job(job)
    info = _wait_end(job)
    text = _output(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text
    assert "resuming this job's checkpoint" in text
    _rounds_once(out / "log.h5", rounds)   # no lost, no duplicated round
    return job, text


def test_scontrol_requeue_mid_run_resumes_without_lost_or_repeated_rounds(tmp_path):
    _, text = _interrupted_then_completed(
        tmp_path, lambda job: subprocess.run(["scontrol", "requeue", job], check=True))
    # Slurm requeued the job itself: the wrapper must not requeue it a second time
    assert "requeue failed" not in text and "requeueing job" not in text


def test_time_limit_signal_checkpoints_and_requeues(tmp_path):
    """What `#SBATCH --signal=B:USR1@T` sends before the time limit."""
    _, text = _interrupted_then_completed(
        tmp_path, lambda job: subprocess.run(["scancel", "--signal=USR1", "--batch", job],
                                             check=True))
    assert "got SIGUSR1" in text and "requeueing job" in text and "requeue failed" not in text


def test_plain_scancel_stops_for_good(tmp_path):
    out = tmp_path / "run"
    job = _sbatch(tmp_path, "fedmpi.sbatch", CFG, "--set", "train.rounds=40", *SLOW,
                  env=_env(tmp_path, OUT=str(out)))
    _wait_rounds(out / "log.h5", job, 2)
    subprocess.run(["scancel", job], check=True)
    info = _wait_end(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    time.sleep(12)   # longer than the test cluster's requeue delay (cred_expire=10)
    info = _job(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    log = read(out / "log.h5")
    assert log.status == "interrupted" and log.num_rounds < 40
    assert (out / "checkpoint.pt").exists()
    assert "not requeueing" in _output(tmp_path, job)


def test_ten_minute_limit_with_the_templates_600_s_lead_completes(tmp_path):
    """Issue 28's report: --time=00:10:00 under `#SBATCH --signal=B:USR1@600` signals the
    job at once; it used to stop before round 0 and requeue forever. The wrapper warns,
    ignores that one early signal (its own timer stops fedmpi 150 s before the end
    instead), and the job completes without a restart."""
    out = tmp_path / "run"
    job = _sbatch(tmp_path, "fedmpi.sbatch", CFG, "--set", "train.rounds=3",
                  env=_env(tmp_path, OUT=str(out)), opts=("--time=00:10:00",))
    info = _wait_end(job)
    text = _output(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", text
    assert "signal (600 s before the end) would arrive 0 s into" in text
    assert "requeue" not in text
    _rounds_once(out / "log.h5", 3)
