"""Slurm templates, the workstation launcher and launch checks, without a Slurm.

The scripts run with fake ``sbatch``/``srun``/``scontrol``/``mpirun`` binaries that
append their command lines to a log (the same scripts on a real Slurm:
tests/test_slurm_real.py). The launch rules (:mod:`fedmpi.job.launcher`) are checked
against tables written here, and ``fedmpi run`` against a simulated
``srun`` step of 2 one-rank copies.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BIN, ROOT, wait_for
from fedmpi.errors import UserError
from fedmpi.job.launcher import choose_launcher, find_mpirun, independent_copies

CFG = "configs/quickstart.yaml"
PY = sys.executable
RUN_TAIL = "--set runtime.progress=false"


def _fake_bin(tmp_path: Path) -> tuple[Path, Path]:
    """Fake sbatch/srun/scontrol/mpirun that append their command line to a log.

    ``srun --mpi=list`` answers with $FAKE_SRUN_MPI (not logged); ``scontrol`` fails
    with $FAKE_SCONTROL_ERR when set; srun/mpirun sleep with $FAKE_SLEEP and exit 75
    on SIGUSR1 (fedmpi's checkpoint-and-stop), else exit $FAKE_RC; sleeping, they create
    ``$FAKE_LOG.ready`` once their SIGUSR1 trap is set. Exiting 75, they replace the file
    $FAKE_CKPT (a new checkpoint) when that is set.
    """
    bindir, log = tmp_path / "bin", tmp_path / "calls.log"
    bindir.mkdir()
    body = """#!/bin/bash
name=$(basename "$0")
if [[ $name == srun && $1 == --mpi=list ]]; then
    echo "MPI plugin types are..."
    for p in ${FAKE_SRUN_MPI-none pmi2 pmix}; do printf '\\t%s\\n' "$p"; done
    exit 0
fi
echo "$name $*" >> "$FAKE_LOG"
if [[ $name == mpirun && "$1" == --version ]]; then echo "mpirun (Open MPI) 4.1.6"; exit 0; fi
if [[ $name == scontrol && -n "${FAKE_SCONTROL_ERR:-}" ]]; then echo "$FAKE_SCONTROL_ERR" >&2; exit 1; fi
ckpt() { [[ -z "${FAKE_CKPT:-}" ]] || { echo "$RANDOM" > "$FAKE_CKPT.tmp"; mv "$FAKE_CKPT.tmp" "$FAKE_CKPT"; }; }
if [[ -n "${FAKE_SLEEP:-}" && $name =~ ^(srun|mpirun)$ ]]; then
    trap 'echo "$name got USR1" >> "$FAKE_LOG"; ckpt; exit 75' USR1
    : > "$FAKE_LOG.ready"    # handshake: the trap is set (the wrapper's was set before us)
    for i in $(seq 300); do sleep 0.1; done
fi
[[ ${FAKE_RC:-0} == 75 && $name =~ ^(srun|mpirun)$ ]] && ckpt
exit ${FAKE_RC:-0}
"""
    for name in ("sbatch", "srun", "scontrol", "mpirun"):
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    return bindir, log


def _script_env(bindir: Path, log: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.pop("LAUNCHER", None)
    return {**env, "PATH": f"{bindir}:{env['PATH']}", "FAKE_LOG": str(log),
            "SLURM_SUBMIT_DIR": str(ROOT), "FEDMPI_PYTHON": PY,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            **extra}


def _mpi_is_mpich() -> bool:
    mpi = pytest.importorskip("mpi4py.MPI")
    return "MPICH" in mpi.Get_library_version()


def _sbatch(env: dict, *args: str, script: str = "fedmpi.sbatch") -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "slurm" / script), *args], env=env,
                          capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- launch rules
@pytest.mark.parametrize("version, plugins, expected", [
    ("MPICH Version:      5.0.2", {"none", "pmi2", "pmix"}, "srun --mpi=pmi2 --kill-on-bad-exit=1"),
    ("MVAPICH2 Version 2.3.7", {"pmi2"}, "srun --mpi=pmi2 --kill-on-bad-exit=1"),
    ("MPICH Version: 4.1.2", {"none", "pmix"}, "MPIRUN"),       # the pip wheel rejects PMIx
    ("MPICH Version: 4.1.2", None, "MPIRUN"),                   # no srun at all
    ("Open MPI v4.1.6, package: Debian", {"none", "pmix", "pmix_v4"},
     "srun --mpi=pmix --kill-on-bad-exit=1"),
    ("Open MPI v5.0.3, package: Open MPI", {"pmix_v5"}, "srun --mpi=pmix --kill-on-bad-exit=1"),
    ("Open MPI v4.1.6", {"none", "pmi2"}, "MPIRUN"),            # srun without PMIx
    ("Open MPI v3.1.6", {"pmix"}, "MPIRUN"),
    ("Intel(R) MPI Library 2021.10 for Linux", {"pmi2", "pmix"}, "MPIRUN"),
    ("unavailable (ImportError: no mpi4py)", {"pmi2"}, "MPIRUN"),
])
def test_launcher_table(version, plugins, expected):
    words, why = choose_launcher(version, plugins, "MPIRUN")
    assert " ".join(words) == expected and why


@pytest.mark.parametrize("env, world, expected", [
    # srun without --mpi (MpiDefault=none): 2 copies of a 1-rank world
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}, 1,
     ("SLURM_STEP_NUM_TASKS", 2)),
    ({"SLURM_STEPID": "3", "SLURM_NTASKS": "4"}, 1, ("SLURM_NTASKS", 4)),
    # srun --mpi=pmi2: one world of 2
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "PMI_SIZE": "2"}, 2, None),
    # a batch script's SLURM_NTASKS outside any step: one process is legitimate
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "5"}, 1, None),
    # mpirun inside an allocation: ranks come from one srun step per node
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "PMI_SIZE": "3"}, 3,
     None),
    # another MPI's mpirun: 4 singletons
    ({"OMPI_COMM_WORLD_SIZE": "4"}, 1, ("OMPI_COMM_WORLD_SIZE", 4)),
    ({"PMI_SIZE": "2"}, 1, ("PMI_SIZE", 2)),
    ({"PMIX_SIZE": "3"}, 1, ("PMIX_SIZE", 3)),
    ({"PMI_SIZE": "1"}, 1, None),                                # mpiexec -n 1
    ({"PMI_SIZE": "x", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}, 1, None),
    ({}, 1, None),
])
def test_independent_copies(env, world, expected):
    assert independent_copies(env, world) == expected


def test_run_as_two_one_rank_copies_exits_2_before_writing(tmp_path):
    """What `srun -n 2` without --mpi gives every copy: a step of 2 tasks, a world of 1."""
    out = tmp_path / "out"
    env = {**os.environ, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([PY, "-m", "fedmpi", "run", CFG, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedmpi: error: started as 2 independent")
    assert ("srun --mpi=pmi2" if _mpi_is_mpich() else "mpirun") in lines[0]
    assert not out.exists()
    # a batch script's SLURM_NTASKS (no step) is no reason to refuse: the run gets as far
    # as the config
    env = {**os.environ, "SLURM_NTASKS": "2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([PY, "-m", "fedmpi", "run", str(tmp_path / "none.yaml")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "none.yaml" in proc.stderr and "copies" not in proc.stderr


def test_info_launcher_follows_srun_plugins(tmp_path):
    bindir, log = _fake_bin(tmp_path)
    cmd = [PY, "-m", "fedmpi", "info", "--launcher"]
    proc = subprocess.run(cmd, env=_script_env(bindir, log), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    if _mpi_is_mpich():
        assert proc.stdout.strip() == "srun --mpi=pmi2 --kill-on-bad-exit=1"
    env = _script_env(bindir, log, FAKE_SRUN_MPI="none pmix")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    beside = BIN / "mpiexec"   # else the first on the PATH fedmpi sees (the fake bin's)
    expected = str(beside) if beside.exists() else (shutil.which("mpirun", path=env["PATH"])
                                                    or shutil.which("mpiexec", path=env["PATH"])
                                                    or "mpirun")
    assert proc.stdout.strip() == expected, proc.stderr


def test_find_mpirun_names_the_python(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("FEDMPI_MPIRUN", raising=False)
    with pytest.raises(UserError, match=f"next to {tmp_path / 'py' / 'python'}"):
        find_mpirun(str(tmp_path / "py" / "python"))
    (tmp_path / "py").mkdir()
    (tmp_path / "py" / "mpiexec").write_text("")
    assert find_mpirun(str(tmp_path / "py" / "python")) == str(tmp_path / "py" / "mpiexec")


# --------------------------------------------------------------- sbatch scripts
@pytest.mark.parametrize("script", ["fedmpi.sbatch", "multinode.sbatch", "silo.sbatch",
                                    "sweep.sbatch", "lib.sh", "submit-sweep.sh",
                                    "testing/local-cluster"])
def test_slurm_scripts_parse(script):
    path = ROOT / "slurm" / script
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    if script.endswith(".sbatch"):
        text = path.read_text()
        assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text
        assert "EDIT" in text


def test_sbatch_default_launcher_matches_the_mpi(tmp_path):
    bindir, log = _fake_bin(tmp_path)
    out = tmp_path / "out"
    proc = _sbatch(_script_env(bindir, log, SLURM_JOB_ID="5", OUT=str(out)), CFG)
    assert proc.returncode == 0, proc.stderr
    launcher = "srun --mpi=pmi2 --kill-on-bad-exit=1" if _mpi_is_mpich() else None
    if launcher:
        assert log.read_text().splitlines() == [
            f"{launcher} {PY} -m fedmpi run {CFG} --out {out} {RUN_TAIL} --set runtime.threads=1"]
    # LAUNCHER still overrides
    log.unlink()
    proc = _sbatch(_script_env(bindir, log, SLURM_JOB_ID="5", OUT=str(out), LAUNCHER="mpirun"), CFG)
    assert log.read_text().splitlines() == [
        f"mpirun {PY} -m fedmpi run {CFG} --out {out} {RUN_TAIL} --set runtime.threads=1"]


def test_silo_sbatch_asks_for_silos_of_r_ranks(tmp_path):
    """slurm/silo.sbatch: R GPUs per silo (RANKS_PER_SILO, default 4) on the run's line."""
    bindir, log = _fake_bin(tmp_path)
    out = tmp_path / "out"
    env = _script_env(bindir, log, SLURM_JOB_ID="5", OUT=str(out), LAUNCHER="mpirun",
                      SLURM_CPUS_PER_TASK="8", RANKS_PER_SILO="2")
    proc = _sbatch(env, CFG, script="silo.sbatch")
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == [
        f"mpirun {PY} -m fedmpi run {CFG} --out {out} {RUN_TAIL} --set runtime.threads=8 "
        "--set runtime.ranks_per_silo=2"]


def test_sbatch_requeues_on_75_and_resumes_only_its_own_checkpoint(tmp_path):
    bindir, log = _fake_bin(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"")      # left by an older run in the same directory
    env = _script_env(bindir, log, SLURM_JOB_ID="4242", SLURM_CLUSTER_NAME="c",
                      SLURM_CPUS_PER_TASK="3", OUT=str(out), FAKE_RC="75", LAUNCHER="srun",
                      FAKE_CKPT=str(out / "checkpoint.pt"))
    line = f"srun {PY} -m fedmpi run {CFG} --out {out} {RUN_TAIL} --set runtime.threads=3"
    # a first start never resumes; 75 without a SIGTERM (scancel --signal=USR1) requeues
    proc = _sbatch(env, CFG, "--set", "train.rounds=7")
    assert proc.returncode == 75
    assert log.read_text().splitlines() == [f"{line} --set train.rounds=7", "scontrol requeue 4242"]
    assert "is not this job's; not resuming" in proc.stderr
    assert "requeue failed" not in proc.stderr
    # the requeued start resumes the checkpoint this job wrote; exit 0 → no requeue
    log.unlink()
    env.update(FAKE_RC="0", SLURM_RESTART_COUNT="1")
    proc = _sbatch(env, CFG)
    assert proc.returncode == 0
    assert log.read_text().splitlines() == [f"{line} --resume"]
    # another job restarted into the same directory does not take that checkpoint
    log.unlink()
    proc = _sbatch({**env, "SLURM_JOB_ID": "77"}, CFG)
    assert log.read_text().splitlines() == [line]
    # --resume given by hand continues on purpose, once
    log.unlink()
    proc = _sbatch({**env, "SLURM_RESTART_COUNT": "0"}, CFG, "--resume")
    assert log.read_text().splitlines() == [f"{line} --resume"]
    # the requeue limit holds
    log.unlink()
    env.update(FAKE_RC="75", SLURM_RESTART_COUNT="3", MAX_REQUEUES="3")
    proc = _sbatch(env, CFG)
    assert proc.returncode == 75 and "scontrol" not in log.read_text()


def test_requeue_already_done_is_not_reported_as_failed(tmp_path):
    bindir, log = _fake_bin(tmp_path)
    env = _script_env(bindir, log, SLURM_JOB_ID="8", OUT=str(tmp_path / "o"), FAKE_RC="75",
                      LAUNCHER="srun", FAKE_SCONTROL_ERR="Job is pending execution",
                      FAKE_CKPT=str(tmp_path / "o" / "checkpoint.pt"))
    proc = _sbatch(env, CFG)
    assert proc.returncode == 75
    assert "requeue failed" not in proc.stderr and "requeued already" in proc.stderr
    env["FAKE_SCONTROL_ERR"] = "Access/permission denied"
    proc = _sbatch(env, CFG)
    assert "requeue of job 8 failed: Access/permission denied" in proc.stderr


def _signal_running_script(tmp_path: Path, sig: int, script: str = "multinode.sbatch"):
    bindir, log = _fake_bin(tmp_path)
    env = _script_env(bindir, log, SLURM_JOB_ID="9", OUT=str(tmp_path / "o"), FAKE_SLEEP="1",
                      LAUNCHER="mpirun -n 4", FAKE_CKPT=str(tmp_path / "o" / "checkpoint.pt"))
    proc = subprocess.Popen(["bash", str(ROOT / "slurm" / script), CFG], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = Path(f"{log}.ready")
    wait_for(ready.exists, "the fake launcher's trap", 30, proc)   # the script's is set before
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, log.read_text().splitlines(), err


def test_sbatch_forwards_usr1_to_the_launcher_and_requeues(tmp_path):
    rc, calls, err = _signal_running_script(tmp_path, signal.SIGUSR1)   # --signal=B:USR1@T
    assert rc == 75, err
    assert calls[0].startswith(f"mpirun -n 4 {PY} -m fedmpi run {CFG} --out ")
    assert calls[1:] == ["mpirun got USR1", "scontrol requeue 9"]


def test_plain_scancel_checkpoints_and_stops_for_good(tmp_path):
    """scancel sends SIGTERM to the batch shell: checkpoint (USR1 to fedmpi), no requeue."""
    rc, calls, err = _signal_running_script(tmp_path, signal.SIGTERM, "fedmpi.sbatch")
    assert rc == 75, err
    assert calls[1:] == ["mpirun got USR1"]
    assert "not requeueing" in err


def test_stop_without_a_new_checkpoint_is_not_requeued(tmp_path):
    """Exit 75 that left checkpoint.pt as it was (stopped before a round ended): exit 1."""
    bindir, log = _fake_bin(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    (out / "checkpoint.pt").write_text("older")
    env = _script_env(bindir, log, SLURM_JOB_ID="11", OUT=str(out), FAKE_RC="75", LAUNCHER="srun")
    proc = _sbatch(env, CFG)
    assert proc.returncode == 1
    assert "scontrol" not in log.read_text()              # launched, never requeued
    lines = [ln for ln in proc.stderr.splitlines() if "not requeueing" in ln]
    assert len(lines) == 1 and "without writing a new checkpoint" in lines[0]
    assert "after writing a new checkpoint" not in proc.stderr
    assert (out / "checkpoint.pt").read_text() == "older"


def test_restarts_without_progress_are_bounded(tmp_path):
    """Slurm restarts the job (node failure, preemption) but no checkpoint appears."""
    bindir, log = _fake_bin(tmp_path)
    out = tmp_path / "o"
    env = _script_env(bindir, log, SLURM_JOB_ID="12", OUT=str(out), FAKE_RC="1", LAUNCHER="srun",
                      MAX_RESTARTS_WITHOUT_PROGRESS="2")
    launches = []
    for restart in range(5):
        log.unlink(missing_ok=True)
        proc = _sbatch({**env, "SLURM_RESTART_COUNT": str(restart)}, CFG)
        launches.append(log.exists())
        if restart == 1:            # this start wrote a checkpoint: progress, the count restarts
            (out / "checkpoint.pt").write_text("new")
    # restart 1: 1 without progress; 2 finds the new checkpoint (0); 3 and 4: 1 and 2
    assert launches == [True, True, True, True, True]
    log.unlink()
    proc = _sbatch({**env, "SLURM_RESTART_COUNT": "5"}, CFG)   # the 3rd in a row
    assert proc.returncode == 1
    line, = [ln for ln in proc.stderr.splitlines() if "not running again" in ln]
    assert "3 restarts in a row found no new checkpoint" in line
    assert not log.exists()                                   # nothing launched


def test_time_limit_shorter_than_the_signal_lead_is_adapted(tmp_path):
    """--time shorter than the #SBATCH --signal lead (600 s): the one early SIGUSR1
    is held and the wrapper stops fedmpi itself LEFT/4 before the end."""
    bindir, log = _fake_bin(tmp_path)
    out = tmp_path / "o"
    env = _script_env(bindir, log, SLURM_JOB_ID="13", OUT=str(out), FAKE_SLEEP="1",
                      LAUNCHER="srun", FAKE_CKPT=str(out / "checkpoint.pt"),
                      SLURM_JOB_END_TIME=str(int(time.time()) + 12))
    start = time.monotonic()
    proc = subprocess.Popen(["bash", str(ROOT / "slurm" / "fedmpi.sbatch"), CFG], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(Path(f"{log}.ready").exists, "the fake launcher's trap", 30, proc)
    proc.send_signal(signal.SIGUSR1)              # what Slurm sends at once
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == 75, err
    assert "signal (600 s before the end) would arrive 0 s into" in err
    assert "stopping 2 s before the end instead" in err or "stopping 3 s before" in err
    assert "before the adapted stop time" in err
    assert log.read_text().splitlines()[1:] == ["srun got USR1", "scontrol requeue 13"]
    assert 6 < took < 14                          # stopped by the timer (~9 s), not at once
    # a lead that fits leaves everything as it was
    log.unlink()
    env.update(FAKE_SLEEP="", FAKE_RC="0", SLURM_JOB_END_TIME=str(int(time.time()) + 3600))
    proc = _sbatch(env, CFG)
    assert proc.returncode == 0 and "warning" not in proc.stderr


def test_sweep_submission_and_tasks(tmp_path):
    bindir, log = _fake_bin(tmp_path)
    sweep = ROOT / "slurm" / "sweep_example.txt"
    env = _script_env(bindir, log, MAX_PARALLEL="4")
    proc = subprocess.run([str(ROOT / "slurm" / "submit-sweep.sh"), str(sweep), CFG], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == [
        f"sbatch --output=logs/%x-%A_%a.out --array=0-11%4 {ROOT / 'slurm' / 'sweep.sbatch'} "
        f"{sweep} {CFG}"]
    assert (tmp_path / "logs").is_dir()          # Slurm does not create it
    log.unlink()
    env.update(SLURM_JOB_ID="500", SLURM_ARRAY_JOB_ID="499", SLURM_ARRAY_TASK_ID="5",
               OUT_ROOT=str(tmp_path / "sw"), LAUNCHER="srun --mpi=pmi2")
    proc = _sbatch(env, str(sweep), CFG, script="sweep.sbatch")
    assert proc.returncode == 0, proc.stderr
    # task 5 = (seed index 1, alpha index 0, method index 1); the last key varies fastest
    out = tmp_path / "sw" / "5_seed=1_alpha=0.1_name=scaffold"
    assert log.read_text().splitlines() == [
        f"srun --mpi=pmi2 {PY} -m fedmpi run {CFG} --out {out} {RUN_TAIL}"
        " --set runtime.threads=1 --set seed=1 --set data.partition.alpha=0.1"
        " --set algorithm.name=scaffold"]
    env["SLURM_ARRAY_TASK_ID"] = "12"
    proc = _sbatch(env, str(sweep), CFG, script="sweep.sbatch")
    assert proc.returncode == 2 and "out of range" in proc.stderr


def test_launcher_dry_run(tmp_path):
    bindir, log = _fake_bin(tmp_path)
    env = {**_script_env(bindir, log), "CUDA_VISIBLE_DEVICES": "0,1"}
    env.pop("OMP_NUM_THREADS", None)
    cmd = [PY, str(ROOT / "launch" / "fedmpi-launch"), "-n", "5", "--mpirun",
           str(bindir / "mpirun"), "--python", "py", "--dry-run", "--", "run", CFG]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cores = os.cpu_count() or 1
    threads = max(1, cores // 5)
    over = " --oversubscribe" if 5 > cores else ""
    assert (f"OMP_NUM_THREADS={threads} {bindir / 'mpirun'} -n 5 --bind-to none{over} py -m fedmpi "
            f"run {CFG} --set runtime.threads={threads}") in proc.stderr
    assert "local rank 0 (aggregator) -> cuda:0" in proc.stderr
    assert "local rank 2 (worker) -> cuda:0" in proc.stderr
    assert "local rank 3 (worker) -> cuda:1" in proc.stderr
    assert log.read_text().splitlines() == ["mpirun --version"]     # dry run: nothing launched


def test_launcher_without_mpirun_names_the_python(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FEDMPI_MPIRUN"}
    env["PATH"] = str(tmp_path)                  # no mpirun/mpiexec anywhere
    python = tmp_path / "elsewhere" / "bin" / "python"
    proc = subprocess.run([PY, str(ROOT / "launch" / "fedmpi-launch"), "--python", str(python),
                           "--dry-run", "--", "run", CFG], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert f"no mpirun/mpiexec next to {python}" in proc.stderr
