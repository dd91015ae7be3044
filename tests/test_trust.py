"""Issue 18, "runs you can trust": one test (at least) per reported failure.

1 stale checkpoints / killed-before-first-checkpoint resume, 2 resume with a changed
run-defining key (fingerprint), 3 two writers (lock), 4 fresh run over a previous run,
5 non-finite values, 6 checkpoint integrity (also in test_bad_input), 7 disk full,
8 signals, 10 model.pt independent of the world size, 11 a killed run's log.
Item 9 is the table of tests/test_bad_input.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import h5py
import pytest
import torch
import yaml

from conftest import ROOT, fedmpi_cmd, mpiexec_path, run_fedmpi, wait_rounds
from fedmpi.job import signals
from fedmpi.methods import ALGORITHMS
from fedmpi.cli import main as fedmpi_main
from fedmpi.log.reader import read
from fedmpi.errors import EXIT_INTERRUPTED
from fedmpi.runtime.federation import Federation

CFG = str(ROOT / "configs" / "quickstart.yaml")
FAST = ["--set", "train.rounds=2", "--set", "data.num_clients=4", "--set",
        "train.clients_per_round=2", "--set", "runtime.progress=false", "--set",
        "runtime.threads=1", "--set", "eval.every=1", "--set", "runtime.checkpoint_every=1"]
#: What the README promises may change on --resume; everything else is run-defining.
MAY_CHANGE = ("name", "train.rounds", "data.root", "data.download")
MAY_CHANGE_PREFIXES = ("eval.", "runtime.")


def _expected_fingerprint(config_yaml: str) -> str:
    """SHA-256 of the sorted compact JSON of the run-defining keys that differ from their
    schema default (issue 31: keys a later release adds leave it unchanged), computed here."""
    from fedmpi.config.schema import SCHEMA

    def flat(tree, prefix=""):
        out = {}
        for k, v in tree.items():
            key = f"{prefix}.{k}" if prefix else k
            out.update(flat(v, key) if isinstance(v, dict) else {key: v})
        return out
    keys = {k: v for k, v in flat(yaml.safe_load(config_yaml)).items()
            if k not in MAY_CHANGE and not k.startswith(MAY_CHANGE_PREFIXES)
            and not (k in SCHEMA and v == SCHEMA[k].default)}
    text = json.dumps(keys, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _ckpt(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=True)


def _popen(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(fedmpi_cmd(*args), cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def previous(tmp_path_factory) -> Path:
    """A finished 2-round run (seed 0), made in this process."""
    out = tmp_path_factory.mktemp("trust") / "prev"
    assert fedmpi_main(["run", CFG, *FAST, "--out", str(out)]) == 0
    return out


# ------------------------------------------------------------ 1 and 4
def test_fresh_run_over_a_previous_run_is_refused_and_overwrite_replaces_it(previous, tmp_path,
                                                                            capsys):
    out = tmp_path / "run"
    shutil.copytree(previous, out)
    old = _ckpt(out)
    capsys.readouterr()
    assert fedmpi_main(["run", CFG, *FAST, "--set", "seed=1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(out) in err and "--overwrite" in err and "--resume" in err
    assert torch.equal(_ckpt(out)["global_state"], old["global_state"])   # nothing touched
    # a previous run's model.pt alone also counts
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(previous / "model.pt", lone / "model.pt")
    assert fedmpi_main(["run", CFG, *FAST, "--out", str(lone)]) == 2

    assert fedmpi_main(["run", CFG, *FAST, "--set", "seed=1", "--out", str(out),
                        "--overwrite"]) == 0
    new = _ckpt(out)
    log = read(out / "log.h5")
    assert yaml.safe_load(new["config_yaml"])["seed"] == 1 == log.config["seed"]
    assert new["fingerprint"] == _expected_fingerprint(new["config_yaml"])
    assert log.attrs["fingerprint"] == new["fingerprint"] != old["fingerprint"]
    assert list(log.rounds["round"]) == [0, 1] and "resumed_world_sizes" not in log.attrs
    # --resume now continues the new run, not the old one
    assert fedmpi_main(["run", CFG, *FAST, "--set", "seed=1", "--set", "train.rounds=3",
                        "--out", str(out), "--resume"]) == 0
    assert list(read(out / "log.h5").rounds["round"]) == [0, 1, 2]


def test_resume_of_a_run_killed_before_its_first_checkpoint_is_refused(previous, tmp_path, capsys):
    out = tmp_path / "killed"
    out.mkdir()
    shutil.copy(previous / "log.h5", out / "log.h5")      # a log, no checkpoint yet
    with h5py.File(out / "log.h5", "r+") as f:
        f.attrs["status"] = "running"
    capsys.readouterr()
    assert fedmpi_main(["run", CFG, *FAST, "--set", "train.rounds=4", "--out", str(out),
                        "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'checkpoint.pt'}: missing" in err and "--overwrite" in err
    assert read(out / "log.h5").num_rounds == 2 and not (out / "checkpoint.pt").exists()
    assert fedmpi_main(["run", CFG, *FAST, "--out", str(out), "--overwrite"]) == 0
    log = read(out / "log.h5")
    assert list(log.rounds["round"]) == [0, 1] and log.status == "completed"


def test_slurm_restart_without_checkpoint_overwrites(tmp_path):
    from test_slurm import _fake_bin, _script_env

    bindir, calls = _fake_bin(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.h5").write_bytes(b"")
    (out / ".slurm-job").write_text("cluster:1\n")   # this job's own earlier start
    env = _script_env(bindir, calls, SLURM_JOB_ID="1", SLURM_CPUS_PER_TASK="1", OUT=str(out),
                      SLURM_RESTART_COUNT="1")
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "fedmpi.sbatch"), CFG], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert calls.read_text().splitlines()[0].endswith("--set runtime.threads=1 --overwrite")


# ------------------------------------------------------------------- 2
@pytest.mark.parametrize("key, value", [("seed", 5), ("data.partition.alpha", 0.1),
                                        ("data.partition.method", "iid"),
                                        ("aggregation.weighting", "uniform"),
                                        ("algorithm.fedprox.mu", 0.5), ("train.lr", 0.01)])
def test_resume_with_a_changed_run_defining_key_exits_2_naming_it(previous, tmp_path, capsys,
                                                                   key, value):
    out = tmp_path / "run"
    shutil.copytree(previous, out)
    capsys.readouterr()
    assert fedmpi_main(["run", CFG, *FAST, "--set", f"{key}={value}", "--set", "train.rounds=3",
                        "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"config key {key!r}" in err and "checkpoint.pt" in err
    assert read(out / "log.h5").num_rounds == 2


def test_resume_may_change_rounds_eval_and_runtime(previous, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(previous, out)
    assert fedmpi_main(["run", CFG, *FAST, "--set", "train.rounds=3", "--set", "eval.every=2",
                        "--set", "runtime.checkpoint_every=0", "--set", "name=renamed",
                        "--out", str(out), "--resume"]) == 0
    ckpt = _ckpt(out)
    assert ckpt["round"] == 3 and ckpt["fingerprint"] == _ckpt(previous)["fingerprint"]
    assert read(out / "log.h5").attrs["fingerprint"] == ckpt["fingerprint"]


# ------------------------------------------------------------------- 3
def test_second_writer_exits_2_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path, capsys):
    out = tmp_path / "shared"
    first = _popen(["run", CFG, *FAST, "--set", "train.rounds=500", "--out", str(out)])
    try:
        wait_rounds(out, 1, first)
        capsys.readouterr()
        assert fedmpi_main(["run", CFG, *FAST, "--out", str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"pid {first.pid} on host {socket.gethostname()}" in err
        assert first.poll() is None and read(out / "log.h5").num_rounds >= 1   # untouched
    finally:
        first.kill()                                  # SIGKILL: its lock stays behind
        first.communicate()
    assert (out / ".fedmpi.lock").exists()
    assert fedmpi_main(["run", CFG, *FAST, "--out", str(out), "--overwrite"]) == 0
    log = read(out / "log.h5")
    assert log.status == "completed" and list(log.rounds["round"]) == [0, 1]
    assert any("stale lock" in m and str(first.pid) in m for m in log.events["message"])
    assert not (out / ".fedmpi.lock").exists()        # released at the end


# ------------------------------------------------------------------- 5
@pytest.mark.parametrize("override", ["algorithm.server_lr=.inf", "train.lr=.inf",
                                      "train.weight_decay=.inf", "adversary.factor=.nan",
                                      "train.lr=1e300"])
def test_non_finite_config_values_exit_2(override, capsys):
    assert fedmpi_main(["check", CFG, "--set", override]) == 2
    assert f"'{override.split('=')[0]}'" in capsys.readouterr().err


def test_non_finite_global_model_stops_with_exit_1_keeping_the_last_checkpoint(tmp_path,
                                                                               monkeypatch, capsys):
    cls = ALGORITHMS["fedavg"]
    original = cls.server_update

    def poisoned(self, state, agg, info):   # the aggregate of round 2 diverges
        original(self, state, agg, info)
        if info.round == 2:
            state[0] = float("inf")

    monkeypatch.setattr(cls, "server_update", poisoned)
    out = tmp_path / "div"
    assert fedmpi_main(["run", CFG, *FAST, "--set", "train.rounds=4", "--out", str(out)]) == 1
    assert "non-finite" in capsys.readouterr().err
    log = read(out / "log.h5")
    assert log.status == "failed" and list(log.rounds["round"]) == [0, 1]
    ckpt = _ckpt(out)
    assert ckpt["round"] == 2 and bool(torch.isfinite(ckpt["global_state"]).all())
    assert not (out / "model.pt").exists()


# ------------------------------------------------------------------- 7
@pytest.fixture
def small_disk(tmp_path):
    """A real small file system (tmpfs); needs root and mount."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_at_a_checkpoint_exits_1_with_one_line_and_the_last_checkpoint_intact(small_disk):
    out = small_disk / "run"        # checkpoint 1 (1.6 MB) fits, a second copy beside it not
    proc = run_fedmpi(["run", CFG, *FAST, "--set", "train.rounds=5", "--out", str(out)], n=0,
                      check=False, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"fedmpi: error: {out / 'checkpoint.pt'}: cannot write (No space left on device)"]
    ckpt = _ckpt(out)
    assert ckpt["round"] == 1 and bool(torch.isfinite(ckpt["global_state"]).all())
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "config.yaml", "log.h5"]


def test_disk_full_while_the_log_grows_exits_1_with_one_line(small_disk):
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    out = small_disk / "run"
    # 300 clients: the [R, K] client datasets need a new chunk every few rounds, so the
    # log itself must grow while the disk is full (a model without BatchNorm: clients of 4)
    proc = _popen(["run", CFG, *FAST, "--set", "train.rounds=400", "--set", "data.num_clients=300",
                   "--set", "model.norm=gn", "--set", "data.partition.method=iid",
                   "--set", "runtime.checkpoint_every=0", "--out", str(out)])
    try:
        wait_rounds(out, 1, proc)
        with pytest.raises(OSError):
            with open(small_disk / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]                  # not 139 (segfault)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"fedmpi: error: {out / 'log.h5'}: cannot write (No space left "
                               "on device); the log is kept as of its last flush (")
    assert not (out / "model.pt").exists()
    log = read(out / "log.h5")      # issue 30: readable up to its last flushed round
    n = log.num_rounds
    assert n >= 1 and list(log.rounds["round"]) == list(range(n))
    assert lines[0].endswith(f"({n} rounds)")   # issue 40: exactly the rounds it says
    assert log.clients["selected"].shape == (n, 300)


# ------------------------------------------------------------------- 8
@pytest.mark.mpi
def test_second_sigterm_during_the_exit_keeps_status_75(tmp_path):
    """SIGTERM to mpiexec (forwarded to every rank), then again once rank 0 has said it
    stops: the ranks are finalising MPI by then; the job must still end with 75."""
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    out = tmp_path / "sig"
    proc = subprocess.Popen([mpi, "-n", "2", *fedmpi_cmd("run", CFG, *FAST, "--set",
                                                         "train.rounds=500", "--out", str(out))],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_rounds(out, 1, proc)
        proc.send_signal(signal.SIGTERM)
        line = proc.stderr.readline()
        while line and not line.startswith("fedmpi: interrupted"):
            line = proc.stderr.readline()
        assert line, "no interrupted line"
        proc.send_signal(signal.SIGTERM)        # the run has returned; the ranks are exiting
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED
    assert read(out / "log.h5").status == "interrupted"


def test_stop_signals_stay_ignored_after_a_stop_in_the_fedmpi_process():
    saved = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    before = saved[signal.SIGTERM]
    signals.install()
    signals.request("SIGTERM")
    signals.restore()
    assert signal.getsignal(signal.SIGTERM) == before       # embedding / tests: put back
    try:
        signals.hold_after_stop()                            # what `fedmpi` itself does
        signals.install()
        signals.restore()
        assert signal.getsignal(signal.SIGTERM) == before    # no stop requested: put back
        signals.install()
        signals.request("SIGTERM")
        signals.restore()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signals._hold = False
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_sigterm_during_start_up_reports_no_checkpoint(tmp_path, monkeypatch, capsys):

    real = Federation.__init__

    def slow_start(self, *args, **kwargs):
        real(self, *args, **kwargs)
        signals.request("SIGTERM")              # arrives before round 0

    monkeypatch.setattr(Federation, "__init__", slow_start)
    out = tmp_path / "early"
    assert fedmpi_main(["run", CFG, *FAST, "--out", str(out)]) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert not (out / "checkpoint.pt").exists()
    assert "round -1" not in err and str(out / "checkpoint.pt") not in err
    # a run stopped before it logged a round leaves nothing that blocks the plain rerun
    # (issue 48, item 3): no log, no model, and the line says so
    assert "nothing of it was kept" in err and "run the same command again" in err, err
    assert not (out / "log.h5").exists() and not (out / "model.pt").exists()


# ------------------------------------------------------------------ 10
def test_model_pt_holds_no_rank_local_batch_counts(previous):
    model = torch.load(previous / "model.pt", weights_only=True)
    counts = {k: int(v) for k, v in model.items() if k.endswith("num_batches_tracked")}
    assert counts and set(counts.values()) == {0}, counts
    g = _ckpt(previous)["global_state"]       # the float entries are θ (in another order)
    floats = torch.cat([v.reshape(-1) for v in model.values() if v.is_floating_point()])
    assert floats.numel() == g.numel()
    assert torch.equal(floats.sort().values, g.sort().values)


# (model.pt, num_batches_tracked included, is the same file at world sizes 1 and 3:
# tests/test_exact.py compares the bytes of -n 3 and alone)


# ------------------------------------------------------------------ 11
def test_a_killed_runs_log_is_reported_as_ended_without_final_status(tmp_path, capsys):
    out = tmp_path / "killed"
    t0 = time.time()
    proc = _popen(["run", CFG, *FAST, "--set", "train.rounds=500", "--out", str(out)])
    try:
        wait_rounds(out, 2, proc)
    finally:
        proc.kill()
        proc.communicate()
    log = read(out / "log.h5")
    assert log.status == "running"
    assert t0 < log.attrs["flushed_at"] <= time.time() and log.attrs["writer_pid"] == proc.pid
    assert fedmpi_main(["report", str(out / "log.h5"), "--out", str(tmp_path / "rep")]) == 0
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert "ended without a final status" in summary and f"pid {proc.pid}" in summary
    capsys.readouterr()
    assert fedmpi_main(["compare", str(out / "log.h5")]) == 0
    assert "ended without a final status" in capsys.readouterr().out

    # a writer on another host: decided by the time of the last flush
    other = tmp_path / "other.h5"
    shutil.copy(out / "log.h5", other)
    with h5py.File(other, "r+") as f:
        f.attrs.update(writer_host="elsewhere", flushed_at=time.time() - 4000.0)
    assert fedmpi_main(["compare", str(other)]) == 0
    text = capsys.readouterr().out
    assert "ended without a final status" in text and "runtime.round_timeout" in text
    with h5py.File(other, "r+") as f:
        f.attrs["flushed_at"] = time.time()            # a live run elsewhere: no note
    assert fedmpi_main(["compare", str(other)]) == 0
    assert "ended without a final status" not in capsys.readouterr().out
