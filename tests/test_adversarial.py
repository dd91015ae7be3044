"""Issues 30 and 31, "trust, round two": one test (at least) per reported failure.

30: 1 atomic run lock (+ heartbeat across hosts), 2 planted links, 3 untrusted logs and
checkpoints, 4 start-up timeout, 6 another user's run, 7 partition inputs (5, disk full
while the log grows: tests/test_trust.py checks that the log stays readable). 31: 1 double Ctrl-C / SIGTERM at start-up, 2 no success without
progress, 3 resume across versions. 28: 3 a rank that hangs or is slow mid-run is named
with its host when the round times out.
"""
from __future__ import annotations

import contextlib
import gc
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from conftest import ROOT, fedmpi_cmd
from fedmpi.cli import main as fedmpi_main
from fedmpi.config.fields import Field
from fedmpi.errors import RunDirError
from fedmpi.job.lock import LOCK_NAME, acquire, heartbeat, lock_holder, release

CFG = str(ROOT / "configs" / "quickstart.yaml")
FAST = ["--set", "train.rounds=2", "--set", "data.num_clients=4", "--set",
        "train.clients_per_round=2", "--set", "runtime.progress=false", "--set",
        "runtime.threads=1", "--set", "eval.every=1", "--set", "runtime.checkpoint_every=1"]


# ---------------------------------------------------------------- 30.1 the lock
def contend(out: Path, res_w: int, done_r: int, go_r: int | None = None, setup=None) -> None:
    """A forked child's life as a lock contender: (``setup()``,) wait for a byte on
    ``go_r``, take the lock of ``out``, write b"H" (held) or b"R" (refused) to ``res_w``,
    hold it until a byte arrives on ``done_r``, release and ``_exit`` (1 if anything
    else went wrong: a missing result)."""
    gc.disable()   # a parent's half-closed file object must not close our fd
    code = 0
    try:   # plain os calls only until _exit
        if setup is not None:
            setup()
        if go_r is not None:
            os.read(go_r, 1)
        try:
            acquire(out)
            os.write(res_w, b"H")
        except RunDirError:
            os.write(res_w, b"R")
        os.read(done_r, 1)
        release()
    except BaseException:  # noqa: BLE001 - reported as a missing result
        code = 1
    os._exit(code)


def _race(out: Path, contenders: int) -> bytes:
    """What each of ``contenders`` forked processes got (b"H" held, b"R" refused) when
    all take the lock at once; the holder keeps it until every contender has tried."""
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    done_r, done_w = os.pipe()
    pids = []
    for _ in range(contenders):
        pid = os.fork()
        if pid == 0:
            contend(out, res_w, done_r, go_r)
        pids.append(pid)
    os.write(go_w, b"g" * contenders)
    got = b"".join(os.read(res_r, 1) for _ in range(contenders))
    os.write(done_w, b"d" * contenders)
    for pid in pids:
        assert os.waitpid(pid, 0)[1] == 0
    for fd in (go_r, go_w, res_r, res_w, done_r, done_w):
        os.close(fd)
    return got


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale-takeover"])
def test_exactly_one_of_many_racing_processes_holds_the_lock(tmp_path, stale):
    for trial in range(20):
        out = tmp_path / f"t{trial}"
        out.mkdir()
        if stale:   # a lock left by a killed run on this host
            (out / LOCK_NAME).write_text(f"{socket.gethostname()} {_dead_pid()} - 0\n")
        got = _race(out, 6)
        assert got.count(b"H") == 1 and got.count(b"R") == 5, (trial, got)
        left = (out / LOCK_NAME).read_text() if (out / LOCK_NAME).exists() else ""
        assert not left, (left, os.getpid())    # the holder released it


def test_a_live_lock_on_another_host_is_respected_and_a_silent_one_taken_over(tmp_path):
    out = tmp_path / "x"
    out.mkdir()
    lock = out / LOCK_NAME
    lock.write_text("other-node 4242 - 1700000000 30\n")   # round_timeout 30 s there
    now = time.time()
    os.utime(lock, (now - 60, now - 60))                     # heartbeat 60 s ago < 3 x 30
    with pytest.raises(RunDirError) as err:
        acquire(out)
    msg = str(err.value)
    assert "pid 4242 on host other-node" in msg and "90 s after its last heartbeat" in msg
    assert "\n" not in msg
    holder = lock_holder(out)
    assert holder is not None and holder.host == "other-node" and not holder.stale(now)
    assert holder.stale(now + 31)                             # 91 s without a heartbeat
    os.utime(lock, (now - 91, now - 91))
    assert "other-node 4242" in acquire(out)          # taken over
    try:
        before = now - 30                   # a heartbeat 30 s ago: no clock-resolution race
        os.utime(lock, (before, before))
        heartbeat()
        assert lock.stat().st_mtime > before + 25
        mine = lock_holder(out)
        assert (mine.host, mine.pid) == (socket.gethostname(), os.getpid())
        assert not mine.stale()
    finally:
        release()
    assert not lock.exists()


def test_the_run_refreshes_the_lock_every_round(tmp_path, monkeypatch):
    beats = []
    from fedmpi.runtime import driver

    monkeypatch.setattr(driver, "heartbeat", lambda: beats.append(time.time()))
    assert fedmpi_main(["run", CFG, *FAST, "--set", "train.rounds=3",
                        "--out", str(tmp_path / "r")]) == 0
    assert len(beats) >= 3


# --------------------------------------------------------- 30.2 planted links
@pytest.mark.parametrize("name", ["config.yaml", ".checkpoint.pt.tmp-4242", "log.h5",
                                  LOCK_NAME])
def test_a_planted_link_in_the_run_directory_is_refused_and_never_followed(tmp_path, capsys,
                                                                           name):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(victim)
    capsys.readouterr()
    assert fedmpi_main(["run", CFG, *FAST, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out / name) in err[0] and "symbolic link" in err[0], err
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in out.iterdir()) == [name]


def test_atomic_writes_replace_a_link_at_the_target_instead_of_writing_through_it(tmp_path):
    import torch

    from fedmpi.job.outputs import save_atomic
    from fedmpi.job.safefile import write_text

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name, write in (("model.pt", lambda p: save_atomic({"w": torch.ones(2)}, p)),
                        ("summary.md", lambda p: write_text(p, "new\n"))):
        target = tmp_path / name
        target.symlink_to(victim)
        write(target)
        assert not target.is_symlink() and victim.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "summary.md", "victim.txt"]


def test_report_refuses_a_planted_link_in_its_output_directory(tmp_path, capsys):
    out = tmp_path / "r"
    assert fedmpi_main(["run", CFG, *FAST, "--out", str(out)]) == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (out / "report").mkdir()
    (out / "report" / "summary.md").symlink_to(victim)
    capsys.readouterr()
    assert fedmpi_main(["report", str(out / "log.h5")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "summary.md" in err[0] and "symbolic link" in err[0]
    assert victim.read_text() == "precious\n"


# --------------------------------------------------- 30.3 untrusted logs
@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-round run (seed 0), made in this process."""
    out = tmp_path_factory.mktemp("adv") / "prev"
    assert fedmpi_main(["run", CFG, *FAST, "--out", str(out)]) == 0
    return out


def _crafted_log(finished: Path, tmp_path: Path, add) -> Path:
    import shutil

    import h5py

    path = tmp_path / "log.h5"
    shutil.copy(finished / "log.h5", path)
    with h5py.File(path, "r+") as f:
        add(f)
    return path


@pytest.mark.parametrize("kind", ["external", "virtual", "huge-fill"])
def test_a_crafted_log_is_refused_in_one_line_naming_the_dataset(finished, tmp_path, capsys, kind):
    import h5py
    import numpy as np

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"host-secret-bytes" * 4)

    def add(f):
        if kind == "external":        # the bytes of another file, read as a dataset
            f.create_dataset("extra/leak", shape=(68,), dtype="u1", external=[(str(secret), 0, 68)])
        elif kind == "virtual":
            other = tmp_path / "other.h5"
            with h5py.File(other, "w") as g:
                g["x"] = np.arange(4.0)
            layout = h5py.VirtualLayout(shape=(4,), dtype="f8")
            layout[:] = h5py.VirtualSource(str(other), "x", shape=(4,))
            f.create_virtual_dataset("extra/virt", layout)
        else:                          # 1.5 GB of fill value in a file of a few hundred KB
            f.create_dataset("extra/huge", shape=(200_000, 1000), dtype="f8", chunks=(1000, 100),
                             fillvalue=1.0)
    path = _crafted_log(finished, tmp_path, add)
    from fedmpi.log.reader import read
    from fedmpi.errors import LogFormatError

    name = {"external": "/extra/leak", "virtual": "/extra/virt", "huge-fill": "/extra/huge"}[kind]
    with pytest.raises(LogFormatError, match=name):
        read(path)
    capsys.readouterr()
    assert fedmpi_main(["report", str(path), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and str(path) in err[0], err


# ------------------------------------------- 31.2 no success without progress
def test_a_run_that_accepts_no_update_for_n_rounds_fails_with_exit_1(tmp_path, monkeypatch,
                                                                      capsys):
    from fedmpi.methods import ALGORITHMS
    from fedmpi.log.reader import read

    cls = ALGORITHMS["fedavg"]
    original = cls.finish_client

    def poisoned(self, task, state, extras, out, result):   # every update NaN
        original(self, task, state, extras, out, result)
        out["delta"][0] = float("nan")

    monkeypatch.setattr(cls, "finish_client", poisoned)
    out = tmp_path / "stuck"
    assert fedmpi_main(["run", CFG, *FAST, "--set", "train.rounds=20", "--set",
                        "runtime.max_rounds_without_update=3", "--out", str(out)]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedmpi: error")]
    assert len(err) == 1 and "runtime.max_rounds_without_update=3" in err[0], err
    log = read(out / "log.h5")
    assert log.status == "failed" and list(log.rounds["round"]) == [0, 1, 2]
    assert not (out / "model.pt").exists()


# ------------------------------------- 30.3 / 31.2 untrusted checkpoints
@pytest.fixture(scope="module")
def scaffold_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("adv") / "scaffold"
    assert fedmpi_main(["run", CFG, *FAST, "--set", "algorithm.name=scaffold",
                        "--out", str(out)]) == 0
    return out


def _tamper(run: Path, tmp_path: Path, change) -> Path:
    """A copy of ``run`` whose checkpoint is changed by ``change`` and re-signed (a
    correct checksum: what an attacker or a buggy writer produces)."""
    import shutil

    import torch

    from fedmpi.job.checkpoint_file import digest

    out = tmp_path / "run"
    shutil.copytree(run, out)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    change(ckpt)
    ckpt.pop("checksum")
    ckpt["checksum"] = digest(ckpt)
    torch.save(ckpt, out / "checkpoint.pt")
    return out


def _first_client(ckpt) -> int:
    return min(ckpt["clients"])


@pytest.mark.parametrize("case,entry", [
    ("nan-client", "clients[{k}].c"), ("huge-global", "global_state"),
    ("short-client", "clients[{k}].c"), ("huge-server", "algorithm.c")])
def test_a_tampered_checkpoint_with_a_valid_checksum_is_refused_at_resume(scaffold_run, tmp_path,
                                                                         capsys, case, entry):
    import torch

    seen = {}

    def change(ckpt):
        k = seen["k"] = _first_client(ckpt)
        if case == "nan-client":
            ckpt["clients"][k]["c"][3] = float("nan")
        elif case == "huge-global":
            ckpt["global_state"][0] = 1e30
        elif case == "short-client":
            ckpt["clients"][k]["c"] = ckpt["clients"][k]["c"][:-7].clone()
        else:
            ckpt["components"]["algorithm"]["c"][1] = -3e25

    out = _tamper(scaffold_run, tmp_path, change)
    capsys.readouterr()
    code = fedmpi_main(["run", CFG, *FAST, "--set", "algorithm.name=scaffold", "--set",
                        "train.rounds=6", "--out", str(out), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and entry.format(k=seen["k"]) in err[0] and "checkpoint.pt" in err[0], err
    assert torch.load(out / "checkpoint.pt", weights_only=True)["round"] == 2   # untouched


# ------------------------------------------------ 31.3 resume across versions
def _all_keys_fingerprint(config_yaml: str) -> str:
    """The fingerprint of fedmpi releases before issue 31: SHA-256 of the sorted compact
    JSON of *every* run-defining key (so any key added later changed it)."""
    import hashlib
    import json

    import yaml

    flat, todo = {}, [("", yaml.safe_load(config_yaml))]
    while todo:                                   # nested mappings -> dotted keys
        prefix, tree = todo.pop()
        for k, v in tree.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict):
                todo.append((key, v))
            else:
                flat[key] = v
    keys = {k: v for k, v in flat.items()
            if k not in ("name", "train.rounds", "data.root", "data.download")
            and not k.startswith(("eval.", "runtime."))}
    return hashlib.sha256(json.dumps(keys, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


@pytest.fixture
def previous_release(finished, tmp_path) -> Path:
    """``finished`` as the previous release wrote it: its fingerprint over every key."""
    import h5py

    def change(ckpt):
        ckpt["fingerprint"] = _all_keys_fingerprint(ckpt["config_yaml"])
    out = _tamper(finished, tmp_path, change)
    with h5py.File(out / "log.h5", "r+") as f:
        f.attrs["fingerprint"] = _all_keys_fingerprint(f.attrs["config_yaml"])
    return out


@pytest.fixture
def new_key(monkeypatch):
    """This release adds a run-defining key whose default keeps the old behaviour."""
    from fedmpi.config import schema as config

    monkeypatch.setitem(config.SCHEMA, "train.new_knob", Field(float, 0.0, "a new key"))
    return "train.new_knob"


def test_a_checkpoint_of_the_previous_schema_resumes_after_a_key_was_added(previous_release,
                                                                           new_key):
    import torch

    from fedmpi.log.reader import read

    assert fedmpi_main(["run", CFG, *FAST, "--set", "train.rounds=3", "--out",
                        str(previous_release), "--resume"]) == 0
    assert torch.load(previous_release / "checkpoint.pt", weights_only=True)["round"] == 3
    assert list(read(previous_release / "log.h5").rounds["round"]) == [0, 1, 2]


def test_the_added_key_away_from_its_default_is_another_run(previous_release, new_key, capsys):
    capsys.readouterr()
    assert fedmpi_main(["run", CFG, *FAST, "--set", "train.rounds=3", "--set",
                        f"{new_key}=0.5", "--out", str(previous_release), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"config key {new_key!r} (not set there, 0.5 now)" in err[0], err


# -------------------------------------------------- 30.7 partition inputs
def _partition_check(path: Path, capsys) -> str:
    capsys.readouterr()
    assert fedmpi_main(["partition", CFG, "--set", "data.num_clients=2", "--set",
                        "train.clients_per_round=2", "--set",
                        "data.partition.method=file", "--set", f"data.partition.file={path}",
                        "--out", str(path.parent / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0], err
    return err[0]


def test_a_partition_json_with_a_duplicate_key_is_refused(tmp_path, capsys):
    path = tmp_path / "part.json"
    path.write_text('{"clients": [[0, 1], [2, 3]], "clients": [[4, 5], [6, 7]]}')
    assert "'clients' appears twice" in _partition_check(path, capsys)


def test_a_partition_npz_with_a_duplicate_member_is_refused(tmp_path, capsys):
    import io
    import zipfile

    import numpy as np

    path = tmp_path / "part.npz"
    with zipfile.ZipFile(path, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")   # zipfile warns "Duplicate name": the point here
        for name, ix in (("client_0", [0, 1]), ("client_1", [2, 3]), ("client_0", [4, 5])):
            buf = io.BytesIO()
            np.save(buf, np.array(ix))
            z.writestr(f"{name}.npy", buf.getvalue())
    assert "'client_0' appears 2 times" in _partition_check(path, capsys)


def test_a_silo_label_of_2_to_the_40_is_refused_before_allocating(tmp_path):
    import numpy as np

    from fedmpi.config.schema import config_from_dict
    from fedmpi.data.silos import read_silo
    from fedmpi.data.tabular import write_table
    from fedmpi.errors import DataError

    write_table(tmp_path / "0.csv", np.ones((3, 2)), np.array([0, 1, 2 ** 40]))
    cfg = config_from_dict({"data": {"num_clients": 1, "partition": {"method": "silos"},
                                     "silos": {"path": str(tmp_path / "{client}.csv"),
                                               "test": str(tmp_path / "0.csv")}}})
    with pytest.raises(DataError, match=r"0\.csv: label 1099511627776 is not a class id"):
        read_silo(cfg, 0)


# ---------------------------------------------- 30.4 slow ranks at start-up
def _mpi_run(args: list[str], n: int, env: dict | None = None, timeout: float = 120):
    from conftest import mpiexec_path

    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    t0 = time.monotonic()
    proc = subprocess.run([mpi, "-n", str(n), *fedmpi_cmd(*args)], cwd=ROOT, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": str(ROOT / "tests"), **(env or {})},
                          capture_output=True, text=True)
    return proc, time.monotonic() - t0


def _mpi_start(args: list[str], env: dict | None = None,
               command: list[str] | None = None) -> subprocess.Popen:
    """``mpiexec -n 3 fedmpi ARGS`` (or ``command ARGS``) in the background, stderr piped."""
    from conftest import mpiexec_path

    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found")
    return subprocess.Popen([mpi, "-n", "3", *(command or fedmpi_cmd()), *args], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("fedmpi: error")]


SLOW = ["--set", "data.dataset=slow_start:digits", "--set", "data.num_clients=4", "--set",
        "train.clients_per_round=4"]


@pytest.mark.mpi
def test_a_slow_rank_at_start_up_is_named_in_one_line_after_setup_timeout(tmp_path):
    proc, took = _mpi_run(["run", CFG, *FAST, *SLOW, "--set", "runtime.setup_timeout=4",
                           "--out", str(tmp_path / "slow")], 3,
                          {"FEDMPI_SLOW_RANK": "2", "FEDMPI_SLOW_SECONDS": "60"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert took < 50 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = _errors(proc.stderr)
    assert len(errors) == 1 and \
        f"rank 2 (host {socket.gethostname()}) did not finish loading its data" in errors[0] \
        and "runtime.setup_timeout=4" in errors[0], proc.stderr[-3000:]


@pytest.mark.mpi
def test_a_slow_rank_within_setup_timeout_starts_even_with_a_short_round_timeout(tmp_path):
    from fedmpi.log.reader import read

    out = tmp_path / "slowok"
    proc, _ = _mpi_run(["run", CFG, *FAST, *SLOW, "--set", "runtime.round_timeout=10",
                        "--out", str(out)], 3,
                       {"FEDMPI_SLOW_RANK": "2", "FEDMPI_SLOW_SECONDS": "15"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read(out / "log.h5").status == "completed"


@pytest.mark.mpi
def test_a_tiny_round_timeout_ends_with_one_line_and_no_traceback(tmp_path):
    from fedmpi.log.reader import read

    out = tmp_path / "tiny"
    proc, _ = _mpi_run(["run", CFG, *FAST, "--set", "runtime.round_timeout=0.01",
                        "--out", str(out)], 3)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = _errors(proc.stderr)
    assert len(errors) == 1 and "runtime.round_timeout=0.01" in errors[0], proc.stderr[-3000:]
    assert read(out / "log.h5").status == "failed"


# ------------------------------------- 28.3 a round timeout names the missing ranks
def _launched_rank_pid(root: int, rank: int) -> int:
    """The pid of MPI rank ``rank`` among the descendants of process ``root`` (the
    launcher sets PMI_RANK in each rank's environment)."""
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:   # gone meanwhile
            continue
        if f"PMI_RANK={rank}".encode() in env:
            return pid
        todo.extend(int(c) for c in children)
    raise AssertionError(f"no process of rank {rank} under pid {root}")


@pytest.mark.mpi
@pytest.mark.parametrize("threads", ["multiple", "serialized"])
def test_a_hung_rank_is_named_with_its_host_after_the_round_timeout(tmp_path, threads):
    """A rank frozen mid-run (SIGSTOP: under mpiexec a SIGKILLed rank makes MPICH's
    launcher end the whole job at once, before fedmpi can say anything) is named,
    with its host, in rank 0's one error line; the live rank answers the ping and is
    not named as silent; exit 1. Without MPI_THREAD_MULTIPLE (mpi4py's thread level
    "serialized") the live rank answers from its wait instead of a thread."""
    import signal

    from conftest import wait_rounds
    from fedmpi.log.reader import read

    out = tmp_path / "hung"
    proc = _mpi_start(["run", CFG, *FAST, "--set", "train.rounds=500", "--set",
                       "runtime.round_timeout=5", "--out", str(out)],
                      {"MPI4PY_RC_THREAD_LEVEL": threads})
    stopped = None
    try:
        wait_rounds(out, 1, proc)
        stopped = _launched_rank_pid(proc.pid, 2)
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    errors = _errors(err)
    host = socket.gethostname()
    assert len(errors) == 1, err[-3000:]
    reasons = "hung or unreachable" if threads == "multiple" else \
        "hung, unreachable or busy outside MPI"
    # rank 2 and only rank 2 is silent (rank 1 answers: not named, or named as alive
    # when rank 0 is stuck in a collective rank 1 has passed, e.g. the state Bcast)
    assert f"runtime.round_timeout=5s: rank 2 (host {host}) did not answer within 3s " \
        f"(dead, {reasons})" in errors[0], errors
    assert took < 5 + 3 + 15, took   # round_timeout + the ping's grace + teardown
    log = read(out / "log.h5")
    assert log.status == "failed" and any("rank 2 (host" in e for e in log.events["message"])
    assert not (out / LOCK_NAME).exists()    # released before the abort


@pytest.mark.mpi
def test_a_rank_alive_but_slower_than_the_round_timeout_is_named_as_alive(tmp_path):
    """Rank 2 trains 30 s longer in round 1 (tests/slow_start.py): rank 0's collective
    times out after 5 s, and rank 2, still computing, answers the ping from its
    thread: named as alive, with the collective it has not reached."""
    proc, took = _mpi_run(["run", CFG, *FAST, "--set", "train.rounds=3", "--set",
                           "algorithm.name=slow_start:SlowFedAvg", "--set",
                           "runtime.round_timeout=5", "--out", str(tmp_path / "slow")], 3,
                          {"FEDMPI_SLOW_RANK": "2", "FEDMPI_SLOW_ROUND": "1",
                           "FEDMPI_SLOW_SECONDS": "60"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert took < 40, took
    errors = _errors(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("fedmpi: error: round 1 ") and \
        f"rank 2 (host {socket.gethostname()}) is alive but has not reached round 1 " \
        in errors[0] and "did not answer" not in errors[0], errors


# ------------------------------------------------------- 31.1 signals
@pytest.mark.mpi
def test_two_sigints_to_rank_0_end_every_rank_within_seconds(tmp_path):
    import signal

    from conftest import wait_for, wait_rounds
    from fedmpi.log.reader import read

    out = tmp_path / "ctrlc"
    seen = tmp_path / "signal-seen"
    # rounds of seconds: the graceful stop the first SIGINT asks for must still be under
    # way when the second one arrives (with 2-epoch rounds it could finish at once)
    proc = _mpi_start(["run", CFG, *FAST, "--set", "train.rounds=500", "--set",
                       "train.local_epochs=40", "--out", str(out)],
                      {"FEDMPI_SIGNAL_SEEN": str(seen)},
                      command=[sys.executable, str(ROOT / "tests" / "signal_probe.py")])
    try:
        wait_rounds(out, 1, proc)
        rank0 = int(read(out / "log.h5").attrs["writer_pid"])
        os.kill(rank0, signal.SIGINT)
        # handshake: the second only once rank 0 has handled the first (two SIGINTs that
        # arrive before Python runs the handler are handled once)
        mark = Path(f"{seen}.{rank0}")
        wait_for(lambda: mark.exists() and mark.read_text() == f"{int(signal.SIGINT)}\n",
                 "rank 0 handling the first SIGINT", 60, proc)
        os.kill(rank0, signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert took < 20, took
    assert proc.returncode != 0 and "Traceback" not in err, err[-3000:]
    assert any("interrupted twice" in line for line in _errors(err)), err[-3000:]
    log = read(out / "log.h5")      # not left "running": failed, and the event says why
    assert log.status == "failed"
    assert any("interrupted twice" in str(e) for e in log.events["message"]), log.events


# SIGTERM during start-up: tests/test_trust_r3.py (issue 40.6: handshake, no sleep)


# ------------------------------------------- 30.6 another user's run dir
@pytest.fixture
def sticky(finished):
    """A /tmp-style directory (mode 1777) holding a finished run of root."""
    import shutil
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root to run a second user")
    base = Path(tempfile.mkdtemp(prefix="fedmpi-sticky-", dir="/tmp"))
    base.chmod(0o1777)
    shutil.copytree(finished, base / "run")
    (base / "run").chmod(0o1777)
    yield base / "run"
    shutil.rmtree(base, ignore_errors=True)


def _as_nobody(args: list[str]) -> tuple[int, str]:
    """``fedmpi ARGS`` as user nobody: a forked child of this process (whose Python lives
    under root's 0700 home) drops to nobody's uid and runs the CLI; (exit code, stderr)."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.dup2(err_w, 2)
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            sys.stderr = os.fdopen(2, "w", closefd=False)
            # a forked child cannot use the CUDA its parent (another test) initialised
            code = fedmpi_main([*args, "--set", "runtime.device=cpu"])
        except SystemExit as exc:
            code = int(exc.code or 0)
        except BaseException as exc:  # noqa: BLE001 - reported through the pipe
            print(f"Traceback: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(err_w)
    with os.fdopen(err_r) as f:
        err = f.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err


@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
def test_a_second_user_over_another_users_run_is_told_whose_files_in_one_line(sticky, flag):
    code, err = _as_nobody(["run", CFG, *FAST, "--set", "train.rounds=3", "--out", str(sticky),
                            flag])
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "of user root (uid 0)" in lines[0] and "you (nobody" in lines[0] \
        and "another --out" in lines[0], lines


def test_a_killed_run_of_another_user_leaves_a_lock_named_as_theirs(sticky):
    (sticky / LOCK_NAME).write_text(f"{socket.gethostname()} {_dead_pid()} - 0 600\n")
    code, err = _as_nobody(["run", CFG, *FAST, "--set", "train.rounds=3", "--out", str(sticky),
                            "--resume"])
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and LOCK_NAME in lines[0] and "user root (uid 0)" in lines[0] \
        and "that is gone" in lines[0], lines
